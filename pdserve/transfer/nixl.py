"""NIXL backend: the prefill worker WRITEs K/V straight into the decode worker's
reserved slots through NVIDIA's NIXL (UCX underneath), one-sided, as vLLM's and
Dynamo's NIXL connectors do between GPUs.

Optional: `pip install --no-deps nixl-cu12==1.5.1` (it runs on host memory here
with UCX over TCP; on a GPU host the same calls move VRAM). Without it the
decode worker's receiver still answers plain TCP frames, so a prefill worker
that lacks NIXL falls back to TCP push.

Flow (control messages are the TCP frames of `wire`, JSON headers, never pickle):
1. The decode worker registers its whole KV cache with its NIXL agent once;
   `nixl://host:port` is its receiver's TCP address.
2. On the first transfer to that address the prefill worker asks for
   `{"op": "nixl_md"}` and gets the agent's metadata (NIXL's own serialisation)
   plus the base address of every layer's K and V cache.
3. `save_layer` registers the K/V tensors it was handed (tens of microseconds),
   posts one WRITE whose descriptors are the destination's runs of consecutive
   slots (or, when `PDSERVE_NIXL_WRITES_IN_FLIGHT` transfers are already out,
   queues it: the layers queued meanwhile post together as one transfer), and
   returns; the sender thread waits for the WRITE to complete, then
   sends the layer's notice frame (`inplace`), so the receiver never counts a
   layer before its bytes are there. A WRITE that fails is resent as an
   ordinary TCP frame with the bytes in it.

One-sided writes cannot be refused: like the shared-memory push, they rely on
the decode worker keeping the reserved blocks until its lease expires.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
import uuid

import torch

from pdserve import auth
from pdserve.transfer import wire
from pdserve.transfer.connector import KVTransferError
from pdserve.transfer.receiver import KVReceiverServer
from pdserve.transfer.sender import TcpKVSender, _host_port, check_lease

log = logging.getLogger("pdserve.transfer")
# NIXL configures its logger at import, INFO lines to stdout: quiet it before anything imports it
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def nixl_available() -> bool:
    try:
        import nixl_cu12  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or a broken native library
        return False
    return True


# NIXL's Python agent starts its progress thread with no pause between polls: one core spun
# per agent, i.e. both cores of a 2-core host for a sender and a receiver, which starved the
# TCP copies UCX makes for a WRITE. 20-200 us between polls took 30 layer WRITEs of 92 MB in
# all from 1.9 to 2.4 GB/s here (0.77x -> 0.97x of a plain socket); small transfers wait at
# most that much longer. PDSERVE_NIXL_PROGRESS_DELAY_US overrides it (0: NIXL's own spin).
PROGRESS_DELAY_US = int(os.environ.get("PDSERVE_NIXL_PROGRESS_DELAY_US", "50"))
# Transfers a sender keeps posted at once; the layers saved meanwhile wait, and go together as
# one transfer when a slot frees. UCX over TCP turns each WRITE into active messages that both
# progress threads copy: 30 layer WRITEs posted at once moved 2.4 GB/s here, two at a time 2.8
# (docs/disaggregation.md). Layer-wise prefill on this CPU produces a layer every 10 ms or more,
# so mostly eager transfers queue. 0: no limit (every layer posted alone, at once).
WRITES_IN_FLIGHT = int(os.environ.get("PDSERVE_NIXL_WRITES_IN_FLIGHT", "2"))
# An agent's metadata (its UCX addresses and the registered cache's keys) is a few KiB;
# a receiver's answer larger than this is refused unread.
MAX_METADATA_BYTES = 16 << 20
# A receiver's metadata is fetched on the engine thread as its first transfer begins: a receiver
# that is stopped or cut off stalls every stream at most this long (connect, then each read), and
# its next transfers fail at once for METADATA_RETRY_S instead of stalling again.
METADATA_TIMEOUT_S = 3.0
METADATA_RETRY_S = 10.0
_agent_lock = threading.Lock()


def make_agent(prefix: str, progress_delay_us: int = PROGRESS_DELAY_US):
    """A NIXL agent with UCX on host memory. UCX over TCP works on any host; a
    progress thread keeps small transfers from stalling (without one, a transfer
    that no caller polls waits for the next one to move), polling every
    `progress_delay_us`."""
    os.environ.setdefault("UCX_TLS", "tcp")
    if not os.path.isdir("/sys/class/infiniband"):
        os.environ.setdefault("UCX_MODULES", "^ib")  # libibverbs without RDMA hardware crashes at exit
    from nixl_cu12 import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    name = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    # STRICT: the engine thread posts WRITEs while the sender thread polls and releases
    # them; without it (the default when no listener thread runs) the agent is not
    # thread-safe and crashes the process.
    config = nixl_agent_config(
        enable_prog_thread=True, backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    )
    with _agent_lock, _progress_delay(progress_delay_us):
        return nixl_agent(name, config)


class _progress_delay:
    """nixl_agent sets its binding config's pthrDelay to 0 and offers no option: while the
    agent is built, hand it a config class whose pthrDelay is at least `us`. If the
    binding is not laid out as expected, the agent is built as NIXL builds it."""

    def __init__(self, us: int):
        self.us, self._api, self._orig = us, None, None

    def __enter__(self):
        if self.us <= 0:
            return self
        try:
            import nixl_cu12._api as api

            base = api.nixlBind.nixlAgentConfig
            field = base.pthrDelay
            us = self.us

            class Config(base):
                pthrDelay = property(lambda c: field.__get__(c), lambda c, v: field.__set__(c, max(int(v), us)))

            self._api, self._orig = api, base
            api.nixlBind.nixlAgentConfig = Config
        except (ImportError, AttributeError, TypeError) as e:
            log.warning("NIXL progress-thread delay not applied (%s); its thread will spin", e)
        return self

    def __exit__(self, *exc):
        if self._api is not None:
            self._api.nixlBind.nixlAgentConfig = self._orig


class NixlKVReceiver(KVReceiverServer):
    """A KV receiver whose cache is also a NIXL WRITE target (and still takes TCP frames)."""

    def __init__(self, kv_caches, host: str = "127.0.0.1", port: int = 0, *, secret: bytes):
        wire.require_secret(secret)  # before the agent: a bad secret must not leave one behind
        tensors = [t for pair in kv_caches for t in pair]
        if not all(t.is_contiguous() for t in tensors):
            raise ValueError("NIXL needs contiguous KV cache tensors")
        self.agent = make_agent("pdserve-kv-rx")
        self._registered = self.agent.register_memory(tensors)
        self._metadata = self.agent.get_agent_metadata()
        super().__init__(kv_caches, host, port, scheme="nixl", secret=secret)

    def _on_frame(self, h: dict, payload):
        if h.get("op") == "nixl_md":
            k0 = self.kv_caches[0][0]
            header = {
                "op": "nixl_md",
                "agent": self.agent.name,
                "dtype": str(k0.dtype).removeprefix("torch."),
                "row_shape": list(k0.shape[-2:]),
                "layers": [[k.data_ptr(), v.data_ptr(), k.numel() * k.element_size()] for k, v in self.kv_caches],
            }
            if k0.is_cuda:  # said only then: a CPU cache's answer stays as it was
                header["mem"] = "VRAM"
            return header, [torch.frombuffer(bytearray(self._metadata), dtype=torch.uint8)]
        return super()._on_frame(h, payload)

    def close(self):
        super().close()
        try:
            self.agent.deregister_memory(self._registered)
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass


class _Remote:
    """What a prefill worker knows of one decode worker's NIXL agent and cache."""

    def __init__(self, header: dict, agent_name: str):
        self.agent = agent_name
        self.dtype = wire.DTYPES[header["dtype"]]
        self.layers = [tuple(x) for x in header["layers"]]  # (K address, V address, bytes each)
        # where the cache lives: NIXL names GPU memory VRAM, host memory DRAM
        self.mem = "VRAM" if header.get("mem") == "VRAM" else "DRAM"


