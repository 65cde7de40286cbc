"""`pdserve serve --ray` on a real three-node Ray cluster, one node per network namespace:
the head on the first host, worker nodes on the other two, token auth on.

Skips, saying why, where namespaces cannot be made or Ray is not installed."""

import os
import subprocess
import threading
import time

import httpx
import pytest

from pdserve import LLM, SamplingParams
from pdserve.testing.multihost import RayDeployment
from pdserve.testing.netns import Hosts, NetnsUnavailable
from pdserve.testing.ray_cluster import RayCluster

pytestmark = pytest.mark.integration

pytest.importorskip("ray")
ROUTER_PORT = 8000
PROMPT = "tell me a story about the sea and the ships that sail on it " * 2


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory):
    """A replayed request is recomputed by prefill: clear greedy margins keep it token-identical."""
    from tests.tiny import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("sharp")), logit_scale=8.0)


def _pdserve_pids(host, role: str) -> list[int]:
    pids = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True).stdout.split()
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        # pdserve.cli worker --config <dir>/<role>-<i>.json
        if (
            b"pdserve.cli" in cmd
            and b"worker" in cmd
            and any(os.path.basename(a).startswith(role.encode()) for a in cmd)
        ):
            out.append(int(pid))
    return out


def test_serve_on_ray_across_three_hosts(sharp_model_dir):
    try:
        hosts = Hosts(3)
    except NetnsUnavailable as e:
        pytest.skip(f"cannot make network namespaces here: {e}")
    llm = LLM(sharp_model_dir, dtype="float32", block_size=16, num_gpu_blocks=256)
    want, want_long = (
        llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].text
        for n in (60, 200)
    )
    cluster = dep = None
    try:
        cluster = RayCluster(hosts)
        dep = RayDeployment(
            cluster,
            sharp_model_dir,
            served_model_name="sharp",
            serve_args=["--placement", "spread", "--dtype", "float32", "--block-size", "16", "--num-gpu-blocks", "256"],
        )

        def complete(max_tokens: int = 60) -> httpx.Response:
            return httpx.post(
                dep.url + "/v1/completions",
                timeout=120,
                json={
                    "model": "sharp",
                    "prompt": PROMPT,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )

        actors = cluster.state()
        assert actors["pdserve-router"][0] == hosts[0].address
        p_ip, d_ip = actors["pdserve-prefill-0"][0], actors["pdserve-decode-1"][0]
        assert p_ip != d_ip and {p_ip, d_ip} <= {hosts[1].address, hosts[2].address}, actors
        r = complete()
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text

        # kill -9 the decode worker's process with requests in flight: they complete, replayed;
        # Ray restarts the actor, which starts the worker again
        results = []
        load = [threading.Thread(target=lambda: results.append(complete(200))) for _ in range(3)]
        for t in load:
            t.start()
        time.sleep(1.0)
        d_host = next(h for h in hosts.hosts if h.address == d_ip)
        victims = _pdserve_pids(d_host, "decode")
        assert victims, "no decode worker process found on its host"
        for pid in victims:
            os.kill(pid, 9)
        for t in load:
            t.join(180)
        assert len(results) == 3 and all(r.status_code == 200 for r in results), [r.text for r in results]
        assert all(r.json()["choices"][0]["text"] == want_long for r in results)  # replayed token for token
        deadline = time.monotonic() + 120
        while "decode-1" not in dep.alive() or _pdserve_pids(d_host, "decode") in ([], victims):
            assert time.monotonic() < deadline, "the decode worker did not come back"
            time.sleep(1)
        assert complete().json()["choices"][0]["text"] == want
    finally:
        if dep is not None:
            dep.stop()
        if cluster is not None:
            cluster.stop()
        hosts.close()
