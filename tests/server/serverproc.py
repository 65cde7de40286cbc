"""Start `pdserve serve` as a real subprocess on a free loopback port, and always stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from pdserve.ports import die_with_parent, free_port, health_is, wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ServerProcess:
    def __init__(
        self,
        *args: str,
        api_key: str | None = None,
        wait_ready: bool = True,
        timeout_s: float = 180,
        env: dict | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "serve",
            "--mode",
            "collocated",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        if api_key:
            cmd += ["--api-key", api_key]
        self._log = tempfile.TemporaryFile()  # read back on failure, gone afterwards
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            preexec_fn=die_with_parent,
        )
        if wait_ready:
            try:
                self.wait_health(200, timeout_s)
            except BaseException:
                self.stop()
                raise

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_health(self, status: int, timeout_s: float) -> dict:
        wait_until(
            lambda: health_is(self.url, status),
            [self.proc],
            timeout_s,
            f"the server (/health {status})",
            self.log,
            interval_s=0.1,
        )
        return self.health()

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def wait_idle(self, timeout_s: float = 20) -> dict:
        """Health once nothing runs or waits (aborts reach the engine between steps)."""
        deadline = time.monotonic() + timeout_s
        while True:
            h = self.health()
            if (
                h["num_running"] == 0 and h["num_waiting"] == 0 and h["num_waiting_requests"] == 0
            ) or time.monotonic() > deadline:
                return h
            time.sleep(0.05)

    def log(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-5000:]

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
