"""A router + prefill + decode workers deployment for the conductor benchmarks.

Real processes on 127.0.0.1 free ports, one thread each (the machine's cores are
shared); stopped (SIGTERM, then SIGKILL) on exit, whatever happened.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import httpx

from pdserve import auth
from pdserve.ports import free_port, wait_until

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Deployment:
    def __init__(
        self,
        prefill: int,
        decode: int,
        *,
        model: str | None = None,
        router_args=(),
        worker_args=(),
        startup_timeout_s: float = 300.0,
    ):
        self.model_args = ["--model", model] if model else []
        self.router_args, self.worker_args = list(router_args), list(worker_args)
        self.prefill, self.decode, self.startup_timeout_s = prefill, decode, startup_timeout_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[tuple[str, subprocess.Popen, object]] = []
        token = auth.new_token()  # this deployment's cluster secret, for its children and our calls
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", auth.TOKEN_ENV: token}
        self.http = httpx.Client(auth=auth.http_auth(token.encode()), timeout=10)

    def _start(self, name: str, *args: str) -> None:
        log = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "pdserve.cli", *args]
        p = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.procs.append((name, p, log))

    def __enter__(self) -> Deployment:
        try:
            self._start(
                "router",
                "router",
                *self.model_args,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                *self.router_args,
            )
            for role, n in (("prefill", self.prefill), ("decode", self.decode)):
                for i in range(n):
                    self._start(
                        f"{role}{i}",
                        "worker",
                        "--role",
                        role,
                        *self.model_args,
                        "--router",
                        self.url,
                        "--worker-id",
                        f"{role}{i}",
                        "--threads",
                        "1",
                        "--log-level",
                        "warning",
                        *self.worker_args,
                    )
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        def registered() -> bool:
            roles = [w["role"] for w in self.status()["workers"] if w["alive"]]
            return roles.count("prefill") >= self.prefill and roles.count("decode") >= self.decode

        wait_until(
            registered,
            [p for _, p, _ in self.procs],
            self.startup_timeout_s,
            "the router and its workers",
            lambda: "\n".join(self.log(n) for n, _, _ in self.procs),
            interval_s=0.5,
        )

    def status(self) -> dict:
        return self.http.get(self.url + "/internal/workers").json()

    def conductor(self) -> dict:
        return self.http.get(self.url + "/internal/conductor").json()

    def worker_stats(self, role: str) -> list[dict]:
        return [w["stats"] or {} for w in self.status()["workers"] if w["role"] == role]

    def log(self, name: str) -> str:
        for n, _, f in self.procs:
            if n == name:
                f.flush()
                f.seek(0)
                return f"--- {name}\n" + f.read().decode(errors="replace")[-3000:]
        return ""

    def stop(self) -> None:
        for _, p, _ in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p, _ in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


def load_str() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])
