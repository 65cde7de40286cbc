"""`pdserve serve` hands its router and workers the settings it was given: seen in what each
child logs at start-up (its non-default settings) and in how it behaves.

Real launcher, router and workers on loopback, the tiny model."""

import json
import os
import stat

import httpx
import psutil
import pytest

from tests.server.deployment import Deployment

pytestmark = pytest.mark.integration


def _settings_logged(log: str, logger: str) -> list[dict]:
    out = []
    for line in log.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("logger") == logger and rec.get("msg") == "non-default settings":
            out.append(rec["settings"])
    return out


def _config_files(dep: Deployment) -> list[str]:
    """The `--config FILE` of each process the launcher started."""
    out = []
    for child in psutil.Process(dep.proc.pid).children():
        cmd = child.cmdline()
        assert "--config" in cmd, cmd
        out.append(cmd[cmd.index("--config") + 1])
    return out


def test_serve_flags_reach_the_router_and_every_worker(tiny_model_dir):
    dep = Deployment(
        tiny_model_dir,
        "--served-model-name",
        "tiny",
        "--log-format",
        "json",
        "--dtype",
        "fp32",  # the short spelling: the children get float32
        "--max-num-seqs",
        "7",
        "--no-kv-layerwise",
        "--max-seqs-per-request",
        "3",
        "--max-waiting-requests",
        "11",
        "--shutdown-timeout",
        "9",
        "--max-request-body-bytes",
        "60000",
        "--heartbeat-s",
        "0.5",
        "--long-request-tokens",
        "999",
    )
    try:
        # behaviour: the workers' engines run with these, and the router refuses by its limit
        stats = {w: info["stats"] for w, info in dep.workers().items()}
        assert sorted(stats) == ["decode-1", "prefill-0"]
        assert all(s["max_num_seqs"] == 7 and s["kv_layerwise"] is False for s in stats.values()), stats
        r = httpx.post(
            dep.url + "/v1/completions",
            timeout=30,
            json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "n": 4},
        )
        assert r.status_code == 400 and "max_seqs_per_request=3" in r.json()["error"]["message"], r.text

        log = dep.log(tail=None)
        (router,) = _settings_logged(log, "pdserve.router")
        assert {k: router.get(k) for k in ("max-request-body-bytes", "shutdown-timeout", "max-seqs-per-request")} == {
            "max-request-body-bytes": 60000,
            "shutdown-timeout": 9.0,
            "max-seqs-per-request": 3,
        }
        assert (router["long-request-tokens"], router["log-format"], router["worker-timeout-s"]) == (999, "json", 2.0)
        workers = _settings_logged(log, "pdserve.worker")
        assert sorted(w["worker-id"] for w in workers) == ["decode-1", "prefill-0"]
        for w in workers:
            assert (w["max-waiting-requests"], w["shutdown-timeout"], w["heartbeat-s"]) == (11, 9.0, 0.5), w
            assert (w["dtype"], w["max-num-seqs"], w["kv-layerwise"], w["log-format"]) == ("float32", 7, False, "json")
            assert "api-key" not in w and "cluster-token-file" not in w

        # the children's config files: private, JSON, no secret in them
        files = _config_files(dep)
        assert sorted(os.path.basename(f) for f in files) == ["decode-1.json", "prefill-0.json", "router.json"]
        directory = os.path.dirname(files[0])
        assert {os.path.dirname(f) for f in files} == {directory}
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        for path in files:
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
            with open(path) as f:
                text = f.read()
            assert dep.token not in text and isinstance(json.loads(text), dict)
    finally:
        assert dep.stop() == 0
    assert not os.path.exists(directory), "the config files outlived the deployment"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two cores")
def test_serve_pins_router_and_front_with_the_decode_workers(tiny_model_dir):
    """One core each for the prefill and the decode worker; the router and the front (a thread
    of the launcher) share the decode worker's, so they never queue behind a long prefill."""
    cores = sorted(os.sched_getaffinity(0))
    t = len(cores) // 2  # threads per worker: the cores shared out between the two
    prefill, decode = set(cores[:t]), set(cores[t : 2 * t])
    dep = Deployment(tiny_model_dir, "--served-model-name", "tiny", "--pin")  # --pin after the harness's --no-pin
    try:
        assert dep.complete(4).status_code == 200
        affinity = {w: set(dep.child(w).cpu_affinity()) for w in ("router", "prefill-0", "decode-1")}
        assert affinity == {"prefill-0": prefill, "decode-1": decode, "router": decode}, affinity
        launcher = psutil.Process(dep.proc.pid)
        threads = {t.id: os.sched_getaffinity(t.id) for t in launcher.threads()}
        assert threads[dep.proc.pid] == set(cores), "the launcher itself keeps every core"
        assert decode in threads.values(), f"no thread of the launcher on the decode cores: {threads}"
    finally:
        assert dep.stop() == 0
