"""A disaggregated deployment across "hosts" (network namespaces): router, prefill and decode
worker each on its own network stack, started by hand as an operator would on three machines.

Used by the multi-host tests and `benchmarks/multihost.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import httpx

from pdserve import auth
from pdserve.ports import wait_until
from pdserve.testing.netns import Host

ROUTER_PORT = 8000  # workers take free ports (several may share a host)


class HostDeployment:
    """`router_host` runs the router; `prefill_hosts` / `decode_hosts` one worker each.
    Every process is stopped by `stop()` (the namespaces' own cleanup kills leftovers)."""

    def __init__(
        self,
        router_host: Host,
        prefill_hosts: list[Host],
        decode_hosts: list[Host],
        model: str | None = None,
        worker_args=(),
        router_args=(),
        timeout_s: float = 180,
    ):
        self.token = auth.new_token()
        self.http = httpx.Client(auth=auth.http_auth(self.token.encode()), timeout=10, trust_env=False)
        self.env = {**os.environ, auth.TOKEN_ENV: self.token, "OMP_NUM_THREADS": "1"}
        self.url = f"http://{router_host.address}:{ROUTER_PORT}"
        self.procs: list[tuple[str, subprocess.Popen, object]] = []
        model_args = ["--model", model] if model else []
        self._start(
            "router",
            router_host,
            "router",
            "--host",
            router_host.address,
            "--port",
            str(ROUTER_PORT),
            "--worker-timeout-s",
            "3",
            *model_args,
            *router_args,
        )
        for role, hosts in (("prefill", prefill_hosts), ("decode", decode_hosts)):
            for i, h in enumerate(hosts):
                self._start(
                    f"{role}{i}",
                    h,
                    "worker",
                    "--role",
                    role,
                    "--router",
                    self.url,
                    "--host",
                    h.address,
                    "--port",
                    "0",
                    "--worker-id",
                    f"{role}{i}",
                    "--threads",
                    "1",
                    *model_args,
                    *worker_args,
                )
        try:
            self.wait_workers(len(prefill_hosts), len(decode_hosts), timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, host: Host, *args: str) -> None:
        log = tempfile.TemporaryFile()
        p = host.popen([sys.executable, "-m", "pdserve.cli", *args], stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.procs.append((name, p, log))

    def log(self, name: str) -> str:
        for n, _, f in self.procs:
            if n == name:
                f.flush()
                f.seek(0)
                return f.read().decode(errors="replace")[-4000:]
        return ""

    def status(self) -> dict:
        return self.http.get(self.url + "/internal/workers").json()

    def wait_workers(self, prefill: int, decode: int, timeout_s: float) -> None:
        def registered() -> bool:
            roles = [w["role"] for w in self.status()["workers"] if w["alive"]]
            return roles.count("prefill") >= prefill and roles.count("decode") >= decode

        wait_until(registered, [p for _, p, _ in self.procs], timeout_s, "the deployment", self.logs, interval_s=0.3)

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)}" for n, _, _ in self.procs)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    def stop(self) -> None:
        for _, p, _ in reversed(self.procs):  # workers first: the router is the last to go
            if p.poll() is None:
                p.terminate()
        for _, p, _ in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.http.close()

    def __enter__(self) -> HostDeployment:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class RayDeployment:
    """`pdserve serve --ray` driven from the head host of a `RayCluster`; the router on the head."""

    def __init__(
        self, cluster, model: str | None = None, serve_args=(), timeout_s: float = 240, served_model_name: str = "model"
    ):
        self.token = auth.new_token()
        self.http = httpx.Client(auth=auth.http_auth(self.token.encode()), timeout=10, trust_env=False)
        head = cluster.hosts[0]
        self.url = f"http://{head.address}:{ROUTER_PORT}"
        self._log = tempfile.TemporaryFile()
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "serve",
            "--ray",
            "--ray-address",
            cluster.head,
            "--port",
            str(ROUTER_PORT),
            "--served-model-name",
            served_model_name,
            "--worker-timeout-s",
            "3",
            *(["--model", model] if model else []),
            *serve_args,
        ]
        self.proc = head.popen(
            cmd, env={**cluster.env, auth.TOKEN_ENV: self.token}, stdout=self._log, stderr=subprocess.STDOUT
        )
        try:
            self.wait_alive({"prefill-0", "decode-1"}, timeout_s)
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def alive(self) -> dict:
        return {
            w["worker_id"]: w for w in self.http.get(self.url + "/internal/workers").json()["workers"] if w["alive"]
        }

    def wait_alive(self, worker_ids: set[str], timeout_s: float) -> None:
        what = f"pdserve serve --ray (workers {sorted(worker_ids)})"
        wait_until(lambda: worker_ids <= set(self.alive()), [self.proc], timeout_s, what, self.log, interval_s=1.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.http.close()

    def __enter__(self) -> RayDeployment:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
