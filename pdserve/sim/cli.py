"""`pdserve sim`: simulate a serving cluster under a workload; `--calibrate`, `--search`.

Exit status: 0 when at least one request completed (search: a configuration
met the target), 1 otherwise, 2 for bad flags or a bad workload.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time

from pdserve import flags
from pdserve.bench import cli as bench_cli
from pdserve.bench import metrics, report
from pdserve.config import CacheConfig, ConfigError, DeviceConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from pdserve.flags import Section
from pdserve.planner.deployment import modelled_dtype
from pdserve.router.admission import AdmissionConfig
from pdserve.settings import ModelledConfig, RouterConfig, SLOConfig
from pdserve.sim import workload
from pdserve.sim.cluster import MODES, Cluster
from pdserve.sim.deploy import Hardware, Layout, build
from pdserve.sim.latency import ProfileLatency
from pdserve.sim.search import search

SCENARIOS = ("seed-000-6.1",)
log = logging.getLogger("pdserve.sim")


# The engine settings the simulator models, as config.py defines them. Its defaults are
# vLLM's on a GPU, the accelerators it models; the engine's own are sized for a CPU.
SIM_SECTIONS = (
    Section(
        SchedulerConfig,
        only=("max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold", "max_num_partial_prefills"),
        defaults={"max_num_batched_tokens": 8192, "max_num_seqs": 256},
        why="each simulated instance is a GPU engine: vLLM's defaults there",
    ),
    Section(CacheConfig, only=("block_size", "num_gpu_blocks", "enable_prefix_caching")),
    Section(RouterConfig, only=("router_policy",)),
    Section(SLOConfig),
    Section(
        ModelledConfig,
        defaults={"model_config": "llama-3-70b", "gpu": "h100"},
        why="the simulator's worked example: Llama-3-70B on H100s",
    ),
    Section(EngineConfig, only=("model", "speculative_config")),
    Section(
        DeviceConfig,
        only=("dtype", "threads"),
        defaults={"threads": 1},
        why="--calibrate measures one engine thread unless told (the profile is named by it)",
    ),
)


def add_arguments(p) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument(
        "--mode",
        default="disagg",
        type=lambda m: "disagg" if m == "disaggregated" else m,  # serve's spelling
        choices=MODES,
        help="disagg (also: disaggregated, as serve spells it): prefill and decode pools; collocated: one "
        "engine per instance; chunked: collocated with chunked prefill",
    )
    g.add_argument("--num-instances", type=int, default=1, help="collocated/chunked: instances")
    g.add_argument("--tp", type=int, default=1, help="collocated/chunked: GPUs per instance")
    g.add_argument("--num-prefill", type=int, default=1)
    g.add_argument("--num-decode", type=int, default=1)
    g.add_argument("--prefill-tp", type=int, default=1)
    g.add_argument("--decode-tp", type=int, default=1)
    g.add_argument("--kv-transfer", default="layerwise", choices=["layerwise", "eager"])
    g.add_argument(
        "--network-gbps", type=float, default=400, help="KV network per GPU (100/200/400: the seeds' figures)"
    )
    g.add_argument("--kv-bytes-per-s", type=float, default=None, help="KV link bandwidth, overrides --network-gbps")
    g.add_argument("--kv-transfer-latency-ms", type=float, default=0.0, help="fixed cost of each KV transfer")
    g.add_argument(
        "--spec-acceptance-rate",
        type=float,
        default=0.7,
        help="with --speculative-config: the chance that each drafted token is accepted (independently, "
        "until one is not); the engine's spec_decode counters measure it (accepted / draft tokens)",
    )
    g.add_argument(
        "--client-rtt-ms",
        type=float,
        default=None,
        help="client <-> engine round trip per request (default: a served profile's own, else 0)",
    )
    flags.add_arguments(p, SIM_SECTIONS)

    g = p.add_argument_group("latency model")
    g.add_argument("--compute-efficiency", type=float, default=None, help="share of peak FLOP/s reached")
    g.add_argument("--bandwidth-efficiency", type=float, default=None, help="share of peak memory bandwidth reached")
    g.add_argument("--step-overhead-ms", type=float, default=0.0, help="fixed cost per iteration (roofline)")
    g.add_argument("--profile", default=None, metavar="FILE", help="fitted step times from `--calibrate` instead")
    g.add_argument(
        "--decode-profile",
        default=None,
        metavar="FILE",
        help="disagg: the decode pool's own profile (default: --profile for both pools)",
    )
    g.add_argument(
        "--calibrate",
        action="store_true",
        help="measure our engine here (--model, --threads), write --profile FILE, exit",
    )
    g.add_argument(
        "--served",
        action="store_true",
        help="--calibrate through `pdserve serve` (steps timed inside the server, serving costs included)",
    )
    g.add_argument(
        "--from-trace",
        nargs="+",
        default=None,
        metavar="FILE",
        help="--calibrate from step traces of served runs (`pdserve serve/worker --step-trace`)",
    )
    g.add_argument(
        "--beside",
        nargs="+",
        default=None,
        metavar="FILE",
        help="--from-trace: step traces of the engines that serve alongside (a prefill worker's "
        "decode workers); only steps taken while they were busy are fitted",
    )

    # the workload and result flags of `pdserve bench`, the very same definitions
    bench_cli.add_workload_arguments(p)
    bench_cli.add_arrival_arguments(p)
    bench_cli.add_result_arguments(p, replot=False)
    g = p.add_argument_group("simulator workload and output")
    g.add_argument("--workload-json", default=None, help="replay the requests of a measured run (see docs/sim.md)")
    g.add_argument("--scenario", default=None, choices=SCENARIOS, help="a worked example's traffic")
    g.add_argument("--json", action="store_true", help="print the result JSON instead of the report")

    g = p.add_argument_group("search (DistServe-style: cheapest layout meeting a goodput target)")
    g.add_argument("--search", action="store_true")
    g.add_argument("--search-modes", default="disagg,collocated", help="modes to try")
    g.add_argument("--search-tp", default="1,2,4,8", help="TP sizes to try per pool")
    g.add_argument("--search-max-gpus", type=int, default=32)
    g.add_argument("--search-target-pct", type=float, default=90.0, help="SLO attainment to reach (needs --goodput)")
    bench_cli.show_defaults(p)  # as `pdserve bench --help` does, for the flags the two share too


def _model_config(args) -> str:
    """The modelled model; `--model NAME` meant it before `--model` meant the weights."""
    if args.model and args.model_config == "llama-3-70b" and not args.calibrate:
        log.warning(
            "pdserve sim: --model for the simulated model is deprecated: use --model-config %s "
            "(--model is the weights --calibrate measures)",
            args.model,
        )
        return args.model
    return args.model_config


def _requests(args) -> tuple[list[workload.SimRequest], dict[str, int]]:
    if args.scenario == "seed-000-6.1":
        return workload.seed_000_6_1(), {}
    if args.workload_json:
        reqs, doc = workload.from_workload_json(args.workload_json)
        streams = (doc.get("params") or {}).get("chat_streams")  # interference.py: a closed loop of chats
        return reqs, dict(doc.get("tag_concurrency") or ({"chat": streams} if streams else {}))
    if args.dataset_name == "mooncake":
        if not args.dataset_path:
            raise ValueError("--dataset-name mooncake needs --dataset-path")
        return workload.mooncake_trace(
            args.dataset_path,
            args.num_prompts,
            block_tokens=args.mooncake_block_tokens,
            output_scale=args.mooncake_output_scale,
            time_scale=args.mooncake_time_scale,
            skip_bad=args.skip_bad_lines,
        ), {}
    from pdserve.bench.tokens import TokenSource

    args.endpoint = "/v1/completions"
    built, _, tag_limits = bench_cli.build_requests(args, TokenSource(None))
    return workload.from_bench(built), tag_limits


def _hardware(args) -> Hardware:
    eff = None
    if args.compute_efficiency or args.bandwidth_efficiency:
        eff = (args.compute_efficiency or 0.55, args.bandwidth_efficiency or 0.8)
    prof = ProfileLatency.load(args.profile) if args.profile else None
    dprof = ProfileLatency.load(args.decode_profile) if args.decode_profile else None
    if dprof is not None and prof is None:
        raise ValueError("--decode-profile needs --profile (the prefill pool's)")
    return Hardware(
        args.model_config,  # run() resolved the deprecated --model spelling (and warned) once
        args.gpu,
        modelled_dtype(args.dtype),
        args.kv_dtype,
        eff,
        args.step_overhead_ms / 1000,
        prof,
        args.num_gpu_blocks,
        dprof,
    )


def _layout(args) -> Layout:
    return Layout(
        args.mode, args.num_instances, args.tp, args.num_prefill, args.num_decode, args.prefill_tp, args.decode_tp
    )


def cluster_config(args, layout: Layout, tag_limits: dict[str, int]):
    sched = SchedulerConfig(
        args.max_num_batched_tokens,
        args.max_num_seqs,
        True,
        args.long_prefill_token_threshold,
        args.max_num_partial_prefills,
    )
    adm = AdmissionConfig(_s(args.slo_ttft_ms), _s(args.slo_tpot_ms), args.kv_watermark, args.long_request_tokens)
    hw = _hardware(args)
    rtt_s = (
        args.client_rtt_ms / 1000
        if args.client_rtt_ms is not None
        else hw.profile.request_rtt_s
        if hw.profile is not None
        else 0.0
    )
    cfg = build(
        layout,
        hw,
        sched,
        block_size=args.block_size,
        client_rtt_s=rtt_s,
        enable_prefix_caching=args.enable_prefix_caching,
        network_gbps=args.network_gbps,
        kv_bytes_per_s=args.kv_bytes_per_s,
        layerwise=args.kv_transfer == "layerwise",
        transfer_latency_s=args.kv_transfer_latency_ms / 1000,
        policy=args.router_policy,
        admission=adm,
        max_concurrency=args.max_concurrency,
        tag_concurrency=tag_limits,
    )
    if getattr(args, "speculative_config", None):  # (replace checks the acceptance rate again)
        spec = SpeculativeConfig.parse(args.speculative_config)
        cfg = dataclasses.replace(cfg, speculative=spec, spec_acceptance=args.spec_acceptance_rate)
    return cfg


def _s(ms):
    return None if ms is None else ms / 1000


def simulate(args, layout: Layout, requests, tag_limits, goodput, percentiles, names) -> dict:
    cluster = Cluster(cluster_config(args, layout, tag_limits))
    rate = math.inf if args.request_rate is None else args.request_rate
    use_trace = args.request_rate is None or args.dataset_name != "mooncake"
    return cluster.run(
        requests,
        rate,
        args.burstiness,
        seed=args.seed,
        use_trace_times=use_trace,
        goodput=goodput,
        percentiles=percentiles,
        percentile_metrics=names,
    )


def run(args) -> int:
    if args.calibrate:
        return _calibrate(args)
    args.model_config = _model_config(args)
    try:
        goodput = metrics.parse_goodput(args.goodput)
        percentiles = metrics.parse_percentiles(args.metric_percentiles)
        names = metrics.parse_metric_names(args.percentile_metrics)
        requests, tag_limits = _requests(args)
        if not requests:
            raise ValueError("the workload has no requests")
        if args.search:
            run_layout = lambda lay: simulate(args, lay, requests, tag_limits, goodput, percentiles, names)
            return search(args, run_layout, goodput)
        result = simulate(args, _layout(args), requests, tag_limits, goodput, percentiles, names)
    except (ValueError, OSError, ConfigError) as e:
        print(f"pdserve sim: {e}", file=sys.stderr)
        return 2
    result = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": "pdserve-sim",
        "model_id": args.model_config,
        "dataset_name": args.scenario or ("workload-json" if args.workload_json else args.dataset_name),
        "request_rate": "inf" if args.request_rate is None else args.request_rate,
        "max_concurrency": args.max_concurrency,
        **result,
    }
    sim = result["sim"]
    if args.json:
        print(json.dumps(report._finite(result)))
    else:
        print(report.format_summary(result, names))
        print(
            f"simulated {len(requests)} requests ({sim['simulated_s']:.1f} s of cluster time) in "
            f"{sim['wall_s']:.2f} s: {sim['requests_per_wall_s']:.0f} requests simulated per second"
        )
    _save(args, result)
    return 0 if result["completed"] else 1


def _save(args, result: dict) -> None:
    if not (args.save_result or args.result_dir or args.result_filename or args.plot):
        return
    name = args.result_filename or f"pdserve-sim-{result['dataset_name']}-{args.mode}-{result['date']}.json"
    path = os.path.join(args.result_dir or ".", name)
    print(f"result: {report.save_json(result, path)}", file=sys.stderr if args.json else sys.stdout)
    if args.plot:
        bench_cli._plot(result, os.path.dirname(os.path.abspath(path)), os.path.splitext(os.path.basename(path))[0])


def _calibrate(args) -> int:
    from pdserve.sim.calibrate import calibrate, fit_trace, serve_and_calibrate

    path = args.profile or f"sim-profile-threads{args.threads}.json"
    model = args.model
    log = lambda m: print(m, file=sys.stderr)
    try:
        if args.from_trace:
            prof = fit_trace(args.from_trace, threads=args.threads, model=model, beside=args.beside, log=log)
        elif args.served:
            prof = serve_and_calibrate(args.threads, model, log=log)
        else:
            prof = calibrate(args.threads, model, log=log)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"pdserve sim --calibrate: {e}", file=sys.stderr)
        return 2
    prof.save(path)
    print(f"profile: {path}")
    return 0
