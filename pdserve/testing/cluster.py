"""A router and its prefill and decode workers as real processes on loopback, for tests and
benchmarks: each on a free port, with a cluster secret of its own (in the children's
environment; `Cluster.http` signs internal calls with it, as the router and workers do),
ready once the workers have registered, stopped (SIGTERM, then SIGKILL) whatever happened."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from pdserve import auth
from pdserve.ports import die_with_parent, free_port, wait_until


class Proc:
    """`pdserve ARGS --host HOST --port P` on a free port, its output kept."""

    def __init__(self, name: str, *args: str, env: dict | None = None, host: str = "127.0.0.1"):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "pdserve.cli", *args, "--host", host, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
            preexec_fn=die_with_parent,
        )

    def log(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout_s: float = 15) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()


class Cluster:
    """`pdserve router` and `prefill` + `decode` `pdserve worker`s that register with it, one
    thread each. `router_args` and `worker_args` (both roles), `prefill_args`, `decode_args` are
    extra CLI flags. `host`: what every process binds (0.0.0.0 to test that binding wide opens
    nothing). `model` None: the embedded model."""

    def __init__(
        self,
        model: str | None,
        prefill: int = 1,
        decode: int = 1,
        worker_args=(),
        prefill_args=(),
        decode_args=(),
        router_args=(),
        timeout_s: float = 120,
        env: dict | None = None,
        host: str = "127.0.0.1",
    ):
        model_args = ["--model", model] if model else []
        token = auth.new_token()
        self.secret = token.encode()
        self.env = {auth.TOKEN_ENV: token, **(env or {})}
        self.http = httpx.Client(auth=auth.http_auth(self.secret), timeout=10, trust_env=False)
        self.router = Proc("router", "router", *model_args, *router_args, env=self.env, host=host)
        self.url = self.router.url
        self.workers: list[Proc] = []
        try:
            for role, n, extra in (("prefill", prefill, prefill_args), ("decode", decode, decode_args)):
                for i in range(n):
                    name = f"{role}{i}"
                    args = ["worker", "--role", role, *model_args, "--router", self.url, "--worker-id", name]
                    args += ["--threads", "1", "--advertise-host", "127.0.0.1", *worker_args, *extra]
                    self.workers.append(Proc(name, *args, env=self.env, host=host))
            self.wait_workers(prefill, decode, timeout_s)
        except BaseException:
            self.stop()
            raise

    def worker(self, name: str) -> Proc:
        return next(w for w in self.workers if w.name == name)

    def status(self) -> dict:
        return self.http.get(self.url + "/internal/workers").json()

    def worker_stats(self, role: str) -> list[dict]:
        """The heartbeat stats of every worker of `role`, as the router has them."""
        return [w["stats"] or {} for w in self.status()["workers"] if w["role"] == role]

    def log(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log()}" for p in [self.router, *self.workers])

    def wait_workers(self, prefill: int, decode: int, timeout_s: float) -> None:
        def registered() -> bool:
            roles = [w["role"] for w in self.status()["workers"] if w["alive"]]
            return roles.count("prefill") >= prefill and roles.count("decode") >= decode

        procs = [self.router, *self.workers]
        wait_until(registered, [p.proc for p in procs], timeout_s, "the cluster", self.log)

    def worker_state(self, name: str) -> dict:
        return self.http.get(self.worker(name).url + "/internal/state").json()

    def wait_idle(self, timeout_s: float = 20) -> dict[str, dict]:
        """Every live worker's stats once nothing runs or waits, or at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = {w.name: self.worker_state(w.name)["stats"] for w in self.workers if w.proc.poll() is None}
            idle = all(s["num_running"] == 0 and s["num_waiting"] == 0 for s in states.values())
            if idle or time.monotonic() > deadline:
                return states
            time.sleep(0.1)

    def stop(self) -> None:
        for p in [*self.workers, self.router]:  # workers first: the router is the last to go
            p.stop()
        self.http.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
