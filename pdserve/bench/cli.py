"""`pdserve bench`: benchmark any OpenAI-compatible endpoint, with `vllm bench serve`'s flags and metrics.

Exit status: 0 when at least one request completed, 1 when none did or the
endpoint cannot be used, 2 for bad flags or a bad dataset, 130 when
interrupted (the partial result is still printed and saved).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time

from pdserve.bench import datasets, metrics, report
from pdserve.bench.client import CHAT, COMPLETIONS, BenchError

log = logging.getLogger("pdserve.bench")


def add_arguments(p) -> None:
    g = p.add_argument_group("endpoint")
    g.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root (a trailing /v1, as the OpenAI client's base URL has, is dropped)",
    )
    g.add_argument("--endpoint", default=COMPLETIONS, choices=[COMPLETIONS, CHAT])
    g.add_argument("--model", default=None, help="model id to request (default: the first one /v1/models lists)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY") or os.environ.get("PDSERVE_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (env OPENAI_API_KEY or PDSERVE_API_KEY)",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="HF directory, tokenizer.json or GGUF of the served model: exact text lengths and the "
        "right token-id range (default: --model when it is a local path)",
    )
    g.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="draw random prompt token ids below this (default: the tokenizer's, else 32000)",
    )
    g.add_argument("--request-timeout", type=float, default=3600.0, help="seconds one request may take")
    add_workload_arguments(p)
    add_arrival_arguments(p)
    g = p.add_argument_group("sampling")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length (vLLM extension)")
    g.add_argument("--temperature", type=float, default=0.0)
    add_result_arguments(p, replot=True)
    show_defaults(p)


def show_defaults(p) -> None:
    """`--help` names each option's default (as vLLM's benchmark does), unless its help already
    says what the default is or there is none to give."""
    for a in p._actions:
        if a.help == argparse.SUPPRESS or a.default in (None, False, argparse.SUPPRESS) or not a.option_strings:
            continue
        if "key" in a.dest or "token" in a.dest:
            continue  # a secret from the environment is never printed
        if "default" not in (a.help or "") and a.dest != "help":
            a.help = ((a.help or "") + " (default: %(default)s)").strip()


def add_workload_arguments(p) -> None:
    """What requests to send: the datasets and their lengths (`pdserve sim` takes them too)."""
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", default="random", choices=["random", "sharegpt", "mooncake", "mixed"])
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON or Mooncake trace JSONL")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests to send (mixed: the number of chats)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--skip-bad-lines", action="store_true", help="skip malformed dataset entries instead of stopping")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)] (random and mixed)",
    )
    g.add_argument("--random-prefix-len", type=int, default=0, help="tokens every random prompt starts with")
    g.add_argument(
        "--sharegpt-output-len", type=int, default=None, help="fixed output length for every ShareGPT prompt"
    )
    g.add_argument(
        "--mooncake-block-tokens",
        type=int,
        default=datasets.MOONCAKE_BLOCK_TOKENS,
        help="tokens per trace hash id; input lengths scale by this / 512 (prefix sharing is kept)",
    )
    g.add_argument("--mooncake-output-scale", type=float, default=1.0, help="multiply trace output lengths")
    g.add_argument(
        "--mooncake-time-scale",
        type=float,
        default=1.0,
        help="multiply trace timestamps (0.1 replays ten times faster)",
    )
    m = datasets.MixedConfig()
    for name, help_text in [
        ("chat-input-len", "chat prompt tokens"),
        ("chat-output-len", "chat output tokens"),
        ("chat-streams", "chats in flight at most, 0 for no limit (a closed loop at an infinite rate)"),
        ("long-input-len", "long prompt tokens"),
        ("long-output-len", "long prompt output tokens"),
        ("burst-size", "long prompts per burst"),
        ("num-bursts", "bursts in the run"),
        ("burst-interval", "seconds between bursts"),
        ("first-burst", "seconds to the first burst"),
    ]:
        field = name.replace("-", "_") + ("_s" if name in ("burst-interval", "first-burst") else "")
        default = getattr(m, field)
        g.add_argument(f"--mixed-{name}", type=type(default), default=default, help=f"mixed: {help_text}")


def add_arrival_arguments(p) -> None:
    """When requests arrive (`pdserve sim` takes them too)."""
    g = p.add_argument_group("arrivals")
    g.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="requests/s, Poisson (or gamma with --burstiness); default inf: all at once, "
        "except mooncake, which follows the trace's timestamps unless this is given",
    )
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier, >1 steadier")
    g.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")


def add_result_arguments(p, replot: bool) -> None:
    """Goodput, percentiles, where the result goes (`pdserve sim` takes them too, without
    --replot and the progress bar)."""
    g = p.add_argument_group("results")
    g.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs of a good request, e.g. ttft:500 tpot:50 e2el:10000",
    )
    g.add_argument("--percentile-metrics", default=",".join(metrics.METRICS), help="of ttft,tpot,itl,e2el")
    g.add_argument(
        "--metric-percentiles", default=",".join(map(str, metrics.DEFAULT_PERCENTILES)), help="e.g. 50,90,99,99.9"
    )
    g.add_argument("--save-result", action="store_true", help="write the JSON result (implied by --result-*)")
    g.add_argument("--result-dir", default=None)
    g.add_argument("--result-filename", default=None)
    g.add_argument("--plot", action="store_true", help="also write TTFT/TPOT/ITL CDF and token timeline PNGs")
    if replot:
        g.add_argument("--replot", default=None, metavar="RESULT.json", help="only redraw the plots of a saved result")
        g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def build_requests(args, tokens) -> tuple[list[datasets.Request], dict, dict]:
    """The workload, its settings (saved with the result) and the per-tag concurrency limits."""
    as_text = args.endpoint == CHAT
    name = args.dataset_name
    if name in ("sharegpt", "mooncake") and not args.dataset_path:
        raise ValueError(f"--dataset-name {name} needs --dataset-path")
    settings: dict = {"dataset_name": name, "num_prompts": args.num_prompts, "seed": args.seed}
    if name == "random":
        settings.update(
            random_input_len=args.random_input_len,
            random_output_len=args.random_output_len,
            random_range_ratio=args.random_range_ratio,
            random_prefix_len=args.random_prefix_len,
        )
        reqs = datasets.random(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            tokens,
            seed=args.seed,
            range_ratio=args.random_range_ratio,
            prefix_len=args.random_prefix_len,
            as_text=as_text,
        )
        return reqs, settings, {}
    if name == "sharegpt":
        settings.update(dataset_path=args.dataset_path, sharegpt_output_len=args.sharegpt_output_len)
        reqs = datasets.sharegpt(
            args.dataset_path,
            args.num_prompts,
            tokens,
            seed=args.seed,
            output_len=args.sharegpt_output_len,
            skip_bad=args.skip_bad_lines,
        )
        return reqs, settings, {}
    if name == "mooncake":
        sc = datasets.MooncakeScaling(args.mooncake_block_tokens, args.mooncake_output_scale, args.mooncake_time_scale)
        settings.update(
            dataset_path=args.dataset_path,
            mooncake_block_tokens=sc.block_tokens,
            mooncake_output_scale=sc.output_scale,
            mooncake_time_scale=sc.time_scale,
        )
        reqs = datasets.mooncake(
            args.dataset_path,
            args.num_prompts,
            tokens,
            seed=args.seed,
            scaling=sc,
            as_text=as_text,
            skip_bad=args.skip_bad_lines,
        )
        return reqs, settings, {}
    cfg = datasets.MixedConfig(
        num_chats=args.num_prompts,
        chat_input_len=args.mixed_chat_input_len,
        chat_output_len=args.mixed_chat_output_len,
        chat_streams=args.mixed_chat_streams or None,
        long_input_len=args.mixed_long_input_len,
        long_output_len=args.mixed_long_output_len,
        burst_size=args.mixed_burst_size,
        num_bursts=args.mixed_num_bursts,
        burst_interval_s=args.mixed_burst_interval,
        first_burst_s=args.mixed_first_burst,
    )
    settings.update({f"mixed_{k}": v for k, v in vars(cfg).items()}, random_range_ratio=args.random_range_ratio)
    reqs = datasets.mixed(cfg, tokens, seed=args.seed, range_ratio=args.random_range_ratio, as_text=as_text)
    return reqs, settings, cfg.tag_concurrency()


def _log_to_stderr() -> None:
    # our logger only: the root logger at INFO would print a line per HTTP request from httpx
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("pdserve bench: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def _tokenizer_path(args) -> str | None:
    if args.tokenizer:
        return args.tokenizer
    return args.model if args.model and os.path.exists(args.model) else None


def server_root(url: str) -> str:
    """The server's root from `--base-url`. The OpenAI client's base URL ends in /v1 and the
    endpoints here carry it, so a URL given the client's way is taken without it."""
    root = url.rstrip("/")
    if root.endswith("/v1"):
        log.info("--base-url %s: using %s (the endpoints add /v1)", url, root[: -len("/v1")])
        root = root[: -len("/v1")]
    return root


def run(args) -> int:
    _log_to_stderr()
    if args.replot:
        return _replot(args)
    from pdserve.bench.runner import RunState, run_benchmark
    from pdserve.bench.tokens import TokenSource

    args.base_url = server_root(args.base_url)
    try:
        goodput = metrics.parse_goodput(args.goodput)
        percentiles = metrics.parse_percentiles(args.metric_percentiles)
        names = metrics.parse_metric_names(args.percentile_metrics)
        if args.num_prompts < 1:
            raise ValueError("--num-prompts must be >= 1")
        tokens = TokenSource.from_path(_tokenizer_path(args), args.vocab_size)
        requests, settings, tag_limits = build_requests(args, tokens)
    except (ValueError, OSError, RuntimeError) as e:  # DatasetError: ValueError; a bad tokenizer: RuntimeError
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    if not requests:
        print(f"pdserve bench: the {args.dataset_name} dataset gave no usable requests", file=sys.stderr)
        return 2
    rate = math.inf if args.request_rate is None else args.request_rate
    log.info(
        "%d requests (%s), rate %s/s, burstiness %s, max concurrency %s",
        len(requests),
        args.dataset_name,
        "trace" if args.request_rate is None and args.dataset_name == "mooncake" else rate,
        args.burstiness,
        args.max_concurrency or "unlimited",
    )
    state = RunState([])
    try:
        result = run_benchmark(
            requests,
            args.base_url,
            model=args.model,
            endpoint=args.endpoint,
            request_rate=rate,
            burstiness=args.burstiness,
            max_concurrency=args.max_concurrency,
            # --request-rate replaces a trace's clock; the bursts of `mixed` always keep theirs
            use_trace_times=args.request_rate is None or args.dataset_name != "mooncake",
            tag_concurrency=tag_limits,
            goodput=goodput,
            percentiles=percentiles,
            percentile_metrics=names,
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            api_key=args.api_key,
            timeout_s=args.request_timeout,
            seed=args.seed,
            progress=not args.disable_tqdm,
            state=state,
        )
    except (BenchError, ValueError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 1
    result = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        **settings,
        "tokenizer_id": _tokenizer_path(args),
        "token_counts_exact": tokens.exact,
        **result,
    }
    print(report.format_summary(result, names))
    _save(args, result)
    if state.interrupted:
        return 130
    return 0 if result["completed"] else 1


