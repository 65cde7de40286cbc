"""A router + prefill + decode workers deployment for the conductor benchmarks.

pdserve.testing.cluster's: real processes on 127.0.0.1 free ports, one thread each (the
machine's cores are shared); stopped (SIGTERM, then SIGKILL) on exit, whatever happened.
"""

from __future__ import annotations

from pdserve.testing.cluster import Cluster


class Deployment(Cluster):
    """The router and workers at the warning log level; a prefill and a decode step of a
    long prompt on one core can take tens of seconds, so they have minutes to start."""

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
        quiet = ["--log-level", "warning"]
        super().__init__(
            model,
            prefill,
            decode,
            worker_args=[*quiet, *worker_args],
            router_args=[*quiet, *router_args],
            timeout_s=startup_timeout_s,
        )

    def conductor(self) -> dict:
        return self.http.get(self.url + "/internal/conductor").json()


def load_str() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])
