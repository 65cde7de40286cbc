"""A Mooncake Store master as child processes, for tests, benchmarks and single-host runs.

Two processes: `mooncake_master`, the store's RPC service (where objects live,
which clients are alive), and the HTTP metadata server the clients' transfer
engines use to find each other's memory. The master could embed the latter, but
(mooncake 0.3.13) its embedded server listens on every interface whatever
`--http_metadata_server_host` says, and Mooncake has no authentication: so it
runs as Mooncake's own Python server (`mooncake.http_metadata_server`), which
binds where it is told. Every port binds to one host (loopback by default) and
is of our choosing; a restart reuses the same ports so that clients configured
with the old addresses reconnect.

Everything the master writes goes to its stderr (kept in memory, for error
messages), never to log files. It holds all objects in its clients' memory:
killing it forgets every block, which a cache can live with.
"""

from __future__ import annotations

import collections
import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from pdserve.ports import die_with_parent, free_port

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))

PIP_HINT = "pip install mooncake-transfer-engine-non-cuda"
APT_HINT = "apt-get install -y libibverbs1"


def mooncake_missing() -> str | None:
    """What is missing to run Mooncake Store here, as the command that installs it; None if nothing."""
    if importlib.util.find_spec("mooncake") is None or _find_binary() is None:
        return f"Mooncake Store is not installed: {PIP_HINT}"
    try:  # the master and the client link against it even without RDMA hardware
        ctypes.CDLL("libibverbs.so.1")
    except OSError:
        return f"Mooncake Store needs libibverbs.so.1: {APT_HINT}"
    return None


def _find_binary() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("mooncake_master")


class MooncakeMaster:
    """One `mooncake_master` with its HTTP metadata server, both listening on `host` only.

    Defaults suit a cache: evict early and in larger steps (puts fail while a
    full store is still evicting), and lease an object only briefly to a reader
    (a leased object cannot be evicted; a block read after its lease is caught
    by the checksum above the tier).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        rpc_port: int = 0,
        http_port: int = 0,
        metrics_port: int = 0,
        *,
        lease_ttl_ms: int = 1000,
        eviction_high_watermark: float = 0.8,
        eviction_ratio: float = 0.1,
        client_ttl_s: int = 10,
        start_timeout_s: float = 15.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.host = host
        self.rpc_port = rpc_port or free_port(host)
        self.http_port = http_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.lease_ttl_ms = lease_ttl_ms
        self.eviction_high_watermark = eviction_high_watermark
        self.eviction_ratio = eviction_ratio
        self.client_ttl_s = client_ttl_s
        self.start_timeout_s = start_timeout_s
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None  # mooncake_master
        self.metadata_proc: subprocess.Popen | None = None
        self._log: collections.deque[str] = collections.deque(maxlen=200)
        self._readers: list[threading.Thread] = []

    @property
    def rpc_address(self) -> str:
        """What clients pass as the master address: "host:port"."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def command(self, binary: str) -> list[str]:
        return [
            binary,
            "--rpc_address",
            self.host,
            "--rpc_port",
            str(self.rpc_port),
            "--enable_http_metadata_server=false",
            "--metrics_host",
            self.host,
            "--metrics_port",
            str(self.metrics_port),
            "--enable_metric_reporting=false",
            "--default_kv_lease_ttl",
            str(self.lease_ttl_ms),
            "--eviction_high_watermark_ratio",
            str(self.eviction_high_watermark),
            "--eviction_ratio",
            str(self.eviction_ratio),
            "--client_ttl",
            str(self.client_ttl_s),
            "--logtostderr=true",
            *self.extra_args,
        ]

    def metadata_command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "mooncake.http_metadata_server",
            "--host",
            self.host,
            "--port",
            str(self.http_port),
            "--log-level",
            "WARNING",
        ]

    def start(self) -> MooncakeMaster:
        """Start the master (again, on the same ports) and wait until it accepts clients."""
        if self.running():
            return self
        self.stop()  # what is left of a half-dead pair
        missing = mooncake_missing()
        if missing:
            raise RuntimeError(missing)
        self._log.clear()
        try:
            self.metadata_proc = self._spawn(self.metadata_command(), "metadata server: ")
            self.proc = self._spawn(self.command(_find_binary()), "")
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, cmd: list[str], tag: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            close_fds=True,
            preexec_fn=die_with_parent,
        )  # noqa: PLW1509 - one C call, no locks taken
        reader = threading.Thread(
            target=self._read_log, args=(proc.stdout, tag), name="mooncake-master-log", daemon=True
        )
        reader.start()
        self._readers.append(reader)
        return proc

    def _read_log(self, pipe, tag: str) -> None:
        for line in iter(pipe.readline, b""):
            self._log.append(tag + line.decode(errors="replace").rstrip())
        pipe.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            for name, proc in (("mooncake_master", self.proc), ("the metadata server", self.metadata_proc)):
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n" + self.log_tail())
            if self._accepts():
                return
            time.sleep(0.05)
        raise RuntimeError(
            f"mooncake_master did not accept clients on {self.rpc_address} "
            f"within {self.start_timeout_s:.0f} s:\n" + self.log_tail()
        )

    def _accepts(self) -> bool:
        try:
            socket.create_connection((self.host, self.rpc_port), timeout=0.2).close()
            # any HTTP answer will do: a 404 for an unknown key means it serves (asked directly:
            # an http_proxy in the environment would answer for it)
            _DIRECT.open(self.metadata_url + "?key=probe", timeout=0.5).close()
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(list(self._log)[-lines:])

    def running(self) -> bool:
        return all(p is not None and p.poll() is None for p in (self.proc, self.metadata_proc))

    def kill(self) -> None:
        """SIGKILL, as a crash would; `start()` brings it back on the same ports."""
        self.stop(grace_s=0.0)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; reaps both processes."""
        procs = [p for p in (self.proc, self.metadata_proc) if p is not None]
        self.proc = self.metadata_proc = None
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        for proc in procs:
            try:
                proc.wait(timeout=grace_s if grace_s > 0 else None)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for reader in self._readers:
            reader.join(timeout=2.0)
        self._readers = []

    def __enter__(self) -> MooncakeMaster:  # noqa: PYI034 - 3.10 has no typing.Self
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self) -> None:
        for proc in (getattr(self, "proc", None), getattr(self, "metadata_proc", None)):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
