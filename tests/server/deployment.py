"""`pdserve serve` (disaggregated) as a real process tree for tests: launcher, router, workers.

Its cluster token is the test's, so the test signs internal calls as the router does;
fault injection is on (`/internal/fault`)."""

import os
import signal
import subprocess
import sys
import tempfile

import httpx
import psutil

from pdserve import auth
from pdserve.ports import die_with_parent, free_port, wait_until
from tests.server.serverproc import REPO


class Deployment:
    def __init__(self, model_dir: str, *args: str, num_gpu_blocks: int = 128):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token = auth.new_token()
        self.http = httpx.Client(auth=auth.http_auth(token.encode()), timeout=5)
        self._log = tempfile.TemporaryFile()
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "serve",
            "--model",
            model_dir,
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--num-gpu-blocks",
            str(num_gpu_blocks),
            "--block-size",
            "16",
            "--no-pin",
            "--worker-timeout-s",
            "2",
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, auth.TOKEN_ENV: token, "OMP_NUM_THREADS": "1", "PDSERVE_ENABLE_FAULT_INJECTION": "1"},
            preexec_fn=die_with_parent,
        )
        try:
            self.wait_serving(180)
        except BaseException:
            self.stop()
            raise

    def log(self, tail: int | None = 6000) -> str:
        """The deployment's output (the launcher's and every child's), its last `tail` characters."""
        self._log.flush()
        self._log.seek(0)
        text = self._log.read().decode(errors="replace")
        return text[-tail:] if tail else text

    def child(self, worker_id: str) -> psutil.Process:
        for p in psutil.Process(self.proc.pid).children():
            cmd = p.cmdline()
            # a worker's command line names its config file after it: worker --config <dir>/decode-1.json
            if worker_id == "router" and "router" in cmd or any(a.endswith(f"/{worker_id}.json") for a in cmd):
                return p
        raise LookupError(worker_id)

    def workers(self) -> dict:
        return {w["worker_id"]: w for w in self.http.get(self.url + "/internal/workers").json()["workers"]}

    def wait_serving(self, timeout_s: float) -> float:
        """Seconds until a completion succeeds."""
        return wait_until(
            lambda: sum(w["alive"] for w in self.workers().values()) >= 2 and self.complete(4).status_code == 200,
            [self.proc],
            timeout_s,
            "pdserve serve",
            self.log,
        )

    def complete(self, max_tokens: int, timeout_s: float = 30) -> httpx.Response:
        return httpx.post(
            self.url + "/v1/completions",
            timeout=timeout_s,
            json={"model": "tiny", "prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True},
        )

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                for p in psutil.Process(self.proc.pid).children():
                    p.kill()
                self.proc.kill()
                self.proc.wait()
        self.http.close()
        return self.proc.returncode


def _metric(text: str, prefix: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def metric(text: str, prefix: str) -> float:
    """The sum of the Prometheus samples whose line starts with `prefix`."""
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))
