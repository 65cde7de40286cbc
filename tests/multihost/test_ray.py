"""`pdserve serve --ray` on a real three-node Ray cluster, one node per network namespace:
the head on the first host, worker nodes on the other two, token auth on.

Skips, saying why, where namespaces cannot be made or Ray is not installed."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from pdserve import LLM, SamplingParams, auth
from pdserve.testing.netns import Hosts, NetnsUnavailable

pytest.importorskip("ray")
RAY_PORT, ROUTER_PORT = 6380, 8000
PROMPT = "tell me a story about the sea and the ships that sail on it " * 2


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory):
    """A replayed request is recomputed by prefill: clear greedy margins keep it token-identical."""
    from tests.tiny import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("sharp")), logit_scale=8.0)


class RayCluster:
    def __init__(self, hosts: Hosts, temp_dir: str):
        self.hosts, self.temp_dir = hosts, temp_dir
        self.ray = os.path.join(os.path.dirname(sys.executable), "ray")
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": auth.new_token(),
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_LOG_TO_STDERR": "0"}
        self.head = f"{hosts[0].address}:{RAY_PORT}"
        self._start(0, "--head", "--port", str(RAY_PORT), "--num-cpus", "1", "--dashboard-host", hosts[0].address,
                    "--temp-dir", temp_dir)
        for i in (1, 2):
            self._start(i, "--address", self.head, "--num-cpus", "2")

    def _start(self, i: int, *args: str) -> None:
        r = self.hosts[i].run([self.ray, "start", "--node-ip-address", self.hosts[i].address,
                               "--disable-usage-stats", *args], env=self.env, capture_output=True, text=True,
                              timeout=120)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]

    def state(self) -> dict:
        """pdserve's actors from Ray's state API: name -> (node ip, state)."""
        code = ("import json, ray\nfrom ray.util.state import list_actors\n"
                f"ray.init(address='{self.head}', logging_level='error')\n"
                "ips = {n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes()}\n"
                "print(json.dumps({a.name: [ips.get(a.node_id), a.state] for a in list_actors("
                "filters=[('ray_namespace', '=', 'pdserve')], limit=100) if a.state == 'ALIVE'}))")
        r = self.hosts[0].run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        for i in (2, 1, 0):
            self.hosts[i].run([self.ray, "stop", "--force"], env=self.env, capture_output=True, timeout=60)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _pdserve_pids(host, role: str) -> list[int]:
    pids = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True).stdout.split()
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if b"pdserve.cli" in cmd and b"worker" in cmd and role.encode() in cmd:
            out.append(int(pid))
    return out


def test_serve_on_ray_across_three_hosts(sharp_model_dir, tmp_path):
    try:
        hosts = Hosts(3)
    except NetnsUnavailable as e:
        pytest.skip(f"cannot make network namespaces here: {e}")
    llm = LLM(sharp_model_dir, dtype="float32", block_size=16, num_gpu_blocks=256)
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0].outputs[0].text
    token = auth.new_token()
    cluster = driver = None
    log = open(tmp_path / "driver.log", "wb")
    try:
        cluster = RayCluster(hosts, tempfile.mkdtemp(prefix="pdray", dir="/tmp"))  # short: socket paths < 108 B
        driver = hosts[0].popen(
            [sys.executable, "-m", "pdserve.cli", "serve", "--ray", "--ray-address", cluster.head, "--placement",
             "spread", "--model", sharp_model_dir, "--served-model-name", "sharp", "--port", str(ROUTER_PORT),
             "--dtype", "float32", "--block-size", "16", "--num-gpu-blocks", "256", "--worker-timeout-s", "2"],
            env={**cluster.env, auth.TOKEN_ENV: token}, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://{hosts[0].address}:{ROUTER_PORT}"
        http = httpx.Client(auth=auth.http_auth(token.encode()), timeout=10)

        def complete(max_tokens: int = 60) -> httpx.Response:
            return httpx.post(url + "/v1/completions", timeout=120, json={
                "model": "sharp", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})

        def alive() -> dict:
            return {w["worker_id"]: w for w in http.get(url + "/internal/workers").json()["workers"] if w["alive"]}

        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-4000:]
            try:
                if {"prefill-0", "decode-1"} <= set(alive()):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1)
        else:
            raise AssertionError("not serving:\n" + (tmp_path / "driver.log").read_text()[-4000:])
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
        deadline = time.monotonic() + 120
        while "decode-1" not in alive() or _pdserve_pids(d_host, "decode") in ([], victims):
            assert time.monotonic() < deadline, "the decode worker did not come back"
            time.sleep(1)
        assert complete().json()["choices"][0]["text"] == want
    finally:
        if driver is not None and driver.poll() is None:
            driver.terminate()
            try:
                driver.wait(60)
            except subprocess.TimeoutExpired:
                driver.kill()
        if cluster is not None:
            cluster.stop()
        hosts.close()
        log.close()
