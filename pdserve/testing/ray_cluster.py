"""A real multi-node Ray cluster on network-namespace hosts: the head on the first host,
worker nodes on the others, token authentication on, everything removed by `stop()`.

Used by the Ray tests and `benchmarks/multihost.py`."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence

from pdserve import auth
from pdserve.testing.netns import Host

RAY_PORT = 6380


OBJECT_STORE_BYTES = 128 * 2**20


class RayCluster:
    def __init__(self, hosts: Sequence[Host], cpus_per_node: int = 2):
        """`hosts[0]` gets the head; the others a worker node each."""
        self.hosts = hosts
        self.temp_dir = tempfile.mkdtemp(prefix="pdray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.ray = os.path.join(os.path.dirname(sys.executable), "ray")
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": auth.new_token(),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_LOG_TO_STDERR": "0",
            # every "node" here sees the whole machine's memory as its own: Ray's OOM monitor
            # would kill one node's actors for what the others (and the tests beside) hold
            "RAY_memory_monitor_refresh_ms": "0",
        }
        self.head = f"{hosts[0].address}:{RAY_PORT}"
        try:
            self._start(
                0,
                "--head",
                "--port",
                str(RAY_PORT),
                "--num-cpus",
                "1",
                "--dashboard-host",
                hosts[0].address,
                "--temp-dir",
                self.temp_dir,
            )
            for i in range(1, len(hosts)):
                self._start(i, "--address", self.head, "--num-cpus", str(cpus_per_node))
        except BaseException:
            self.stop()
            raise

    def _start(self, i: int, *args: str) -> None:
        # the object store's size explicitly: by default Ray takes 30% of the memory free at that
        # moment and refuses to start below 75 MiB, which a busy machine's free memory hit once.
        # pdserve never sends KV through it; 128 MiB is plenty for actor handles and results.
        r = self.hosts[i].run(
            [
                self.ray,
                "start",
                "--node-ip-address",
                self.hosts[i].address,
                "--disable-usage-stats",
                "--object-store-memory",
                str(OBJECT_STORE_BYTES),
                *args,
            ],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if r.returncode != 0:
            raise RuntimeError(f"ray start on {self.hosts[i].name} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")

    def state(self) -> dict:
        """pdserve's actors from Ray's state API: name -> (node ip, state)."""
        code = (
            "import json, ray\nfrom ray.util.state import list_actors\n"
            f"ray.init(address='{self.head}', logging_level='error')\n"
            "ips = {n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes()}\n"
            "print(json.dumps({a.name: [ips.get(a.node_id), a.state] for a in list_actors("
            "filters=[('ray_namespace', '=', 'pdserve')], limit=100) if a.state == 'ALIVE'}))"
        )
        r = self.hosts[0].run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"Ray's state API failed:\n{r.stderr[-2000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        for i in reversed(range(len(self.hosts))):
            self.hosts[i].run([self.ray, "stop", "--force"], env=self.env, capture_output=True, timeout=60)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
