"""The Mooncake Store tier against a real master on loopback: sharing, refusals, a master crash."""

import contextlib
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from pdserve.kvstore.master import MooncakeMaster, mooncake_missing

MISSING = mooncake_missing()
pytestmark = [pytest.mark.integration, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]

MiB = 1 << 20


@pytest.fixture
def master():
    m = MooncakeMaster().start()
    yield m
    m.stop()
    assert m.proc is None


def _tier(master, **kw):
    from pdserve.kvstore.mooncake import MooncakeTier

    kw.setdefault("segment_bytes", 32 * MiB)
    kw.setdefault("local_buffer_bytes", 4 * MiB)
    return MooncakeTier(master.rpc_address, master.metadata_url, **kw)


def _block(i: int, n: int = 300_000) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * (n // 32)


# A second process: reads what the test stored, stores a block of its own and
# exits. It contributes no memory, so its block lives in the test's segments.
CHILD = """
import hashlib, sys
from pdserve.kvstore.mooncake import MooncakeTier
t = MooncakeTier(sys.argv[1], sys.argv[2], segment_bytes=0, local_buffer_bytes=4 << 20)
data = t.get(sys.argv[3])
print("read", hashlib.sha256(data).hexdigest() if data else None)
print("stored", t.put("from-child", b"c" * 200_000))
t.close()
"""


def test_two_clients_and_a_second_process_share_blocks(master):
    a, b = _tier(master), _tier(master)
    try:
        keys = [f"fp00-{i:040x}" for i in range(4)]
        for i, k in enumerate(keys):
            assert a.put(k, _block(i))
        assert a.stats.stores == 4 and a.stats.bytes_in == 4 * len(_block(0))
        assert b.get(keys[2]) == _block(2)
        assert b.contains(keys[0]) and not b.contains("fp00-missing")
        assert b.get("fp00-missing") is None
        assert b.count_prefix(keys[:2] + ["fp00-missing"] + keys[2:]) == 2
        assert b.count_prefix(keys) == 4 and b.count_prefix([]) == 0
        assert b.stats.bytes_out == len(_block(2))
        assert b.stats.errors == 0 and b.healthy()

        child = subprocess.run(
            [sys.executable, "-c", CHILD, master.rpc_address, master.metadata_url, keys[1]],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "GLOG_minloglevel": "2"},
        )
        assert child.returncode == 0, child.stderr[-2000:]
        assert f"read {hashlib.sha256(_block(1)).hexdigest()}" in child.stdout
        assert "stored True" in child.stdout
        assert "listens on every interface" in child.stderr  # what pdserve cannot bind: said at start
        assert a.get("from-child") == b"c" * 200_000
    finally:
        a.close()
        b.close()


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the process listens on, read from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    addr, port = cols[1].split(":")
                    raw = b"".join(bytes.fromhex(addr[i : i + 8])[::-1] for i in range(0, len(addr), 8))
                    found.add((socket.inet_ntop(family, raw), int(port, 16)))
    return found


def test_master_and_metadata_server_listen_on_loopback_only(master):
    """Mooncake has no authentication: nothing the master side opens may be reachable from the network."""
    socks = _listening(master.proc.pid) | _listening(master.metadata_proc.pid)
    assert {port for _, port in socks} >= {master.rpc_port, master.http_port, master.metrics_port}, socks
    assert {addr for addr, _ in socks} == {"127.0.0.1"}, socks


# Inside a network namespace that has only loopback: the isolation docs/kv_store.md recommends
# for the ports the clients open on every interface.
NETNS_CHILD = """
import subprocess
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
from pdserve.kvstore.master import MooncakeMaster
from pdserve.kvstore.mooncake import MooncakeTier
with MooncakeMaster() as m:
    a, b = (MooncakeTier(m.rpc_address, m.metadata_url, segment_bytes=16 << 20, local_buffer_bytes=4 << 20)
            for _ in range(2))
    print("shared", a.put("k", b"v" * 100_000) and b.get("k") == b"v" * 100_000)
    a.close()
    b.close()
"""


def test_a_store_in_a_loopback_only_network_namespace_works():
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare and ip")
    if subprocess.run(["unshare", "-n", "true"], check=False, capture_output=True).returncode != 0:
        pytest.skip("creating a network namespace needs root (CAP_SYS_ADMIN)")
    env = {k: v for k, v in os.environ.items() if k != "MC_TCP_BIND_ADDRESS"}
    child = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", NETNS_CHILD],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "GLOG_minloglevel": "2"},
    )
    assert child.returncode == 0 and "shared True" in child.stdout, child.stderr[-2000:]


def test_oversize_and_empty_puts_are_refused(master):
    t = _tier(master, max_object_bytes=64 * 1024)
    try:
        assert not t.put("big", b"x" * (64 * 1024 + 1))
        assert not t.put("empty", b"")
        assert t.stats.errors == 2 and t.stats.stores == 0
        assert not t.contains("big")
        assert t.put("fits", b"x" * 64 * 1024)
    finally:
        t.close()


