"""Three hosts on separate network stacks (network namespaces on one bridge): router on
one, prefill worker on a second, decode worker on a third, started by hand.

Skips, saying why, only where namespaces cannot be made (not root, no iproute2)."""

import subprocess

import httpx
import pytest

from pdserve import LLM, SamplingParams
from pdserve.testing.multihost import HostDeployment
from pdserve.testing.netns import Hosts, NetnsUnavailable

pytestmark = pytest.mark.integration

# the namespaces share this machine's /dev/shm: without a shared-memory cache the KV can only travel by TCP
ENGINE = [
    "--dtype",
    "float32",
    "--block-size",
    "16",
    "--num-gpu-blocks",
    "256",
    "--kv-transport",
    "tcp",
    "--kv-shm-dir",
    "",
]
PROMPTS = ["hello world", "tell me a story about the sea and the ships that sail on it " * 3]


@pytest.fixture
def hosts():
    try:
        h = Hosts(3)
    except NetnsUnavailable as e:
        pytest.skip(f"cannot make network namespaces here: {e}")
    try:
        yield h
    finally:
        h.close()
    left = subprocess.run(["ip", "netns"], capture_output=True, text=True).stdout
    assert h.tag not in left  # nothing of ours is left behind


def test_router_prefill_decode_on_three_hosts(hosts, tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32", block_size=16, num_gpu_blocks=256)
    want = [
        o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ]
    with HostDeployment(hosts[0], [hosts[1]], [hosts[2]], tiny_model_dir, worker_args=ENGINE) as dep:
        workers = {w["worker_id"]: w for w in dep.status()["workers"]}
        assert workers["prefill0"]["url"].startswith(f"http://{hosts[1].address}:")
        assert (
            workers["decode0"]["kv_address"]
            == f"tcp://{hosts[2].address}:" + workers["decode0"]["kv_address"].rsplit(":", 1)[1]
        )
        model = httpx.get(dep.url + "/v1/models", timeout=5).json()["data"][0]["id"]
        for prompt, text in zip(PROMPTS, want):
            r = httpx.post(
                dep.url + "/v1/completions",
                timeout=60,
                json={"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
            )
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == text, r.text
        assert dep.metric("pdserve:kv_transfer_bytes_total") > 0  # the KV crossed between the hosts
        assert dep.metric("pdserve:kv_transfer_failed_total") == 0
        assert dep.metric("pdserve:request_recomputed_total") == 0
        # a worker that advertises an address the router cannot dial is told so, clearly
        # (a port of one of our hosts where nothing listens)
        r = dep.http.post(
            dep.url + "/internal/register",
            json={"worker_id": "lost", "url": f"http://{hosts[1].address}:9", "role": "decode"},
        )
        assert r.status_code == 400 and "--advertise-host" in r.json()["error"]["message"]