class _Write:
    """One layer's WRITE: its descriptors, source tensors and registrations, and the
    posted transfer that carries it (None until posted)."""

    def __init__(self, agent: str, local: list, remote: list, k, v, reg: list, remote_mem: str = "DRAM"):
        self.agent, self.local, self.remote, self.k, self.v, self.reg = agent, local, remote, k, v, reg
        self.local_mem = "VRAM" if k.is_cuda else "DRAM"
        self.remote_mem = remote_mem
        self.xfer: _Xfer | None = None
        self.dest = None  # the transfer's KVDestination: its lease is checked again when posted


class _Xfer:
    """One posted NIXL transfer, carrying the WRITEs of one or more layers."""

    def __init__(self, handle, state, members: int):
        self.handle, self.state, self.left = handle, state, members


class NixlKVSender(TcpKVSender):
    """Push through NIXL WRITE; notices, `done` and acknowledgements travel as TCP frames."""

    def __init__(
        self,
        retry_window_s: float = 5.0,
        xfer_timeout_s: float = 30.0,
        writes_in_flight: int = WRITES_IN_FLIGHT,
        *,
        secret: bytes,
    ):
        super().__init__("none", retry_window_s, secret=secret)
        self.agent = make_agent("pdserve-kv-tx")
        self.xfer_timeout_s = xfer_timeout_s
        self.writes_in_flight = writes_in_flight
        self._remotes: dict[str, _Remote] = {}
        self._pending: dict[int, _Write] = {}  # id(notice header) -> its layer's WRITE
        self._unposted: collections.deque[int] = collections.deque()  # keys of _pending, in order
        self._posted = 0  # transfers in flight
        self._lock = threading.Lock()
        self._regs: dict[tuple[int, int], list] = {}  # (address, bytes) -> [registration, users]
        self._remote_failed: dict[str, tuple[float, str]] = {}  # address -> (ask again after, why)
        self.hung: list[_Write] = []  # WRITEs that never completed: their memory is never freed
        self.nixl_bytes = 0
        self.nixl_fallbacks = 0
        self.nixl_transfers = 0  # posted; fewer than layers when queued layers went together

    def begin(self, dest, num_layers):
        if dest.address not in self._remotes:
            # on the engine thread, which every running stream waits on: a receiver that did not
            # answer is not asked again for a while (its requests fail at once, and recompute)
            failed = self._remote_failed.get(dest.address)
            if failed is not None and time.monotonic() < failed[0]:
                raise KVTransferError(f"{failed[1]} (not asked again for {METADATA_RETRY_S:.0f} s)")
            try:
                self._remotes[dest.address] = self._fetch_remote(dest.address)
            except KVTransferError as e:
                if len(self._remote_failed) >= 1024:
                    del self._remote_failed[next(iter(self._remote_failed))]
                self._remote_failed[dest.address] = (time.monotonic() + METADATA_RETRY_S, str(e))
                raise
            self._remote_failed.pop(dest.address, None)
        super().begin(dest, num_layers)

    def _fetch_remote(self, address: str) -> _Remote:
        try:
            with socket.create_connection(_host_port(address), timeout=METADATA_TIMEOUT_S) as s:
                auth.kv_connect(s, self.secret, METADATA_TIMEOUT_S)
                wire.send_frame(s, {"op": "nixl_md"})
                h = wire.recv_header(s, max_payload=MAX_METADATA_BYTES)
                if not h or h.get("op") != "nixl_md":
                    raise KVTransferError(f"{address} did not answer with NIXL metadata: {str(h)[:200]}")
                md = bytearray(h["nbytes"])
                wire.recv_exact(s, memoryview(md))
        except auth.AuthError as e:
            raise KVTransferError(f"the KV receiver at {address} refused our cluster token: {e}") from e
        except (OSError, wire.FrameError) as e:
            raise KVTransferError(f"NIXL metadata from {address}: {e}") from e
        name = self.agent.add_remote_agent(bytes(md))
        return _Remote(h, name.decode() if isinstance(name, bytes) else name)

    def save_layer(self, transfer_id, layer, token_start, k, v):
        t = self._transfers[transfer_id]
        check_lease(t.dest)  # RDMA writes into the receiver's blocks: not after its lease
        r = self._remotes[t.dest.address]
        n = k.shape[0]
        _, runs = self._destination(t, token_start, n)
        k = k.to(r.dtype).contiguous()
        v = v.to(r.dtype).contiguous()
        row = k[0].numel() * k.element_size() if n else 0
        k_base, v_base, size = r.layers[layer]
        local, remote = [], []
        for src, base in ((k, k_base), (v, v_base)):
            for off, first, m in runs:
                if (first + m) * row > size:
                    raise KVTransferError(f"{transfer_id}: slot {first + m} is outside the destination cache")
                local.append((src.data_ptr() + off * row, m * row, 0))
                remote.append((base + first * row, m * row, 0))
        header = {"op": "layer", "tid": transfer_id, "layer": layer, "start": token_start, "n": n, "inplace": True}
        w = _Write(r.agent, local, remote, k, v, [self._register(k), self._register(v)], r.mem)
        w.dest = t.dest
        with self._lock:
            self._pending[id(header)] = w
            self._unposted.append(id(header))
            self._post_unposted()
        t.stats.bytes += 2 * k.numel() * k.element_size()
        self._enqueue(t, header, [])

    def _ready(self, header, payload):
        """Runs on the sender thread before a notice goes out: the WRITE must have landed."""
        with self._lock:
            w = self._pending.get(id(header))
            while w is not None and w.xfer is None and id(header) in self._unposted:  # its turn is now
                self._post_batch(through=id(header))
            self._pending.pop(id(header), None)
        if w is None:  # not a NIXL notice, or already settled (a resend)
            return header, payload
        x = w.xfer or _Xfer(None, "ERR", 0)
        deadline = time.monotonic() + self.xfer_timeout_s
        delay = 1e-5
        while x.state == "PROC" and time.monotonic() < deadline:
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
            x.state = self.agent.check_xfer_state(x.handle)  # shared by the layers it carries
        state = x.state
        if state == "PROC":
            return self._hung(w, header)
        self._settle(w)
        if state == "DONE":
            self.nixl_bytes += 2 * w.k.numel() * w.k.element_size()
            return header, payload
        # the WRITE failed or hung: from now on this frame carries its bytes over TCP
        log.warning("NIXL write of %s layer %s ended %s; sending it over TCP", header["tid"], header["layer"], state)
        self.nixl_fallbacks += 1
        header.pop("inplace", None)
        header["dtype"] = str(w.k.dtype).removeprefix("torch.")
        payload.extend([w.k, w.v])
        return header, payload

    def _hung(self, w: _Write, header: dict) -> tuple[dict, list]:
        """A WRITE still in flight after `xfer_timeout_s`: it may land any time yet. Its source
        memory stays registered and referenced (kept in `hung`), the transfer fails here, and the
        decode side is told with an abort: it then holds the blocks fenced and recomputes, where
        the layer resent over TCP would have completed the transfer and let the blocks go."""
        tid = header["tid"]
        log.warning("NIXL write of %s layer %s still in flight after %.0f s; failing the transfer", tid,
                    header["layer"], self.xfer_timeout_s)  # fmt: skip
        with self._lock:
            x = w.xfer
            x.left -= 1
            if x.left == 0:
                self._posted -= 1
            self.hung.append(w)
            self._post_unposted()
        reason = f"{tid}: a NIXL write did not complete within {self.xfer_timeout_s:.0f} s"
        t = self._transfers.get(tid)
        if t is not None:
            t.error = t.error or reason
            t.acked.set()
        # "inflight": the write may land yet, so the receiver keeps the blocks fenced till the lease ends
        return {"op": "abort", "tid": tid, "reason": reason, "inflight": True}, []

    def _post_batch(self, through: int | None = None) -> None:
        """Post the queued WRITEs, oldest first, as one transfer (with self._lock held): those
        for the same decode worker as the oldest, up to the key `through` if given. An eager
        burst queues layers behind the first two, and one transfer for them moves the bytes
        faster than one each (docs/disaggregation.md, session 7)."""
        batch: list[_Write] = []
        while self._unposted:
            key = self._unposted[0]
            w = self._pending.get(key)
            if w is None:  # forgotten since it was queued
                self._unposted.popleft()
                continue
            if batch and (w.agent, w.local_mem, w.remote_mem) != (
                batch[0].agent,
                batch[0].local_mem,
                batch[0].remote_mem,
            ):
                break
            self._unposted.popleft()
            try:  # queued behind earlier WRITEs: the lease may have run out since it was saved
                check_lease(w.dest)
            except KVTransferError:
                if key == through:
                    break
                continue  # never posted: its frame goes over TCP, which lands only while expected
            batch.append(w)
            if key == through:
                break
        if not batch:
            return
        x = _Xfer(None, "ERR", len(batch))
        try:
            x.handle = self.agent.initialize_xfer(
                "WRITE",
                self.agent.get_xfer_descs([d for w in batch for d in w.local], batch[0].local_mem),
                self.agent.get_xfer_descs([d for w in batch for d in w.remote], batch[0].remote_mem),
                batch[0].agent,
            )
            x.state = self.agent.transfer(x.handle)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own errors; the frames fall back to TCP
            log.warning("NIXL could not post a WRITE: %s", e)
            x.state = "ERR"
        for w in batch:
            w.xfer = x
        self._posted += 1
        self.nixl_transfers += 1

    def _post_unposted(self) -> None:
        """Post queued WRITEs while fewer than `writes_in_flight` transfers are out (with
        self._lock held)."""
        while self._unposted and (self.writes_in_flight <= 0 or self._posted < self.writes_in_flight):
            self._post_batch()

    def _settle(self, w: _Write) -> None:
        """A layer's WRITE is over (landed, failed, or its frame will never go): its transfer's
        slot frees with its last layer, the next queued ones post, registrations go."""
        done = None
        with self._lock:
            x = w.xfer
            if x is not None:
                x.left -= 1
                if x.left == 0:
                    self._posted -= 1
                    done = x
            self._post_unposted()
        if done is not None and done.handle is not None:
            try:
                done.handle.release()
            except Exception:  # noqa: BLE001 - a handle still in flight cannot be released
                pass
        self._release(w.reg)

    def _register(self, t: torch.Tensor) -> tuple[int, int]:
        """Register a buffer once however many WRITEs use it at a time: NIXL crashes
        when memory registered twice is deregistered."""
        key = (t.data_ptr(), t.numel() * t.element_size())
        with self._lock:
            entry = self._regs.get(key)
            if entry is None:
                entry = self._regs[key] = [self.agent.register_memory([t]), 0]
            entry[1] += 1
        return key

    def _release(self, keys) -> None:
        """Drop one use of each registration; the last use deregisters."""
        for key in keys:
            with self._lock:
                entry = self._regs[key]
                entry[1] -= 1
                if entry[1]:
                    continue
                del self._regs[key]
            try:
                self.agent.deregister_memory(entry[0])
            except Exception:  # noqa: BLE001
                pass

    def _forget(self, t) -> None:
        """Release the WRITEs of frames that will never be sent (aborted, failed transfers)."""
        if t is None:
            return
        for header, _ in t.frames:
            with self._lock:
                w = self._pending.pop(id(header), None)
                if w is not None and w.xfer is None:
                    self._unposted.remove(id(header))
            if w is not None:
                self._settle(w)

    def abort(self, transfer_id, reason):
        self._forget(self._transfers.get(transfer_id))
        super().abort(transfer_id, reason)

    def wait_for_save(self, transfer_id, timeout_s):
        t = self._transfers.get(transfer_id)
        try:
            return super().wait_for_save(transfer_id, timeout_s)
        finally:
            self._forget(t)
