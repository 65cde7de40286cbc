"""`pdserve serve` supervises its processes: it restarts what dies, and SIGTERM drains.

Real launcher, router and workers on loopback, the tiny model."""

import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.server.deployment import Deployment, metric

pytestmark = pytest.mark.integration


@pytest.fixture
def model(tiny_model_dir):
    return tiny_model_dir


def test_dead_processes_are_restarted_and_counted(model):
    dep = Deployment(model, "--served-model-name", "tiny")
    try:
        decode = dep.child("decode-1")
        decode.kill()
        decode.wait(10)
        # while the decode worker is down, the prefill worker serves whole requests
        assert dep.complete(4).status_code == 200
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ws = dep.workers()
            if ws.get("decode-1", {}).get("alive") and ws["decode-1"].get("stats"):
                break
            time.sleep(0.2)
        assert dep.child("decode-1").pid != decode.pid
        text = httpx.get(dep.url + "/metrics", timeout=5).text
        assert metric(text, 'pdserve:worker_restarts_total{role="decode",worker_id="decode-1"}') == 1, text

        # a reservation the router made just before it died: nobody will decode it
        decode_url = dep.workers()["decode-1"]["url"]
        r = dep.http.post(
            decode_url + "/internal/reserve",
            json={"request_id": "orphan", "prompt_token_ids": list(range(1, 100)), "deadline_s": 600},
        )
        assert r.status_code == 200, r.text

        def free_blocks() -> tuple[int, int]:
            # with blocks fenced from a prefill worker that may still write into them (it writes
            # this shared-memory cache itself, until the reservation's lease is over): not the
            # reservation's any more, not free yet
            st = dep.http.get(decode_url + "/internal/state").json()["stats"]
            return st["num_free_blocks"] + st["num_fenced_blocks"], st["num_blocks"]

        assert free_blocks()[0] < free_blocks()[1]
        router = dep.child("router")
        router.kill()
        router.wait(10)
        # sent while no router runs: it waits in the listening socket the launcher holds, and the
        # restarted router (once the workers registered again) answers it
        r = dep.complete(4, timeout_s=30)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 15  # freed when the worker learns its router restarted, not in 600 s
        while free_blocks()[0] != free_blocks()[1]:
            assert time.monotonic() < deadline, "the dead router's reservation kept its blocks"
            time.sleep(0.2)
        assert dep.child("router").pid != router.pid
        text = httpx.get(dep.url + "/metrics", timeout=5).text
        assert metric(text, 'pdserve:worker_restarts_total{role="router",worker_id="router"}') == 1, text
        assert dep.proc.poll() is None
    finally:
        assert dep.stop() == 0, dep.log()


def test_sigterm_drains_then_exits_clean(model):
    """In flight: finishes. Sent during the drain: 503 with Retry-After, not a refused
    connection. After: exit 0 and no shared-memory KV file of ours left in /dev/shm."""
    dep = Deployment(model, "--served-model-name", "tiny", "--shutdown-timeout", "30")
    pids = [p.pid for p in psutil.Process(dep.proc.pid).children()]
    result = {}

    def long_stream():
        result["r"] = dep.complete(400, timeout_s=120)

    prefill = dep.workers()["prefill-0"]["url"]  # hold the next prefill 3 s: in flight for sure
    assert dep.http.post(prefill + "/internal/fault", json={"worker": "delay_prefill=0:3"}).status_code == 200
    t = threading.Thread(target=long_stream)
    t.start()
    time.sleep(0.5)
    dep.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    r = dep.complete(4)
    assert r.status_code == 503 and "retry-after" in r.headers, r.text
    t.join(120)
    assert result["r"].status_code == 200, result["r"].text
    assert result["r"].json()["usage"]["completion_tokens"] == 400
    assert dep.proc.wait(60) == 0, dep.log()
    left = [f for f in os.listdir("/dev/shm") if any(f.startswith(f"pdserve-kv-{pid}-") for pid in pids)]
    assert left == [], left
    dep.http.close()


