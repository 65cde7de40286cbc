"""`pdserve serve` as a child process, for tests, benchmarks and calibration: a free loopback
port, its own cluster secret (so the caller may read /internal/*), its output kept for the
error that says why it did not start, ready when /health says so (and, if asked, when enough
workers are alive), stopped with SIGTERM then SIGKILL. The one way this repository starts a
server and waits for it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve import auth
from pdserve.ports import die_with_parent, free_port, wait_until


class Serve:
    """`pdserve serve ARGS` on a free loopback port; `start()` (or entering it) starts it and,
    unless `wait` is False, waits until it is ready; leaving it stops it."""

    def __init__(
        self,
        serve_args: list[str],
        wait_workers: int = 0,
        startup_timeout_s: float = 300.0,
        *,
        env: dict[str, str] | None = None,
        log_level: str | None = "warning",
        api_key: str | None = None,
        wait: bool = True,
        stop_timeout_s: float = 60.0,
        http_timeout_s: float = 10.0,
        port: int | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = auth.new_token()  # our own cluster secret, so that we may read /internal/workers
        self.env = {**os.environ, **(env or {}), auth.TOKEN_ENV: self.token}
        self.http = httpx.Client(auth=auth.http_auth(self.token.encode()), timeout=http_timeout_s, trust_env=False)
        self.api_key = api_key
        self.cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        self.cmd += ["--log-level", log_level] if log_level else []
        self.cmd += [*serve_args, *(["--api-key", api_key] if api_key else [])]
        self.wait_workers, self.startup_timeout_s, self.wait = wait_workers, startup_timeout_s, wait
        self.stop_timeout_s = stop_timeout_s  # how long a drain may take before SIGKILL
        self._log = tempfile.TemporaryFile()  # read back on failure, gone afterwards
        self.proc: subprocess.Popen | None = None

    def start(self) -> Serve:
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,  # its workers too are stopped with it (a process group)
            preexec_fn=die_with_parent,
        )
        if self.wait:
            try:
                self.wait_ready(self.startup_timeout_s)
            except BaseException:
                self.stop()
                raise
        return self

    def __enter__(self) -> Serve:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def headers(self) -> dict:
        """What a client of the public API sends (the API key, when the server has one)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def ready(self) -> bool:
        """/health answers 200 (and enough workers are alive, if asked for)."""
        if self.http.get(self.url + "/health").status_code != 200:
            return False
        return not self.wait_workers or sum(w["alive"] for w in self.workers()) >= self.wait_workers

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until `ready()`; RuntimeError with the server's output if it exits first."""
        return wait_until(self.ready, [self.proc], timeout_s, "pdserve serve", self.log, interval_s=0.1)

    def wait_health(self, status: int, timeout_s: float) -> dict:
        """/health once it answers `status` (503 while loading or draining, say)."""
        wait_until(
            lambda: self.http.get(self.url + "/health").status_code == status,
            [self.proc],
            timeout_s,
            f"pdserve serve (/health {status})",
            self.log,
            interval_s=0.1,
        )
        return self.health()

    def health(self) -> dict:
        return self.http.get(self.url + "/health").json()

    def wait_idle(self, timeout_s: float = 20) -> dict:
        """Health once nothing runs or waits (aborts reach the engine between steps), or at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            h = self.health()
            idle = h.get("num_running") == 0 and h.get("num_waiting") == 0 and h["num_waiting_requests"] == 0
            if idle or time.monotonic() > deadline:
                return h
            time.sleep(0.05)

    def workers(self) -> list[dict]:
        return self.http.get(self.url + "/internal/workers").json()["workers"]

    def metrics(self) -> dict[str, float]:
        """The pdserve /metrics samples: name{tier} -> value."""
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(self.http.get(self.url + "/metrics", headers=self.headers).text):
            for s in fam.samples:
                if s.name.startswith("pdserve:") and not s.name.endswith("_created"):
                    key = s.name + (f"{{{s.labels['tier']}}}" if "tier" in s.labels else "")
                    out[key] = s.value
        return out

    def log(self, tail: int | None = 6000) -> str:
        """The server's output (its children's too), the last `tail` characters of it."""
        self._log.flush()
        self._log.seek(0)
        text = self._log.read().decode(errors="replace")
        return text[-tail:] if tail else text

    def terminate(self) -> None:
        """SIGTERM (a drain), without waiting."""
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        """Send `sig` and wait up to `stop_timeout_s`, then SIGKILL the whole process group; its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode
