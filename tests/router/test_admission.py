"""Early rejection and KV backpressure from registry state, and the 429 it becomes."""

import time

import httpx
import pytest

from pdserve.router.admission import AdmissionConfig, Admitter
from pdserve.router.placement import Placer
from pdserve.router.registry import Registry, WorkerInfo
from tests.transfer.cluster import Cluster


def _registry(decode_stats):
    reg = Registry()
    reg.register(WorkerInfo("p0", "http://p0", "prefill"))
    reg.heartbeat("p0", {"kv_block_size": 16, "prefill_cost_s": [0.0, 1e-3, 0.0]})  # 1 ms per token
    reg.register(WorkerInfo("d0", "http://d0", "decode"))
    reg.heartbeat("d0", decode_stats)
    return reg


def test_ttft_prediction_includes_booked_queue():
    reg, placer = _registry({}), Placer("cache_aware", clock=lambda: 0.0)
    adm = Admitter(AdmissionConfig(slo_ttft_s=0.5))
    assert adm.check(reg, placer, list(range(300)), 10).admitted  # 0.3 s
    placer.pick(reg, list(range(1000, 1400)))  # books 0.4 s on p0
    d = adm.check(reg, placer, list(range(300)), 10)  # 0.4 + 0.3 > 0.5
    assert (d.admitted, d.reason, d.retry_after_s) == (False, "ttft_slo", 1)
    assert adm.admitted == 1 and adm.rejected["ttft_slo"] == 1


def test_tpot_checked_only_with_a_decode_model():
    busy = {"num_running": 20, "kv_usage": 0.5, "num_blocks": 100, "kv_block_size": 16}
    adm = Admitter(AdmissionConfig(slo_tpot_s=0.030))
    assert adm.check(_registry(busy), Placer(), [1] * 10, 10).admitted
    modelled = {**busy, "decode_cost_s": [0.010, 0.001, 0.0]}  # 10 + 21 ms > 30 ms
    d = adm.check(_registry(modelled), Placer(), [1] * 10, 10)
    assert (d.admitted, d.reason) == (False, "tpot_slo")


def test_tpot_counts_the_routers_own_decode_bookings():
    """Heartbeats are a second stale: a burst must see the requests already sent to D."""
    idle = {"num_running": 0, "kv_block_size": 16, "decode_cost_s": [0.010, 0.002, 0.0]}
    reg, placer = _registry(idle), Placer()
    adm = Admitter(AdmissionConfig(slo_tpot_s=0.030))
    for i in range(9):  # 10 + 2 * (i + 1) ms <= 30 ms
        assert adm.check(reg, placer, [1] * 10, 10).admitted, i
        placer.book_decode("d0", f"r{i}", 10, 10)
    d = adm.check(reg, placer, [1] * 10, 10)  # the tenth: 10 + 2 * 10 = 30 ms; the eleventh breaks it
    assert d.admitted
    placer.book_decode("d0", "r9", 10, 10)
    d = adm.check(reg, placer, [1] * 10, 10)
    assert (d.admitted, d.reason) == (False, "tpot_slo")
    assert adm.last["tpot_s"] == pytest.approx(0.032)
    placer.release_decode("r0")
    assert adm.check(reg, placer, [1] * 10, 10).admitted


