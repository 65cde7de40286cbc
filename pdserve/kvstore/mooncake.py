"""The shared tier: Mooncake Store, whose objects every worker of the cluster can read.

Each `MooncakeTier` is one store client. It contributes `segment_bytes` of its
own memory to the store (where the master may place anyone's objects) and
copies values through a registered `local_buffer_bytes` buffer, which bounds
the size of one object. The master only keeps track of where objects live;
bytes move between clients over TCP.

How the client behaves when the master is gone (mooncake 0.3.13, measured):
calls fail at once at first, then some block for ~4.5 s while the client tries
to reconnect, and `setup()` against a dead master blocks for ~90 s. So every
client call runs on a helper thread and the caller waits at most
`call_timeout_s`; before a call, a TCP connect to the master's RPC port
(cached for `probe_interval_s`) says whether to try at all. When the master
comes back on the same address, the client remounts its segment by itself
within about a second; if it does not (RPC failures go on while the probe
succeeds) or never connected, the tier sets up a fresh client, at most once
per `reconnect_interval_s`.

Where a client listens (mooncake 0.3.13, read from `ss -ltnp` and Mooncake's
source): its transfer engine's RPC and its TCP transport bind to every
interface (INADDR_ANY, hard-coded), on ports drawn from 15000-17000
(`MC_MIN_RPC_PORT`/`MC_MAX_RPC_PORT` move the range); no flag or variable binds
them to one address, and Mooncake has no authentication. `MC_TCP_BIND_ADDRESS`
only sets the address the engine tells its peers: the tier sets it to
`local_hostname` (unless it is set), so peers connect over loopback by default
and a client in a network namespace with nothing but loopback starts at all.
The tier warns once at start that those ports are open.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from urllib.parse import urlsplit

from pdserve.kvstore.master import mooncake_missing
from pdserve.kvstore.tier import KVTier

RPC_FAIL = -900  # the client's return code for a failed call to the master
DEFAULT_METADATA_PORT = 8080  # mooncake_master's default --http_metadata_server_port

log = logging.getLogger("pdserve.kvstore")

# Clients we gave up on while their master was unreachable. Destroying one then
# blocks for ~10 s; kept here, it is never destroyed and costs its segment's
# memory until the process exits.
_PARKED: list = []
_warned_listeners = False


class _Worker:
    """One daemon thread that runs client calls, so a caller can give up on one that blocks."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="mooncake-call", daemon=True).start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            fn, fut = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                    fut.set_exception(e)

    def submit(self, fn: Callable) -> Future:
        fut: Future = Future()
        self.jobs.put((fn, fut))
        return fut

    def retire(self) -> None:
        """The thread exits after the call it is in (if any)."""
        self.jobs.put(None)


# The engine thread's prefix query asks about at most this many blocks of a prompt (one batched
# call; a 16-token block size makes it 16K tokens of prefix).
MAX_QUERY_KEYS = 1024