def _save(args, result: dict) -> None:
    if not (args.save_result or args.result_dir or args.result_filename or args.plot):
        return
    name = args.result_filename or report.default_filename(result, args.dataset_name, result["date"])
    path = os.path.join(args.result_dir or ".", name)
    saved = bool(args.save_result or args.result_dir or args.result_filename)
    if saved:
        print(f"result: {report.save_json(result, path)}")
    if args.plot:
        plotted = _plot(result, os.path.dirname(os.path.abspath(path)), os.path.splitext(os.path.basename(path))[0])
        if plotted and not saved:
            print("(no result JSON was written: add --save-result to keep one for --replot)")


def _plot(result: dict, out_dir: str, prefix: str) -> bool:
    from pdserve.bench.plots import save_plots

    title = f"{result.get('dataset_name', '')} on {result.get('model_id', '')} ({result.get('base_url', '')})"
    try:
        for p in save_plots(result, out_dir, prefix, title):
            print(f"plot: {p}")
    except RuntimeError as e:  # matplotlib missing
        print(f"pdserve bench: {e}", file=sys.stderr)
        return False
    return True


def _replot(args) -> int:
    import json

    try:
        with open(args.replot) as f:
            result = json.load(f)
        keys = ("ttfts", "itls", "start_times", "errors", "e2els", "output_lens")
        missing = [k for k in keys if k not in result]
        if missing:
            raise ValueError(f"not a pdserve bench result (no {', '.join(missing)})")
    except (OSError, ValueError) as e:
        print(f"pdserve bench: --replot {args.replot}: {e}", file=sys.stderr)
        return 2
    prefix = os.path.splitext(os.path.basename(args.replot))[0]
    return 0 if _plot(result, args.result_dir or os.path.dirname(os.path.abspath(args.replot)), prefix) else 1
