"""Clients that go away mid-request abort it, and every KV block returns to the pool."""

import asyncio
import json

import httpx
import pytest

from tests.server.conftest import API_KEY

pytestmark = pytest.mark.integration

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"model": "tiny", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}


def test_twenty_streams_cut_midway_free_their_blocks(tiny_server):
    idle = tiny_server.wait_idle()
    aborted_before = _aborted(tiny_server)

    async def cut_after(c: httpx.AsyncClient, i: int, started: asyncio.Barrier):
        body = {**LONG, "prompt": f"stream number {i} " * (1 + i % 3), "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            # keep the line iterator alive: dropping it mid-way would close the response early
            lines, n = r.aiter_lines(), 0
            while n < 3:
                line = await lines.__anext__()
                if line.startswith("data: "):
                    assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                    n += 1
            await started.wait()  # all 20 are mid-generation together before any disconnects
        return n

    async def main():
        started = asyncio.Barrier(21)
        async with httpx.AsyncClient(
            base_url=tiny_server.url, headers=AUTH, timeout=30, limits=httpx.Limits(max_connections=32)
        ) as c:
            tasks = [asyncio.create_task(cut_after(c, i, started)) for i in range(20)]
            async with asyncio.timeout(60):
                while started.n_waiting < 20:
                    await asyncio.sleep(0.01)
                    for t in tasks:  # a failed stream would otherwise leave the barrier waiting forever
                        if t.done():
                            t.result()
            busy = (await c.get("/health")).json()
            await started.wait()
            return busy, await asyncio.gather(*tasks)

    busy, counts = asyncio.run(main())
    assert counts == [3] * 20
    assert busy["num_running"] + busy["num_waiting"] == 20, busy
    assert busy["num_free_blocks"] < idle["num_free_blocks"]
    after = tiny_server.wait_idle()
    assert after["num_free_blocks"] == idle["num_free_blocks"] == after["num_blocks"]
    assert _aborted(tiny_server) - aborted_before == 20


def test_non_streamed_request_aborts_when_client_times_out(tiny_server):
    idle = tiny_server.wait_idle()
    aborted_before = _aborted(tiny_server)
    with httpx.Client(base_url=tiny_server.url, headers=AUTH) as c:
        try:
            c.post("/v1/completions", json={**LONG, "prompt": "slow"}, timeout=0.3)
            raise AssertionError("1500 tokens should take longer than 0.3s")
        except httpx.ReadTimeout:
            pass
    assert tiny_server.wait_idle()["num_free_blocks"] == idle["num_free_blocks"]
    assert _aborted(tiny_server) - aborted_before == 1


def _aborted(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    line = next(
        ln
        for ln in text.splitlines()
        if ln.startswith("pdserve:request_success_total") and 'finished_reason="abort"' in ln
    )
    return float(line.rsplit(" ", 1)[1])