class MooncakeTier(KVTier):
    """A Mooncake Store client as a KV tier.

    Counting: the tier counts what it moved and what failed: `bytes_in`,
    `stores` (puts the store accepted), `bytes_out` and `errors` (refused puts, failed or timed-out
    calls, calls skipped while the master is down). The caller, which knows
    whether the bytes it got were usable, counts `hits`, `misses` and the
    load timing. `evictions` stays 0: the master evicts on its own and does not say what.
    A put of a key that is already there is accepted and keeps the old value.
    """

    name = "mooncake"
    shared = True

    def __init__(
        self,
        master_address: str,
        metadata_url: str,
        *,
        segment_bytes: int = 256 << 20,
        local_buffer_bytes: int = 64 << 20,
        local_hostname: str = "127.0.0.1",
        max_object_bytes: int | None = None,
        call_timeout_s: float = 1.0,
        query_timeout_s: float = 0.1,
        setup_timeout_s: float = 5.0,
        probe_interval_s: float = 1.0,
        reconnect_interval_s: float = 2.0,
        abandon_after_s: float = 15.0,
        protocol: str = "tcp",
    ) -> None:
        super().__init__()
        missing = mooncake_missing()
        if missing:
            raise RuntimeError(missing)
        host, _, port = master_address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"master address must be host:port, got {master_address!r}")
        self.master_address = master_address
        self.metadata_url = metadata_url
        self.segment_bytes = segment_bytes
        self.local_buffer_bytes = local_buffer_bytes
        self.local_hostname = local_hostname
        # a value is staged whole in the local buffer: anything larger is refused by the client
        self.max_object_bytes = min(max_object_bytes or local_buffer_bytes, local_buffer_bytes)
        self.call_timeout_s = call_timeout_s
        self.query_timeout_s = query_timeout_s  # the engine thread's prefix query (count_prefix_now)
        self.setup_timeout_s = setup_timeout_s
        self.probe_interval_s = probe_interval_s
        self.reconnect_interval_s = reconnect_interval_s
        self.abandon_after_s = abandon_after_s
        self.protocol = protocol
        self._rpc_host, self._rpc_port = host, int(port)
        self._store = None  # the MooncakeDistributedStore, once set up
        self._worker = _Worker()
        self._stuck: Future | None = None  # a call we gave up waiting for
        self._stuck_setup = False  # whether that call is a setup (its result is a client)
        self._stuck_since = 0.0
        self._probe_ok = False
        self._probe_at = float("-inf")
        self._connect_at = float("-inf")
        self._rpc_fail_since: float | None = None
        self._closed = False
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)  # read by the engine's setup
        _bypass_proxy(urlsplit(metadata_url).hostname)
        _warn_listeners()
        with self.lock:
            self._ready()  # connect now if the master is up; later if not

    @classmethod
    def from_args(cls, master: str, metadata_url: str | None = None, **kw) -> MooncakeTier:
        """From CLI-style arguments: the metadata URL defaults to the master's embedded server."""
        if metadata_url is None:
            host = master.rpartition(":")[0]
            metadata_url = f"http://{host}:{DEFAULT_METADATA_PORT}/metadata"
        return cls(master, metadata_url, **kw)

    # --- the KVTier interface -------------------------------------------------

    def put(self, key: str, data: bytes) -> bool:
        n = len(data)
        with self.lock:
            if n == 0 or n > self.max_object_bytes:  # an empty value would read back as a miss
                self.stats.errors += 1
                return False
            rc = self._call(lambda: self._store.put(key, data), None)
            if rc is None:  # skipped or failed: counted by _call
                return False
            self._note_rc(rc)
            if rc != 0:  # e.g. the store is full and still evicting
                self.stats.errors += 1
                return False
            self.stats.stores += 1
            self.stats.bytes_in += n
            return True

    def get(self, key: str) -> bytes | None:
        with self.lock:
            data = self._call(lambda: self._store.get(key), None)
            if not data:  # the client returns b"" for a miss and for a failure alike
                return None
            self.stats.bytes_out += len(data)
            return bytes(data)

    def contains(self, key: str) -> bool:
        with self.lock:
            rc = self._call(lambda: self._store.is_exist(key), None)
            if rc is None:
                return False
            self._note_rc(rc)
            if rc < 0:
                self.stats.errors += 1
            return rc == 1

    def forget(self, key: str) -> None:
        """Remove an object that failed its check (altered, or planted under a cluster name): a
        put keeps an existing value, so it would otherwise keep the cluster from publishing
        that block until the store evicted it."""
        with self.lock:
            rc = self._call(lambda: self._store.remove(key), None)
            if rc is not None:
                self._note_rc(rc)

    def count_prefix(self, keys: list[str]) -> int:
        """One batched existence query instead of one round trip per key."""
        if not keys:
            return 0
        with self.lock:
            return self._prefix_of(self._call(lambda: self._store.batch_is_exist(list(keys)), None))

    def _prefix_of(self, found) -> int:
        """Under the lock: how many of a batch_is_exist answer's keys, from the first, exist."""
        if found is None:
            return 0
        n = 0
        for rc in found:
            if rc != 1:
                if rc < 0:
                    self._note_rc(rc)
                    self.stats.errors += 1
                break
            n += 1
        return n

    def count_prefix_now(self, keys: list[str]) -> int:
        """`count_prefix` for the engine thread: 0 unless a client is up, and at most
        `query_timeout_s` for the saver's or loader's call in progress to end (against a healthy
        master a put takes milliseconds; a slow one holds the lock up to `call_timeout_s`, a
        connect up to `setup_timeout_s`) and as long again for the answer. A slow or absent
        master then costs prefix hits, never a stall of every running stream."""
        if not keys or not self.lock.acquire(timeout=self.query_timeout_s):
            return 0
        try:
            if self._closed or self._store is None or self._stuck is not None or not self._probe_ok:
                return 0
            store = self._store  # straight to the client: _ready() may probe the master
            keys = list(keys[:MAX_QUERY_KEYS])
            found = self._submit(lambda: store.batch_is_exist(keys), None, self.query_timeout_s, master_down=False)
            return self._prefix_of(found)
        finally:
            self.lock.release()

    def healthy(self) -> bool:
        with self.lock:
            return self._ready()

    def close(self) -> None:
        """Unmount this client's segment and stop it; quick unless the master is gone."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            store, self._store = self._store, None
            if self._stuck is not None:
                # a C++ call still running when the interpreter exits can abort the process
                _wait(self._stuck, 5.0)
                if self._stuck_setup and self._stuck.done() and self._stuck.exception() is None:
                    store = store or self._stuck.result()
            if store is not None:
                if (self._stuck is None or self._stuck.done()) and self._probe():
                    _wait(self._worker.submit(store.close), 10.0)
                else:  # tearing down a client whose master is gone blocks ~10 s
                    _PARKED.append(store)
            self._worker.retire()

    # --- liveness -------------------------------------------------------------

    def _call(self, fn: Callable, default):
        """Run `fn` on the helper thread; `default` if the master is down, it fails or it is slow."""
        if not self._ready():
            self.stats.errors += 1
            return default
        return self._submit(fn, default, self.call_timeout_s)

    def _submit(self, fn: Callable, default, timeout_s: float, master_down: bool = True):
        """Under the lock, with a client up: run `fn` on the helper thread, at most `timeout_s`.
        Past it, calls are skipped until `fn` returns, and with `master_down` (a call's timeout,
        not the engine thread's short one) the master is taken for dead until it answers a probe."""
        fut = self._worker.submit(fn)
        try:
            return fut.result(timeout=timeout_s)
        except FutureTimeout:
            self._stuck, self._stuck_since, self._stuck_setup = fut, time.monotonic(), False
            if master_down:  # the master probably just died
                self._probe_ok, self._probe_at = False, time.monotonic()
        except Exception:  # noqa: BLE001, S110 - a tier never raises for a backend failure
            pass
        self.stats.errors += 1
        return default

    def _ready(self) -> bool:
        """Whether a call may go to the client now; (re)connects when due."""
        if self._closed:
            return False
        now = time.monotonic()
        if self._stuck is not None:
            if not self._stuck.done():
                if now - self._stuck_since < self.abandon_after_s:
                    return False
                self._abandon_worker()  # it may return some day; stop waiting for it
            elif self._stuck_setup and self._stuck.exception() is None:
                self._store = self._stuck.result()  # a slow setup that worked after all
            self._stuck = None
        if now - self._probe_at >= self.probe_interval_s:
            self._probe_ok, self._probe_at = self._probe(), now
        if not self._probe_ok:
            return False
        if self._store is None and now - self._connect_at >= self.reconnect_interval_s:
            self._connect()
        return self._store is not None

    def _probe(self) -> bool:
        try:
            socket.create_connection((self._rpc_host, self._rpc_port), timeout=0.25).close()
            return True
        except OSError:
            return False

    def _note_rc(self, rc: int) -> None:
        """Drop a client whose master calls keep failing although the master answers the probe."""
        now = time.monotonic()
        if rc != RPC_FAIL:
            self._rpc_fail_since = None
        elif self._rpc_fail_since is None:
            self._rpc_fail_since = now
        elif (
            now - self._rpc_fail_since >= self.reconnect_interval_s
            and now - self._connect_at >= self.reconnect_interval_s
        ):
            self._drop_client()

    def _connect(self) -> None:
        self._connect_at = time.monotonic()
        self._rpc_fail_since = None
        fut = self._worker.submit(self._new_client)
        try:
            self._store = fut.result(timeout=self.setup_timeout_s)
        except FutureTimeout:
            self._stuck, self._stuck_since, self._stuck_setup = fut, time.monotonic(), True
        except Exception:  # noqa: BLE001 - counted; retried after reconnect_interval_s
            self.stats.errors += 1

    def _new_client(self):
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        rc = store.setup(
            self.local_hostname,
            self.metadata_url,
            self.segment_bytes,
            self.local_buffer_bytes,
            self.protocol,
            "",
            self.master_address,
        )
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        return store

    def _drop_client(self) -> None:
        store, self._store = self._store, None
        if store is not None:  # closing can take seconds: not on the caller's time
            threading.Thread(target=store.close, name="mooncake-close", daemon=True).start()

    def _abandon_worker(self) -> None:
        old, self._worker = self._worker, _Worker()
        store, self._store = self._store, None
        if store is not None:  # still in use by the blocked thread
            _PARKED.append(store)
        old.retire()


def _bypass_proxy(host: str | None) -> None:
    """The client's HTTP calls to the metadata server (libcurl) follow http_proxy like any
    other: the cluster's own address goes direct."""
    if not host:
        return
    for var in ("no_proxy", "NO_PROXY"):
        hosts = [h for h in os.environ.get(var, "").split(",") if h]
        if host not in hosts:
            os.environ[var] = ",".join([*hosts, host])


def _warn_listeners() -> None:
    """Once a process: what Mooncake opens that pdserve cannot keep on loopback."""
    global _warned_listeners
    if _warned_listeners:
        return
    _warned_listeners = True
    lo, hi = os.environ.get("MC_MIN_RPC_PORT", "15000"), os.environ.get("MC_MAX_RPC_PORT", "17000")
    log.warning(
        "Mooncake Store client: its transfer engine listens on every interface (two TCP ports in %s-%s, "
        "whatever address it is given) without authentication; whoever reaches them can read the sealed KV "
        "blocks in this worker's segment (not open them) and delete or overwrite them (recomputed then). "
        "Firewall that range or run the cluster in a network namespace (docs/kv_store.md)",
        lo,
        hi,
    )


def _wait(fut: Future, timeout_s: float) -> None:
    """Until `fut` is over or `timeout_s` passed; how it ended does not matter to the caller."""
    with contextlib.suppress(Exception):
        fut.result(timeout=timeout_s)
