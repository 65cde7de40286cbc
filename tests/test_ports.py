"""The process helpers every test, benchmark and launcher share (pdserve/ports.py)."""

import subprocess
import sys
import time

import psutil
import pytest

from pdserve.ports import die_with_parent, wait_until


def test_wait_until_returns_once_ready_and_fails_fast_when_the_process_exits():
    calls = []
    assert wait_until(lambda: calls.append(1) or len(calls) >= 3, interval_s=0.01) >= 0
    assert len(calls) == 3
    gone = subprocess.Popen([sys.executable, "-c", "print('bye')"], stdout=subprocess.PIPE)
    gone.wait()
    with pytest.raises(RuntimeError, match="exited with 0:\nits log"):
        wait_until(lambda: False, [gone], timeout_s=10, what="the child", log=lambda: "its log")


def test_wait_until_treats_connection_errors_as_not_yet_and_times_out():
    def refused():
        raise ConnectionRefusedError

    with pytest.raises(TimeoutError, match="was not ready after 0 s"):
        wait_until(refused, timeout_s=0.2, interval_s=0.05)


def test_a_child_started_with_die_with_parent_gets_sigterm_when_its_parent_dies():
    # the parent starts a sleeping grandchild and exits at once; the grandchild must not outlive it
    code = (
        "import subprocess, sys; from pdserve.ports import die_with_parent; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], preexec_fn=die_with_parent); "
        "print(p.pid, flush=True)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:  # dead; its new parent has not reaped it
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        psutil.Process(pid).kill()
        pytest.fail("the grandchild outlived its parent")
    assert die_with_parent is not None


def test_free_port_never_hands_out_a_port_it_gave_recently(monkeypatch):
    # the processes of one test cluster bind a moment after they are given their ports: the
    # kernel offering the router's port again to a worker made both bind one port (seen in CI)
    import socket

    from pdserve import ports

    offered = iter([40001, 40001, 40001, 40002])  # what the kernel's probe binds get

    class Probe(socket.socket):
        def getsockname(self):
            return ("127.0.0.1", next(offered))

    monkeypatch.setattr(ports.socket, "socket", Probe)
    monkeypatch.setattr(ports, "_handed_out", ports.collections.deque(maxlen=1024))
    assert [ports.free_port(), ports.free_port()] == [40001, 40002]
