"""The worker process: one engine in a role (prefill, decode or both) that joins a router.

`cli` is `pdserve worker`: it builds the engine and its KV bridge, calibrates
the engine's costs, and registers and beats to the router. `app` is the
control API the router drives it through (`/internal/*`, bodies from
pdserve/control_api.py); `kv_publisher` numbers the block manager's KV events
for the router's prefix index.

Nothing else in pdserve imports this package: the router reaches a worker over
HTTP and the KV bridge, and the launchers start it as a process (`pdserve
worker`), so a worker can run anywhere they can reach.
"""
