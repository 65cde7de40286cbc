"""Run an app under uvicorn with a drain on SIGTERM / SIGINT.

Every pdserve process (collocated server, router, worker) stops the same way:

1. the first signal stops admission: the listener stays open, so a request
   that arrives now gets a clear 503 with `Retry-After` instead of a refused
   connection;
2. requests in flight get up to `grace_s` to finish;
3. whatever is still running then ends with a 503 error event, and the
   process exits 0 (after its atexit hooks, which remove shared-memory files).

A second signal exits at once. A worker asked to leave its pool
(`/internal/drain`) goes the same way through `start_drain`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

from pdserve.server.engine_client import EngineClient
from pdserve.server.errors import APIError

log = logging.getLogger("pdserve.server")


class DrainingServer(uvicorn.Server):
    """Drains `engine` (AsyncEngine, the router's DisaggEngine) through its `draining`,
    `num_in_flight` and `fail_all(err)`."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, grace_s: float, on_drain=None):
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s
        self.on_drain = on_drain  # called once when the drain starts (e.g. tell the router)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self.exit_code: int | None = None  # set by `exit`; else 0, or 1 if the port never bound

    def exit(self, code: int) -> None:
        """Stop now with `code` (from the loop): nothing was served, nothing to drain."""
        self.exit_code = code
        self.should_exit = True

    @property
    def status(self) -> int:
        """The process's exit status once `run` returned."""
        return self.exit_code if self.exit_code is not None else (0 if self.started else 1)

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame):
        if self._draining or self._loop is None or not self.started:
            self.force_exit = self.should_exit = True  # a second signal, or nothing to drain yet
        else:
            self.start_drain()
        # exit 0 after a clean drain instead of re-raising the signal (which would skip atexit)
        self._captured_signals.clear()

    def start_drain(self) -> bool:
        """Begin the drain (from any thread); False if it had begun already."""
        if self._draining or self._loop is None:
            return False
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))
        return True

    async def _drain(self) -> None:
        self.engine.draining = True
        log.info("draining", extra={"fields": {"in_flight": self.engine.num_in_flight, "grace_s": self.grace_s}})
        if self.on_drain is not None:
            try:
                await self.on_drain()
            except Exception as e:  # the drain goes on; the router notices us leaving anyway
                log.warning("drain notice failed: %s", e)
        deadline = time.monotonic() + self.grace_s
        while self.engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.engine.num_in_flight:
            log.warning("drain timed out", extra={"fields": {"in_flight": self.engine.num_in_flight}})
            self.engine.fail_all(APIError(503, "the server shut down before this request finished"))
            await asyncio.sleep(0.2)  # let the error events reach their clients
        self.should_exit = True


def make_server(
    app, host: str, port: int, engine: EngineClient, grace_s: float, on_drain=None, **config
) -> DrainingServer:
    cfg = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
        **config,
    )
    return DrainingServer(cfg, engine, grace_s, on_drain)


def serve(
    app, host: str, port: int, engine: EngineClient, grace_s: float, on_drain=None, sockets=None, **config
) -> DrainingServer:
    """Serve until a signal drains and stops the server; returns it (`.started` tells a bind failure).
    `sockets`: listen on these (already bound and listening) instead of binding host:port."""
    server = make_server(app, host, port, engine, grace_s, on_drain, **config)
    server.run(sockets=sockets)
    return server