def test_max_object_size_is_bounded_by_the_local_buffer():
    # the client stages a value whole in its local buffer and refuses anything larger;
    # no master needed: the tier comes up unconnected and says so
    m = MooncakeMaster()  # addresses only, never started
    t = _tier(m, max_object_bytes=64 * MiB, local_buffer_bytes=4 * MiB)
    try:
        assert t.max_object_bytes == 4 * MiB
        assert not t.healthy()
        out, took = _timed(t.get, "anything")
        assert out is None and took < 1.0 and t.stats.errors >= 1
    finally:
        t.close()


def _timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def test_master_crash_fails_fast_and_the_tier_reconnects(master):
    t = _tier(master, call_timeout_s=1.0)
    try:
        assert t.put("before", _block(0)) and t.get("before") == _block(0)
        master.kill()
        # long enough to meet the phase where the client's own calls block for seconds
        down_until = time.monotonic() + 6.0
        while time.monotonic() < down_until:
            for out, took in (
                _timed(t.get, "before"),
                _timed(t.contains, "before"),
                _timed(t.put, "during", _block(1)),
                _timed(t.count_prefix, ["before"]),
            ):
                assert not out and took < 2.0, (out, took)
        assert not t.healthy()
        errors = t.stats.errors
        assert errors > 0

        master.start()  # same ports
        deadline = time.monotonic() + 10.0
        while not (t.put("after", _block(2)) and t.get("after") == _block(2)):
            assert time.monotonic() < deadline, "the tier did not come back within 10 s"
            time.sleep(0.2)
        assert t.healthy() and t.contains("after")
        assert t.get("before") is None  # the restarted master knows nothing from before
    finally:
        t.close()


class _SlowClient:
    """Stands in for a client whose call blocks, as the real one does for ~4.5 s after its master died."""

    def __init__(self, block_s: float) -> None:
        self.block_s = block_s

    def get(self, key):
        time.sleep(self.block_s)
        return b"late"

    def is_exist(self, key):
        return 1

    def close(self):
        return 0


def test_a_blocking_client_call_is_abandoned_after_the_timeout():
    t = _tier(MooncakeMaster(), call_timeout_s=0.3)  # never started: no client of its own
    t._probe, t._probe_at = (lambda: True), float("-inf")  # the master "answers" from now on
    t._store = _SlowClient(1.0)
    try:
        out, took = _timed(t.get, "k")
        assert out is None and 0.3 <= took < 0.8
        out, took = _timed(t.contains, "k")  # the helper thread is still blocked: no queueing
        assert out is False and took < 0.1 and not t.healthy()
        time.sleep(1.0)
        assert t.healthy() and t.contains("k")
        assert t.stats.errors == 2
    finally:
        t.close()


class _SlowQueryClient(_SlowClient):
    def batch_is_exist(self, keys):
        time.sleep(self.block_s)
        return [1] * len(keys)


def test_the_engine_threads_prefix_query_never_waits_on_the_store(master):
    """The scheduler asks the shared tier for prefix hits on the engine thread, which every running
    stream waits on: it waits at most query_timeout_s for another call holding the client and as
    long for a slow answer (then: no hit), and answers at once while the master is gone."""
    import threading

    t = _tier(master, call_timeout_s=1.0, query_timeout_s=0.1)
    try:
        assert t.put("a", _block(0)) and t.count_prefix_now(["a", "b"]) == 1
        real, t._store = t._store, _SlowQueryClient(0.8)
        busy = threading.Thread(target=t.get, args=("a",))  # the loader's call, slow: holds the lock
        busy.start()
        time.sleep(0.1)
        out, took = _timed(t.count_prefix_now, ["a"])
        assert out == 0 and 0.1 <= took < 0.2  # gave up waiting for the slow call after 0.1 s
        busy.join()
        time.sleep(1.0)  # the abandoned get returned: the client is free again
        assert t.healthy()
        out, took = _timed(t.count_prefix_now, ["a"])  # a slow answer: given up on after 0.1 s
        assert out == 0 and 0.1 <= took < 0.3
        time.sleep(1.0)
        t._store = real
        master.kill()
        down_until = time.monotonic() + 6.0  # through the phase where the client's calls block
        while time.monotonic() < down_until:
            out, took = _timed(t.count_prefix_now, ["a"])
            assert out == 0 and took < 0.3, took
            t.put("during", _block(1))  # the saver meets the dead master, not the engine thread
    finally:
        t.close()


class _LostClient(_SlowClient):
    """A client that has lost its master for good: every master call fails."""

    def is_exist(self, key):
        return -900  # what the real client returns when its RPC to the master fails

    def put(self, key, data):
        return -900


def test_a_client_that_keeps_failing_is_replaced(master):
    t = _tier(master, reconnect_interval_s=0.3)
    real, t._store = t._store, _LostClient(0.0)
    try:
        deadline = time.monotonic() + 5.0
        while not t.contains("k"):  # False until a fresh client is set up
            assert time.monotonic() < deadline, "the failing client was never replaced"
            if not t.put("k", b"v"):
                time.sleep(0.05)
        assert t._store is not real and t.get("k") == b"v"
    finally:
        t.close()
        real.close()


def test_master_reports_a_failed_start_with_its_log():
    m = MooncakeMaster(extra_args=("--no_such_flag=1",), start_timeout_s=5.0)
    with pytest.raises(RuntimeError, match="no_such_flag"):
        m.start()
    assert m.proc is None
