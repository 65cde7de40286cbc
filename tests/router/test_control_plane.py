"""The control plane with real processes: who may join, what a caller may ask, and how
requests survive workers that die, stop or leave.

Each test fails on a router and workers that trust any caller, take leases as given,
need both roles alive, or let a stopped worker freeze its streams.
"""

import json
import os
import signal
import socket
import time

import httpx
import pytest

from pdserve import LLM, SamplingParams, auth
from tests.transfer.cluster import Cluster

pytestmark = pytest.mark.integration

ENGINE = ["--dtype", "float32", "--block-size", "16", "--num-gpu-blocks", "256", "--kv-transport", "tcp"]
PROMPT = "tell me a story about the sea and the ships that sail on it " * 4


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory):
    """Replays recompute by prefill: a model with clear greedy margins keeps them token-identical."""
    from tests.tiny import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("sharp")), logit_scale=8.0)


def reference(model_dir, max_tokens: int) -> str:
    llm = LLM(model_dir, dtype="float32", block_size=16, num_gpu_blocks=256)
    return (
        llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].outputs[0].text
    )


def complete(c: Cluster, max_tokens: int, timeout_s: float = 60) -> httpx.Response:
    model = httpx.get(c.url + "/v1/models", timeout=5).json()["data"][0]["id"]
    return httpx.post(
        c.url + "/v1/completions",
        timeout=timeout_s,
        json={"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    )


def wait_for(cond, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def alive_ids(c: Cluster) -> set[str]:
    return {w["worker_id"] for w in c.status()["workers"] if w["alive"]}


def test_only_holders_of_the_cluster_token_get_in(tiny_model_dir):
    """Bound to every interface, a fake worker, unsigned control calls and a forged KV
    connection are each refused and logged; the deployment keeps serving."""
    with Cluster(tiny_model_dir, worker_args=ENGINE, host="0.0.0.0") as c:
        d = c.worker("decode0")
        fake = {"worker_id": "evil", "url": "http://127.0.0.1:9", "role": "decode", "kv_address": "tcp://127.0.0.1:9"}
        wrong = httpx.Client(auth=auth.http_auth(b"not-the-cluster-token-at-all"), timeout=5)
        for client in (httpx, wrong):
            r = client.post(c.url + "/internal/register", json=fake)
            assert r.status_code == 401 and r.json()["error"]["code"] == "cluster_auth", r.text
            assert client.post(c.url + "/internal/heartbeat", json={"worker_id": "decode0"}).status_code == 401
            r = client.post(
                d.url + "/internal/reserve",
                json={"request_id": "x", "prompt_token_ids": [1, 2, 3], "deadline_s": 100000},
            )
            assert r.status_code == 401
            assert client.get(d.url + "/internal/state").status_code == 401
            assert (
                client.post(
                    d.url + "/internal/pull", json={"request_id": "x", "address": "tcp://127.0.0.1:9"}
                ).status_code
                == 401
            )
        assert "evil" not in {w["worker_id"] for w in c.status()["workers"]}
        assert c.worker_state("decode0")["stats"]["num_free_blocks"] == 256  # nothing was reserved

        kv = next(w["kv_address"] for w in c.status()["workers"] if w["worker_id"] == "decode0")
        host, port = kv.split("://")[1].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as s:
            header = json.dumps({"op": "done", "tid": "x", "nbytes": 0}).encode()
            s.sendall(len(header).to_bytes(4, "big") + header)
            s.settimeout(10)
            got = b""
            while chunk := s.recv(4096):  # the challenge, then the receiver hangs up on us
                got += chunk
            assert b"ack" not in got
        assert "refused" in c.router.log() and "refused" in d.log()
        metrics = httpx.get(c.url + "/metrics", timeout=5).text
        refused = next(line for line in metrics.splitlines() if line.startswith("pdserve:internal_auth_refused_total"))
        assert float(refused.split()[-1]) >= 4
        assert complete(c, 4).status_code == 200


def test_a_worker_with_the_wrong_secret_exits_and_a_proxy_catches_nothing(tiny_model_dir):
    """A worker the router refuses stops at once with status 2 (retrying cannot help), and
    an operator's http_proxy does not catch the deployment's own loopback traffic."""
    from pdserve.testing.cluster import Proc

    proxy = {"HTTP_PROXY": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9", "NO_PROXY": "", "no_proxy": ""}
    with Cluster(tiny_model_dir, worker_args=ENGINE + ["--no-calibrate"], env=proxy) as c:
        assert complete(c, 3).status_code == 200  # registered and served through the proxy-laden env
        args = ["worker", "--role", "decode", "--model", tiny_model_dir, "--router", c.url, "--no-calibrate"]
        intruder = Proc("intruder", *args, *ENGINE, env={auth.TOKEN_ENV: auth.new_token()})
        try:
            intruder.proc.wait(120)
            assert intruder.proc.returncode == 2, intruder.log()
            assert "refused this worker's cluster secret" in intruder.log()
        finally:
            intruder.kill()
        assert len(alive_ids(c)) == 2


def test_reservation_leases_are_capped_by_the_worker(tiny_model_dir):
    """A caller asking for a day-long lease gets the worker's cap: the blocks come back."""
    with Cluster(tiny_model_dir, worker_args=ENGINE, decode_args=["--max-kv-lease-s", "1"]) as c:
        d = c.worker("decode0")
        r = c.http.post(
            d.url + "/internal/reserve",
            json={"request_id": "orphan", "prompt_token_ids": list(range(1, 200)), "deadline_s": 100000},
        )
        assert r.status_code == 200, r.text
        assert c.worker_state("decode0")["stats"]["num_free_blocks"] < 256
        wait_for(lambda: c.worker_state("decode0")["stats"]["num_free_blocks"] == 256, 15, "the lease to expire")
        for bad in (b"1e999", b"-1", b'"soon"'):  # infinity, negative, not a number
            r = c.http.post(
                d.url + "/internal/reserve",
                headers={"content-type": "application/json"},
                content=b'{"request_id": "y", "prompt_token_ids": [1], "deadline_s": ' + bad + b"}",
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "deadline_s", r.text


def test_one_role_serves_alone_while_the_other_is_gone(sharp_model_dir):
    """kill -9 of the decode worker: the prefill worker runs requests whole; then the
    same with the prefill worker gone. Output equals collocated greedy output."""
    want = reference(sharp_model_dir, 12)
    with Cluster(sharp_model_dir, worker_args=ENGINE) as c:
        assert complete(c, 12).json()["choices"][0]["text"] == want
        c.worker("decode0").kill()
        wait_for(lambda: "decode0" not in alive_ids(c), 10, "the router to notice the dead decode worker")
        r = complete(c, 12)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
        assert c.status()["counters"]["whole"] >= 1
    with Cluster(sharp_model_dir, worker_args=ENGINE) as c:
        c.worker("prefill0").kill()
        wait_for(lambda: "prefill0" not in alive_ids(c), 10, "the router to notice the dead prefill worker")
        r = complete(c, 12)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text


def test_a_router_is_loading_until_a_worker_registers_and_failed_once_all_are_dead(tiny_model_dir):
    """/health: "loading" (503) before any worker has registered, with the reason, and a request
    then gets a 503 that says so; "ok" once one has; "failed" when every worker it knew died."""
    with Cluster(tiny_model_dir, prefill=0, decode=0) as c:
        h = httpx.get(c.url + "/health", timeout=5)
        assert h.status_code == 503 and h.json()["status"] == "loading", h.text
        assert "register" in h.json()["reason"]
        r = httpx.post(c.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading" and "Retry-After" in r.headers
        args = ["worker", "--role", "decode", "--model", tiny_model_dir, "--router", c.url, "--worker-id", "decode0"]
        args += ["--threads", "1", "--advertise-host", "127.0.0.1", *ENGINE]
        from pdserve.testing.cluster import Proc

        c.workers.append(Proc("decode0", *args, env=c.env))
        c.wait_workers(0, 1, 120)
        wait_for(lambda: httpx.get(c.url + "/health", timeout=5).status_code == 200, 10, "the router to be ok")
        c.worker("decode0").kill()
        wait_for(lambda: not alive_ids(c), 10, "the router to notice the dead worker")
        h = httpx.get(c.url + "/health", timeout=5)
        assert h.status_code == 503 and h.json()["status"] == "failed", h.text


def test_a_stopped_decode_worker_does_not_freeze_its_streams(sharp_model_dir):
    """SIGSTOP of the decode worker mid-stream: the router stops hearing it, replays the
    request elsewhere, and the stream finishes with the right text long before SIGCONT."""
    want = reference(sharp_model_dir, 200)
    with Cluster(sharp_model_dir, worker_args=ENGINE, prefill=1, decode=2) as c:
        model = httpx.get(c.url + "/v1/models", timeout=5).json()["data"][0]["id"]
        text, stopped, started = "", None, time.monotonic()
        with httpx.stream(
            "POST",
            c.url + "/v1/completions",
            timeout=60,
            json={
                "model": model,
                "prompt": PROMPT,
                "max_tokens": 200,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            },
        ) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                text += json.loads(line[6:])["choices"][0]["text"]
                if stopped is None and len(text) > 20:
                    stopped = next(
                        w
                        for w in c.workers
                        if w.name.startswith("decode") and c.worker_state(w.name)["stats"]["num_running"]
                    )
                    os.kill(stopped.proc.pid, signal.SIGSTOP)
                    stop_s = time.monotonic()
        try:
            assert text == want
            assert stopped is not None and time.monotonic() - stop_s < 15, "the stream waited for SIGCONT"
            assert c.status()["counters"]["replaced"] >= 1
        finally:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        wait_for(lambda: stopped.name in alive_ids(c), 15, "the stopped worker to come back")
        assert complete(c, 8).status_code == 200
        assert time.monotonic() - started < 90


def test_router_counts_clients_that_leave_mid_stream(tiny_model_dir):
    """A client that disconnects mid-stream is an aborted request on the router's /metrics,
    and its decode worker frees the request's blocks."""
    with Cluster(tiny_model_dir, worker_args=ENGINE) as c:
        model = httpx.get(c.url + "/v1/models", timeout=5).json()["data"][0]["id"]

        def aborted() -> float:
            text = httpx.get(c.url + "/metrics", timeout=5).text
            return sum(
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("pdserve:request_success_total") and 'finished_reason="abort"' in line
            )

        before = aborted()
        for _ in range(3):
            with httpx.stream(
                "POST",
                c.url + "/v1/completions",
                timeout=30,
                json={"model": model, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True},
            ) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        break  # the first token came: leave
        wait_for(lambda: aborted() - before >= 3, 10, "the router to count three aborts")
        states = c.wait_idle()
        assert all(s["num_free_blocks"] == s["num_blocks"] for s in states.values()), states


def test_a_rolling_upgrade_never_runs_a_salted_request_on_a_worker_that_would_drop_the_salt(tiny_model_dir):
    """A worker older than the router registers without `features` and would silently ignore a
    request's cache_salt (its request parsing drops fields it does not know), reusing and
    filling the unsalted cache. Such a request goes only to workers that say they have it, and
    is a 503 that says why when none does; other requests still use every worker."""
    with Cluster(tiny_model_dir, worker_args=ENGINE) as c:
        model = httpx.get(c.url + "/v1/models", timeout=5).json()["data"][0]["id"]
        workers = {w["worker_id"]: w for w in c.status()["workers"]}

        def old(wid):  # the same worker, registering as a version without features would
            w = workers[wid]
            keys = ("worker_id", "url", "role", "kv_address", "kv_export_address")
            r = c.http.post(c.url + "/internal/register", json={k: w[k] for k in keys if w.get(k)})
            assert r.status_code == 200, r.text

        def send(**extra):
            body = {"model": model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
            return httpx.post(c.url + "/v1/completions", json=body | extra, timeout=60)

        assert workers["decode0"]["features"] == ["bad_words", "cache_salt", "reasoning_token_ids"]
        old("decode0")
        before = c.status()["counters"]
        assert send(cache_salt="tenant-a").status_code == 200  # on the prefill worker, whole
        after = c.status()["counters"]
        assert after["whole"] == before["whole"] + 1, (before, after)
        assert send().status_code == 200 and c.status()["counters"]["whole"] == after["whole"]  # P -> D as usual
        old("prefill0")
        r = send(cache_salt="tenant-a")
        assert r.status_code == 503 and "upgrade" in r.json()["error"]["message"], r.text
        assert send(bad_words=["x"]).status_code == 503
        assert send().status_code == 200
