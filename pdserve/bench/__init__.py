"""Benchmark client: drive any OpenAI-compatible endpoint and measure it as `vllm bench serve` does.

Library use (what `pdserve bench` does, minus the flags)::

    from pdserve.bench import TokenSource, datasets, run_benchmark, save_plots

    tokens = TokenSource.from_path("/path/to/hf_dir")         # or TokenSource() for ids < 32000
    cfg = datasets.MixedConfig(num_chats=64, long_input_len=2048)
    reqs = datasets.mixed(cfg, tokens, seed=0)
    result = run_benchmark(reqs, "http://127.0.0.1:8000", tag_concurrency=cfg.tag_concurrency(),
                           goodput={"ttft": 2000, "tpot": 100}, ignore_eos=True)
    result["p99_itl_ms"], result["by_tag"]["chat"]["p99_itl_ms"]
    save_plots(result, "out_dir", prefix="collocated")

Modules: `datasets` (workloads), `arrivals` (send times), `client` (streaming
and timing), `metrics` (the arithmetic), `runner` (`run_benchmark`),
`report` (table and JSON), `plots` (PNGs; needs matplotlib), `cli`.
"""

from pdserve.bench import datasets
from pdserve.bench.client import BenchError, RequestOutput
from pdserve.bench.runner import RunState, run_benchmark
from pdserve.bench.tokens import TokenSource


def save_plots(result: dict, out_dir: str, prefix: str = "bench", title: str = "") -> list[str]:
    """`plots.save_plots`, imported on use so that matplotlib stays optional."""
    from pdserve.bench.plots import save_plots as _save

    return _save(result, out_dir, prefix, title)


__all__ = ["BenchError", "RequestOutput", "RunState", "TokenSource", "datasets", "run_benchmark", "save_plots"]