def test_ttft_includes_the_exposed_kv_transfer():
    reg = _registry({"kv_block_size": 16})
    reg.heartbeat(
        "p0",
        {
            "kv_block_size": 16,
            "prefill_cost_s": [0.0, 1e-3, 0.0],  # 1 ms per token
            "kv_bytes_per_token": 1000,
            "num_layers": 10,
            "kv_layerwise": False,
        },
    )
    bw = 1e6  # 1 MB/s: 300 tokens x 1000 bytes = 0.3 s eager
    adm = Admitter(AdmissionConfig(slo_ttft_s=0.5, kv_bandwidth_bytes_per_s=bw))
    d = adm.check(reg, Placer(), list(range(300)), 10)  # 0.3 prefill + 0.3 transfer > 0.5
    assert (d.admitted, d.reason) == (False, "ttft_slo")
    assert adm.last["transfer_s"] == pytest.approx(0.3)
    reg.heartbeat("p0", {**reg.get("p0").stats, "kv_layerwise": True})  # one layer of ten exposed
    assert adm.check(reg, Placer(), list(range(300)), 10).admitted
    assert adm.last["transfer_s"] == pytest.approx(0.03)
    # measured: the exposed bytes / seconds P reports, when no bandwidth is configured
    adm = Admitter(AdmissionConfig(slo_ttft_s=0.5))
    adm.transfers.observe(3000, 0.01)
    adm.transfers.observe(1000, 0.01)
    assert adm.bandwidth_bytes_per_s == pytest.approx(2e5)
    adm.check(reg, Placer(), list(range(300)), 10)
    assert adm.last["transfer_s"] == pytest.approx(30000 / 2e5)


def test_kv_watermark_refuses_long_requests_only():
    full = {"kv_usage": 0.95, "num_blocks": 100}
    adm = Admitter(AdmissionConfig(kv_watermark=0.92, long_request_tokens=1024))
    assert adm.check(_registry(full), Placer(), [1] * 100, 100).admitted
    d = adm.check(_registry(full), Placer(), [1] * 1000, 100)
    assert (d.admitted, d.reason) == (False, "kv_backpressure")
    assert adm.check(_registry({"kv_usage": 0.5, "num_blocks": 100}), Placer(), [1] * 1000, 100).admitted


def test_config_validation_and_off_by_default():
    assert not AdmissionConfig().enabled
    with pytest.raises(ValueError):
        AdmissionConfig(kv_watermark=1.5)
    with pytest.raises(ValueError):
        AdmissionConfig(slo_ttft_s=0)


