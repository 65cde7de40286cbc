"""Pools that change while serving: `pdserve scale`, and the autoscaler, under load, losing nothing."""

import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pdserve import auth
from tests.server.deployment import Deployment, metric
from tests.server.serverproc import REPO

pytestmark = pytest.mark.integration


class Load:
    """`streams` clients sending completions back to back until stopped; every answer kept."""

    def __init__(self, url: str, streams: int, max_tokens: int):
        self.url, self.max_tokens = url, max_tokens
        self.codes: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(streams)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=120) as c:
            while not self._stop.is_set():
                try:
                    r = c.post(
                        self.url + "/v1/completions",
                        json={
                            "model": "tiny",
                            "prompt": f"client {i} says hello",
                            "max_tokens": self.max_tokens,
                            "ignore_eos": True,
                        },
                    )
                    self.codes.append(r.status_code)
                    ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == self.max_tokens
                    if not ok:
                        self.errors.append(r.text[:300])
                except httpx.HTTPError as e:
                    self.errors.append(f"{type(e).__name__}: {e}")

    def stop(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(120)


def wait_pools(dep: Deployment, want: dict, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    live = None
    while time.monotonic() < deadline:
        live = dep.http.get(dep.url + "/internal/admin/pools").json()["live"]
        if all(live[r] == n for r, n in want.items()):
            return live
        time.sleep(0.2)
    raise AssertionError(f"pools never reached {want}: {live}\n{dep.log()}")


def scale(dep: Deployment, *args: str) -> subprocess.CompletedProcess:
    """`pdserve scale`, given the deployment's token in its environment as an operator would."""
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "scale", "--router", dep.url, *args],
        cwd=REPO,
        env={**os.environ, auth.TOKEN_ENV: dep.token},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_scale_up_and_down_under_load_loses_nothing(tiny_model_dir):
    dep = Deployment(tiny_model_dir, "--served-model-name", "tiny", "--prefill", "2", "--decode", "1")
    load = Load(dep.url, streams=3, max_tokens=16)
    try:
        time.sleep(1)
        r = scale(dep, "--decode", "+1", "--prefill", "-1")
        assert r.returncode == 0, r.stderr
        wait_pools(dep, {"prefill": 1, "decode": 2}, 90)
        time.sleep(2)  # the new decode worker takes traffic
        r = scale(dep, "--status")
        assert '"wanted"' in r.stdout and r.returncode == 0
        bad = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                "scale",
                "--router",
                dep.url,
                "--decode",
                "+1",
                "--cluster-token-file",
                os.devnull,
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert bad.returncode != 0  # no token, no scaling
    finally:
        load.stop()
        code = dep.stop()
    assert load.errors == [], load.errors[:5]
    assert len(load.codes) >= 6 and set(load.codes) == {200}
    assert code == 0


def test_autoscaler_grows_decode_under_load_and_shrinks_after(tiny_model_dir):
    dep = Deployment(
        tiny_model_dir,
        "--served-model-name",
        "tiny",
        "--autoscale",
        "--min-decode",
        "1",
        "--max-decode",
        "2",
        "--min-prefill",
        "1",
        "--max-prefill",
        "1",
        "--autoscale-cooldown-s",
        "2",
        "--autoscale-interval-s",
        "0.5",
        num_gpu_blocks=48,
    )
    try:
        load = Load(dep.url, streams=6, max_tokens=120)  # decode-heavy: the decode pool's KV fills
        try:
            wait_pools(dep, {"decode": 2}, 90)
        finally:
            load.stop()
        assert load.errors == [], load.errors[:5]
        wait_pools(dep, {"decode": 1}, 90)  # the load stopped: back to the minimum
        text = httpx.get(dep.url + "/metrics", timeout=5).text
        assert metric(text, 'pdserve:autoscale_decisions_total{direction="up",role="decode"}') >= 1, text
        assert metric(text, 'pdserve:autoscale_decisions_total{direction="down",role="decode"}') >= 1, text
        changes = dep.http.get(dep.url + "/internal/admin/pools").json()["changes"]
        assert any(c["by"].startswith("autoscale") for c in changes)
    finally:
        assert dep.stop() == 0
