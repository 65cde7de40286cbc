"""`pdserve serve` (disaggregated) as a real process tree for tests: launcher, router, workers.

Its cluster token is the test's, so the test signs internal calls as the router does;
fault injection is on (`/internal/fault`)."""

import httpx
import psutil

from pdserve.testing.serve import Serve


class Deployment(Serve):
    def __init__(self, model_dir: str, *args: str, num_gpu_blocks: int = 128, env: dict | None = None):
        flags = ["--model", model_dir, "--dtype", "float32", "--num-gpu-blocks", str(num_gpu_blocks)]
        flags += ["--block-size", "16", "--no-pin", "--worker-timeout-s", "2", *args]
        env = {"OMP_NUM_THREADS": "1", "PDSERVE_ENABLE_FAULT_INJECTION": "1", **(env or {})}
        super().__init__(flags, startup_timeout_s=180, env=env, log_level=None, http_timeout_s=5)
        self.start()

    def child(self, worker_id: str) -> psutil.Process:
        for p in psutil.Process(self.proc.pid).children():
            cmd = p.cmdline()
            # a worker's command line names its config file after it: worker --config <dir>/decode-1.json
            if worker_id == "router" and "router" in cmd or any(a.endswith(f"/{worker_id}.json") for a in cmd):
                return p
        raise LookupError(worker_id)

    def workers(self) -> dict:
        return {w["worker_id"]: w for w in super().workers()}

    def ready(self) -> bool:
        """Serving: two workers alive and a completion succeeds."""
        return sum(w["alive"] for w in self.workers().values()) >= 2 and self.complete(4).status_code == 200

    def complete(self, max_tokens: int, timeout_s: float = 30) -> httpx.Response:
        return httpx.post(
            self.url + "/v1/completions",
            timeout=timeout_s,
            json={"model": "tiny", "prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True},
        )


def _metric(text: str, prefix: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def metric(text: str, prefix: str) -> float:
    """The sum of the Prometheus samples whose line starts with `prefix`."""
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))