def test_a_hung_router_is_killed_and_restarted(model):
    """A router that stops answering (here SIGSTOP) would hold every request through the front
    forever; once it has been silent for ROUTER_HUNG_S the launcher kills it and it restarts."""
    dep = Deployment(model, "--served-model-name", "tiny")
    try:
        router = dep.child("router")
        # a stall shorter than that, longer than the workers' heartbeat timeout (2 s): the
        # router does not blame its workers for the beats it did not read
        router.suspend()
        time.sleep(6)
        router.resume()
        assert dep.complete(4).status_code == 200
        time.sleep(1)
        assert "counted dead" not in dep.log() and dep.child("router").pid == router.pid
        router.suspend()
        r = dep.complete(4, timeout_s=120)  # waits in the listener until the new router takes it
        assert r.status_code == 200, r.text
        assert dep.child("router").pid != router.pid
        assert "has not answered" in dep.log()
    finally:
        assert dep.stop() == 0, dep.log()


def test_a_worker_killed_at_shutdown_leaves_no_kv_files(model):
    """A decode worker that does not stop in time is killed; its shared-memory KV cache
    (RAM) is removed by the launcher, not left until another worker starts there."""
    dep = Deployment(model, "--served-model-name", "tiny", "--shutdown-timeout", "2")
    decode = dep.child("decode-1")
    assert any(f.startswith(f"pdserve-kv-{decode.pid}-") for f in os.listdir("/dev/shm"))
    decode.suspend()  # SIGSTOP: it cannot drain nor run its exit handlers
    dep.proc.send_signal(signal.SIGTERM)
    assert dep.proc.wait(90) == 0, dep.log()
    assert not decode.is_running()
    assert [f for f in os.listdir("/dev/shm") if f.startswith(f"pdserve-kv-{decode.pid}-")] == []
    assert "did not stop in time" in dep.log() and "removed" in dep.log()
    dep.http.close()


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """Sharp (greedy picks survive a recompute, see tests/transfer/test_faults.py) and long
    enough that a stream is still running when the router dies."""
    from tests.tiny import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("long")), logit_scale=8.0, max_pos=4096)


def _read_stream(r, on_chunk=None) -> dict:
    """Text per choice, ids, error events and [DONE]s of an SSE completion stream."""
    import json

    out = {"text": {}, "ids": set(), "errors": [], "done": 0, "usage": None, "comments": 0}
    for line in r.iter_lines():
        if line.startswith(":"):
            out["comments"] += 1
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            out["done"] += 1
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            out["errors"].append(chunk)
            continue
        out["ids"].add(chunk["id"])
        out["usage"] = chunk.get("usage") or out["usage"]
        for c in chunk["choices"]:
            out["text"][c["index"]] = out["text"].get(c["index"], "") + c["text"]
        if on_chunk is not None:
            on_chunk()
    return out


def test_router_killed_mid_stream_loses_nothing(long_model):
    """kill -9 of the router: the front (in the launcher) resumes the cut streams on the
    restarted router and sends again the requests it had not answered; the client sees one
    stream with a pause, the same text as without the fault, one id, one [DONE]."""
    MAX = 1500
    dep = Deployment(long_model, "--served-model-name", "tiny")
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": MAX, "temperature": 0, "ignore_eos": True, "n": 2}
    try:
        ref = httpx.post(dep.url + "/v1/completions", json=body, timeout=120).json()
        ref_text = [c["text"] for c in ref["choices"]]
        router = dep.child("router")
        whole = {}

        def not_streamed():  # sent just before the kill: answered by the restarted router
            whole["r"] = httpx.post(dep.url + "/v1/completions", json=body, timeout=120)

        chunks = []

        def kill_once():
            chunks.append(1)
            if len(chunks) == 5:
                t = threading.Thread(target=not_streamed)
                t.start()
                whole["t"] = t
                time.sleep(0.2)
                router.kill()

        with httpx.stream(
            "POST",
            dep.url + "/v1/completions",
            timeout=120,
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        ) as r:
            assert r.status_code == 200
            got = _read_stream(r, kill_once)
        whole["t"].join(120)
        assert not router.is_running() and dep.child("router").pid != router.pid
        assert got["errors"] == [] and got["done"] == 1 and got["comments"] == 0, got["errors"]
        assert len(got["ids"]) == 1
        assert [got["text"][i] for i in range(2)] == ref_text
        assert got["usage"]["completion_tokens"] == 2 * MAX
        w = whole["r"]
        assert w.status_code == 200, w.text
        assert [c["text"] for c in w.json()["choices"]] == ref_text
        text = httpx.get(dep.url + "/metrics", timeout=5).text
        assert metric(text, "pdserve:front_requests_resumed_total") >= 1, text
        assert metric(text, "pdserve:request_resumed_total") >= 1, text  # the new router's count
        assert metric(text, "pdserve:front_requests_failed_total") == 0
    finally:
        assert dep.stop() == 0, dep.log()
