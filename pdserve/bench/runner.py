"""Run a workload against an endpoint: the library entry point (`run_benchmark`).

Requests are sent at their scheduled times, each behind the concurrency
limits that apply to it (`max_concurrency` for all, `tag_concurrency` per
tag). Outputs are written into a list made before the first request, so an
interrupted run (Ctrl-C) still has every result it measured; requests that
never finished say so in their error.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from dataclasses import dataclass, field

from pdserve.bench import arrivals, metrics
from pdserve.bench.client import (
    CHAT,
    COMPLETIONS,
    BenchError,
    RequestOutput,
    make_client,
    request_body,
    send,
    served_models,
)
from pdserve.bench.datasets import Request


@dataclass
class RunState:
    """Everything measured so far; complete once `end` is set."""

    outputs: list[RequestOutput]
    start: float = 0.0
    end: float | None = None
    interrupted: bool = False
    config: dict = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return (self.end if self.end is not None else time.perf_counter()) - self.start


async def _run(
    state: RunState,
    requests: list[Request],
    times: list[float],
    bodies: list[bytes],
    url: str,
    *,
    chat: bool,
    api_key: str | None,
    timeout_s: float,
    max_concurrency: int | None,
    tag_concurrency: dict[str, int],
    progress,
    send_until_s: float | None = None,
) -> None:
    limits = {tag: asyncio.Semaphore(n) for tag, n in tag_concurrency.items()}
    overall = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(i: int) -> None:
        out = state.outputs[i]
        async with contextlib.AsyncExitStack() as stack:
            # the tag's slot first: a chat waiting for a chat slot must not hold a global one
            for sem in (limits.get(out.tag), overall):
                if sem is not None:
                    await stack.enter_async_context(sem)
            if (
                send_until_s is not None
                and requests[i].arrival_s is None
                and time.perf_counter() - state.start > send_until_s
            ):
                out.sent = False  # a closed loop past its duration: this user stops
                return
            await send(client, url, bodies[i], out, state.start, chat)
        progress.update(out)

    order = sorted(range(len(requests)), key=lambda i: times[i])
    async with make_client(api_key, timeout_s) as client:
        # the first request through a fresh client pays for lazy imports and a connection
        # (~60 ms here): pay it before the clock starts, not in one request's TTFT
        with contextlib.suppress(Exception):
            await client.get(url.rsplit("/v1/", 1)[0] + "/v1/models")
        tasks = []
        state.start = time.perf_counter()
        try:
            for i in order:
                delay = state.start + times[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
        finally:
            state.end = time.perf_counter()
            for t in tasks:
                t.cancel()


def run_benchmark(
    requests: list[Request],
    base_url: str,
    *,
    model: str | None = None,
    endpoint: str = COMPLETIONS,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    use_trace_times: bool = True,
    max_concurrency: int | None = None,
    tag_concurrency: dict[str, int] | None = None,
    goodput: dict[str, float] | None = None,
    percentiles=metrics.DEFAULT_PERCENTILES,
    percentile_metrics=metrics.METRICS,
    ignore_eos: bool = False,
    temperature: float = 0.0,
    extra_body: dict | None = None,
    api_key: str | None = None,
    timeout_s: float = 3600.0,
    seed: int = 0,
    progress: bool = False,
    state: RunState | None = None,
    send_until_s: float | None = None,
) -> dict:
    """Send `requests` to `base_url` and return the result dict (vLLM's field names, see `metrics.result`).

    `model` defaults to the first id `GET /v1/models` lists; a `BenchError`
    says why when the endpoint cannot be used at all. Request-level failures
    (HTTP errors, error events, dropped connections) are counted in `failed`
    and listed in `errors`, never raised. Pass a `RunState` to keep the
    partial outputs if the run is interrupted.

    `send_until_s`: requests without their own arrival time whose turn comes
    later than this (s from the start) are not sent, so a closed loop runs for
    a duration rather than a count; they are left out of the result, whose
    `request_indices` then name the requests the arrays describe.
    """
    if endpoint not in (COMPLETIONS, CHAT):
        raise BenchError(f"--endpoint must be {COMPLETIONS} or {CHAT}, got {endpoint!r}")
    if max_concurrency is not None and max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    if not requests:
        raise BenchError("the workload has no requests")
    served = served_models(base_url, api_key)
    if model is None:
        if not served:
            raise BenchError(f"{base_url} serves no models")
        model = served[0]
    elif model not in served:
        raise BenchError(f"{base_url} does not serve {model!r}; it serves {served}")
    times = arrivals.schedule(requests, request_rate, burstiness, seed=seed, use_trace_times=use_trace_times)
    # bodies are built before the clock starts: a 10K-token prompt takes a while to serialize
    bodies = [
        request_body(r, model, endpoint, ignore_eos=ignore_eos, temperature=temperature, extra=extra_body)
        for r in requests
    ]
    state = state or RunState([])
    state.outputs[:] = [RequestOutput(prompt_len=r.prompt_len, tag=r.tag) for r in requests]
    state.config = dict(
        base_url=base_url,
        endpoint=endpoint,
        model_id=model,
        request_rate="inf" if math.isinf(request_rate) else request_rate,  # JSON has no inf
        burstiness=burstiness,
        arrivals=_arrivals_name(request_rate, burstiness),
        num_fixed_arrivals=sum(r.arrival_s is not None for r in requests) if use_trace_times else 0,
        max_concurrency=max_concurrency,
        tag_concurrency=dict(tag_concurrency or {}),
        ignore_eos=ignore_eos,
        temperature=temperature,
    )
    bar = Progress(len(requests), enabled=progress)
    try:
        asyncio.run(
            _run(
                state,
                requests,
                times,
                bodies,
                base_url.rstrip("/") + endpoint,
                chat=endpoint == CHAT,
                api_key=api_key,
                timeout_s=timeout_s,
                max_concurrency=max_concurrency,
                tag_concurrency=tag_concurrency or {},
                progress=bar,
                send_until_s=send_until_s,
            )
        )
    except KeyboardInterrupt:
        state.interrupted = True
    finally:
        bar.close()
    return finish(state, goodput=goodput, percentiles=percentiles, percentile_metrics=percentile_metrics)


def _arrivals_name(request_rate: float, burstiness: float) -> str:
    """How requests without their own arrival time were sent (those with one follow it)."""
    if math.isinf(request_rate):
        return "all at once"
    return "poisson" if burstiness == 1 else f"gamma (burstiness {burstiness:g})"


def finish(
    state: RunState, *, goodput=None, percentiles=metrics.DEFAULT_PERCENTILES, percentile_metrics=metrics.METRICS
) -> dict:
    """The result dict of a run, complete or interrupted."""
    for out in state.outputs:
        if out.sent and not out.success and not out.error:
            out.error = "interrupted before it finished" if state.interrupted else "not finished"
    sent = [i for i, out in enumerate(state.outputs) if out.sent]
    res = metrics.result(
        [state.outputs[i] for i in sent],
        state.duration_s,
        percentiles=percentiles,
        percentile_metrics=percentile_metrics,
        goodput=goodput,
    )
    extra = (
        {}
        if len(sent) == len(state.outputs)
        else {"request_indices": sent, "num_unsent": len(state.outputs) - len(sent)}
    )
    return {**state.config, "interrupted": state.interrupted, **res, **extra}


class Progress:
    """tqdm when it is installed, else one line rewritten in place; counts failures as it goes."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.failed = total, 0, 0
        self._bar = None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, unit="req", dynamic_ncols=True, file=sys.stderr)

    def update(self, out: RequestOutput) -> None:
        self.done += 1
        self.failed += not out.success
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            if not out.success:
                self._bar.set_postfix(failed=self.failed, refresh=False)
        elif self.done == self.total or self.done % max(1, self.total // 50) == 0:
            print(f"\r{self.done}/{self.total} requests done, {self.failed} failed", end="", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self.done:
            print(file=sys.stderr)
