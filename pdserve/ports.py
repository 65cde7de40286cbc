"""Processes and ports: a free TCP port for the servers that pick their own (tests,
benchmarks, a worker's KV listener, a Mooncake master); children tied to their parent's
life; and the wait until a started server answers."""

from __future__ import annotations

import collections
import ctypes
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence

import httpx

PR_SET_PDEATHSIG = 1


_handed_out: collections.deque[int] = collections.deque(maxlen=1024)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now on `host` (another process may take it before the caller binds).
    Never one this process handed out recently: the kernel may offer a port again as soon as the
    probe closes it, and a router and a worker started a moment apart would both get it."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            break
    _handed_out.append(port)
    return port


def _die_with_parent_fn() -> Callable[[], None] | None:
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl  # resolved here, not in the child
    except (OSError, AttributeError):
        return None
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


# `preexec_fn` for a child that must get SIGTERM (and drain) when its parent dies without
# stopping it (a killed launcher, a killed test run); None where prctl is not available (not Linux).
die_with_parent = _die_with_parent_fn()


def wait_until(
    ready: Callable[[], bool],
    procs: Sequence[subprocess.Popen] = (),
    timeout_s: float = 300.0,
    what: str = "the server",
    log: Callable[[], str] = lambda: "",
    interval_s: float = 0.2,
    errors: tuple[type[BaseException], ...] = (httpx.HTTPError, OSError, ValueError, KeyError),
) -> float:
    """Poll `ready()` until it is true; seconds waited. RuntimeError as soon as one of `procs`
    exits, TimeoutError after `timeout_s`, each with `log()` (the process's output) appended.
    `errors` raised by `ready()` mean "not yet"."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what} exited with {p.returncode}:\n{log()}")
        try:
            if ready():
                return time.monotonic() - start
        except errors:
            pass
        time.sleep(interval_s)
    raise TimeoutError(f"{what} was not ready after {timeout_s:.0f} s:\n{log()}")


def health_is(url: str, status: int = 200, timeout_s: float = 2.0) -> bool:
    """GET url/health answers `status` (no proxies from the environment)."""
    try:
        return httpx.get(url + "/health", timeout=timeout_s, trust_env=False).status_code == status
    except httpx.HTTPError:
        return False