@pytest.mark.integration
def test_router_answers_429_with_retry_after(tiny_model_dir):
    """An SLO no request can meet: every request is refused before reaching a worker."""
    with Cluster(
        tiny_model_dir,
        worker_args=["--dtype", "float32", "--block-size", "16", "--num-gpu-blocks", "64"],
        router_args=["--slo-ttft-ms", "0.001"],
    ) as c:
        model = httpx.get(c.url + "/v1/models").json()["data"][0]["id"]
        r = httpx.post(c.url + "/v1/completions", timeout=30, json={"model": model, "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
        status = c.status()
        assert status["admission"]["rejected"] == {"ttft_slo": 1}
        assert c.worker_state("prefill0")["stats"]["prefix_cache_queries_tokens"] == 0  # no prefill work
        assert 'pdserve:router_early_rejected_total{reason="ttft_slo"} 1.0' in httpx.get(c.url + "/metrics").text


def test_conductor_status_reports_lin_lout_and_ratio():
    from pdserve.router.app import conductor_status
    from pdserve.server.metrics import ServerMetrics

    m, reg = ServerMetrics("m"), Registry()
    reg.register(WorkerInfo("p0", "http://p0", "prefill"))
    reg.register(WorkerInfo("d0", "http://d0", "decode"))
    assert conductor_status(m, reg)["recommended_nd_per_np"] is None  # nothing observed yet
    for lin, lout in ((6000, 400), (10000, 600)):
        m.req_prompt.observe(lin)
        m.req_generation.observe(lout)
    reg.heartbeat("p0", {"prefill_tokens_per_s": 4000})
    reg.heartbeat("d0", {"decode_tokens_per_s": 500})
    st = conductor_status(m, reg)
    assert (st["mean_lin_tokens"], st["mean_lout_tokens"]) == (8000, 500)
    assert st["recommended_nd_per_np"] == pytest.approx(0.5)  # long prompts, short answers: half as many D as P
    from types import SimpleNamespace

    from pdserve.auth import Verifier
    from pdserve.router.app import _RouterCollector
    from pdserve.router.pools import PoolManager
    from pdserve.server.metrics import Histogram

    engine = SimpleNamespace(
        metrics=m,
        admitter=None,
        pools=PoolManager(reg, drain=None),
        counters={k: 0 for k in ("kv_bytes", "kv_seconds", "kv_failed", "kv_retries", "recomputed", "replaced")},
        kv_transfer_time=Histogram("pdserve:kv_transfer_duration_seconds", "", [0.1]),
        kv_exposed_time=Histogram("pdserve:kv_transfer_exposed_duration_seconds", "", [0.1]),
    )
    collector = _RouterCollector(engine, reg, Verifier(b"0123456789abcdef"))
    gauges = {
        f.name: f.samples[0].value
        for f in collector.collect()
        if f.type == "gauge" and f.samples and not f.samples[0].labels
    }
    assert gauges["pdserve:recommended_pd_ratio"] == pytest.approx(0.5)
    assert gauges["pdserve:observed_mean_prompt_tokens"] == 8000


@pytest.mark.integration
def test_router_refuses_on_predicted_tpot(tiny_model_dir):
    """The decode worker calibrated its step model at start-up: a TPOT SLO below one
    step is refused before any prefill, as tpot_slo."""
    with Cluster(
        tiny_model_dir,
        worker_args=["--dtype", "float32", "--block-size", "16", "--num-gpu-blocks", "64"],
        router_args=["--slo-tpot-ms", "0.001"],
    ) as c:
        model = httpx.get(c.url + "/v1/models").json()["data"][0]["id"]
        r = httpx.post(c.url + "/v1/completions", timeout=30, json={"model": model, "prompt": "hello", "max_tokens": 2})
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "tpot_slo"
        status = c.status()
        assert status["admission"]["rejected"] == {"tpot_slo": 1}
        assert status["admission"]["last_prediction"]["tpot_s"] > 0.001 / 1e3
        assert c.worker_state("prefill0")["stats"]["prefix_cache_queries_tokens"] == 0


@pytest.mark.integration
def test_conductor_status_non_null_after_traffic(tiny_model_dir):
    """Lin / Lout observed, Theta_P and Theta_D from the workers' calibrations: the
    decode-per-prefill ratio is a number on /internal/conductor and /metrics."""
    with Cluster(
        tiny_model_dir, worker_args=["--dtype", "float32", "--block-size", "16", "--num-gpu-blocks", "64"]
    ) as c:
        model = httpx.get(c.url + "/v1/models").json()["data"][0]["id"]
        for i in range(3):
            r = httpx.post(
                c.url + "/v1/completions",
                timeout=30,
                json={"model": model, "prompt": f"request {i} " * 8, "max_tokens": 6, "ignore_eos": True},
            )
            assert r.status_code == 200, r.text
        st = c.http.get(c.url + "/internal/conductor").json()
        assert st["mean_lout_tokens"] == 6 and st["mean_lin_tokens"] > 0
        assert st["theta_p_tokens_per_s"] > 0 and st["theta_d_tokens_per_s"] > 0
        assert st["recommended_nd_per_np"] == pytest.approx(
            st["mean_lout_tokens"] / st["mean_lin_tokens"] * st["theta_p_tokens_per_s"] / st["theta_d_tokens_per_s"]
        )
        assert "pdserve:recommended_pd_ratio " in httpx.get(c.url + "/metrics").text
        d = c.worker_state("decode0")

        def decode_stats():  # the router sees a worker's live steps one heartbeat later
            return next(w["stats"] for w in c.status()["workers"] if w["worker_id"] == "decode0")

        deadline = time.monotonic() + 10
        while not decode_stats().get("decode_live_samples") and time.monotonic() < deadline:
            time.sleep(0.1)
        s = decode_stats()
        assert len(s["decode_cost_s"]) == 3 and s["decode_live_samples"] > 0  # live steps seen
        assert d["stats"]["num_running"] == 0
        assert c.status()["counters"]["kv_exposed_seconds"] > 0
