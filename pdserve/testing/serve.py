"""`pdserve serve` as a child process, for benchmarks and tests: a free loopback port,
its own cluster secret (so the caller may read /internal/*), ready when /health says so
(and, if asked, when enough workers are alive), stopped with SIGTERM then SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve import auth
from pdserve.ports import free_port, wait_until


class Serve:
    """`pdserve serve ARGS` on a free loopback port, stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, serve_args: list[str], wait_workers: int = 0, startup_timeout_s: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        token = auth.new_token()  # our own cluster secret, so that we may read /internal/workers
        self.env = {**os.environ, auth.TOKEN_ENV: token}
        self.http = httpx.Client(auth=auth.http_auth(token.encode()), timeout=10, trust_env=False)
        self.cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "serve",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *serve_args,
        ]
        self.wait_workers, self.startup_timeout_s = wait_workers, startup_timeout_s
        self.log = tempfile.TemporaryFile()
        self.proc = None

    def __enter__(self) -> Serve:
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _ready(self) -> bool:
        if self.http.get(self.url + "/health").status_code != 200:
            return False
        if not self.wait_workers:
            return True
        return sum(w["alive"] for w in self.workers()) >= self.wait_workers

    def _wait_ready(self) -> None:
        wait_until(self._ready, [self.proc], self.startup_timeout_s, "pdserve serve", self.tail, interval_s=0.5)

    def workers(self) -> list[dict]:
        return self.http.get(self.url + "/internal/workers").json()["workers"]

    def metrics(self) -> dict[str, float]:
        """The /metrics samples this benchmark reads: name{tier} -> value."""
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(self.http.get(self.url + "/metrics").text):
            for s in fam.samples:
                if s.name.startswith("pdserve:") and not s.name.endswith("_created"):
                    key = s.name + (f"{{{s.labels['tier']}}}" if "tier" in s.labels else "")
                    out[key] = s.value
        return out

    def tail(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
