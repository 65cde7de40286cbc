"""The router-and-workers deployment of the disaggregation tests: pdserve.testing.cluster's,
with heartbeats every 0.3 s and a router that gives a silent worker up after 2 s, so that
failures show within a test's time."""

from __future__ import annotations

from pdserve.testing import cluster


class Cluster(cluster.Cluster):
    def __init__(self, model: str | None, *, router_args=(), worker_args=(), **kw):
        super().__init__(
            model,
            router_args=["--worker-timeout-s", "2", *router_args],
            worker_args=["--heartbeat-s", "0.3", *worker_args],
            **kw,
        )
