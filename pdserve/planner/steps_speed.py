"""The plan's speed and sizing steps: prefill and decode time (fitted, with the
roofline beside it), KV transfer, latency against the SLOs, the P:D ratio, the
GPU count and speculative decoding."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.planner import memory as mem
from pdserve.planner import perf
from pdserve.planner import roofline as rl
from pdserve.planner.capacity import (
    expected_accepted_tokens,
    gpu_count,
    max_batch_within,
    pd_ratio,
    request_latency_s,
    spec_speedup,
)
from pdserve.planner.deployment import Deployment
from pdserve.planner.models import param_count
from pdserve.planner.steps import Step, equation
from pdserve.planner.transfer import DEFAULT_LINKS, kv_transfer
from pdserve.planner.units import (
    KiB,
    ceil_count,
    fmt_bytes,
    fmt_count,
    fmt_gb,
    fmt_s,
    fmt_si,
)

if TYPE_CHECKING:  # plan.py imports this module
    from pdserve.planner.plan import PlanInputs


def _time_lines(dep: Deployment, st: rl.StepTime, cost: perf.StepCost | None, name: str) -> list[str]:
    ridge = rl.ridge_point(dep.peak_flops, dep.memory_bytes_per_s)
    ai = rl.arithmetic_intensity(st.flops / dep.tp, st.bytes)
    lines = [
        f"AI = FLOPs/TP / bytes = {ai:,.1f} FLOP/B; ridge = peak / bandwidth = "
        f"{fmt_si(dep.peak_flops, 'FLOP/s')} / {fmt_si(dep.memory_bytes_per_s, 'B/s')} "
        f"= {ridge:,.0f} FLOP/B -> {st.bound}-bound"
    ]
    label = "roofline (lower bound)" if cost is not None else name
    lines += equation(
        label,
        "max(FLOPs / (TP x peak), bytes / bandwidth) + TP all-reduce + PP hops",
        f"max({fmt_s(st.compute_s)}, {fmt_s(st.memory_s)}) + {fmt_s(st.comm_s)} + {fmt_s(st.pp_s)}",
        fmt_s(st.total_s),
    )
    if dep.tp > 1:
        n = 2 * dep.model.layers
        lines.append(
            f"roofline TP all-reduce: 2 x {dep.model.layers} layers = {n} per iteration"
            f" x {fmt_s(st.comm_s / n)} = {fmt_s(st.comm_s)} "
            f"({st.comm_s / st.total_s:.0%} of it)"
        )
    if cost is not None:
        kind, _ = perf.fit_for(dep.gpu.name)
        kind += "" if perf.is_profiled(dep.gpu.name) else ", borrowed"
        gpu = f"{fmt_s(cost.gemm_s)} + {fmt_s(cost.attention_s)} + {fmt_s(cost.elementwise_s)} + {fmt_s(cost.comm_s)}"
        if cost.launch_s:  # an eager engine: its kernel issue overlaps the GPU
            formula = "per-step CPU + max(GEMMs + attention + element-wise + all-reduces, kernel issue) + PP"
            values = f"{fmt_s(cost.overhead_s)} + max({gpu}, {fmt_s(cost.launch_s)}) + {fmt_s(cost.pp_s)}"
        else:
            formula = "GEMMs + attention + element-wise + all-reduces + per-step CPU + PP"
            values = f"{gpu} + {fmt_s(cost.overhead_s)} + {fmt_s(cost.pp_s)}"
        lines += equation(f"{name} (fitted, {kind} profiles)", formula, values, fmt_s(cost.total_s))
        lines.append(f"fitted / roofline = {cost.total_s / st.total_s:.2f}")
    return lines


def _theta(dep: Deployment, tokens: int, time_s: float, micro_batches: int) -> float:
    """Tokens/s of one accelerator. PP stages work on different micro-batches
    at once, busy (1 - bubble) of the time; with one micro-batch PP gains nothing."""
    busy = 1.0 - rl.pp_bubble_ratio(dep.pp, micro_batches)
    return tokens / time_s * dep.pp * busy / dep.gpus


def _throughput_lines(
    dep: Deployment, name: str, tokens: int, time_s: float, micro_batches: int, measured: float | None
) -> tuple[list[str], float, float]:
    bubble = rl.pp_bubble_ratio(dep.pp, micro_batches)
    theta = _theta(dep, tokens, time_s, micro_batches)
    lines = []
    if dep.pp > 1:
        lines += equation(
            "PP bubble", "(P - 1) / (P + B - 1)", f"({dep.pp} - 1) / ({dep.pp} + {micro_batches} - 1)", f"{bubble:.1%}"
        )
    lines += equation(
        name,
        "tokens x PP x (1 - bubble) / (time x TP x PP)",
        f"{tokens:,} x {dep.pp} x {1 - bubble:.3g} / ({fmt_s(time_s)} x {dep.gpus})",
        f"{theta:,.0f} tokens/s per GPU",
    )
    if measured is not None:
        lines.append(
            f"{name} = {measured:,.0f} tokens/s per GPU as measured (given), used below instead of {theta:,.0f}"
        )
        theta = measured
    return lines, theta, bubble


def _step_values(st: rl.StepTime, cost: perf.StepCost | None) -> dict:
    time_s = st.total_s if cost is None else cost.total_s
    out = {
        "flops": st.flops,
        "bytes_per_gpu": st.bytes,
        "compute_s": st.compute_s,
        "memory_s": st.memory_s,
        "tp_comm_s": st.comm_s,
        "pp_hop_s": st.pp_s,
        "roofline_time_s": st.total_s,
        "time_s": time_s,
        "bound": st.bound,
        "latency_model": "roofline" if cost is None else "fitted",
    }
    if cost is not None:
        out["fitted"] = cost.to_dict()
    return out


def _fitted(dep: Deployment) -> bool:
    return dep.latency_model == "fitted" and perf.has_fit(dep.gpu.name)


def prefill_seconds(dep: Deployment, tokens: int) -> float:
    """The plan's prefill time for one prompt: fitted, or the roofline if asked or unfitted."""
    return perf.prefill_cost(dep, tokens).total_s if _fitted(dep) else rl.prefill_time(dep, tokens).total_s


def decode_seconds(dep: Deployment, batch: int, context: int) -> float:
    if _fitted(dep):
        return perf.decode_cost(dep, batch, context).total_s
    return rl.decode_step_time(dep, batch, context).total_s


def prefill_step(inp: PlanInputs, micro_batches: int) -> Step:
    dep, S = inp.prefill, inp.prompt_tokens
    m = dep.model
    st = rl.prefill_time(dep, S)
    cost = perf.prefill_cost(dep, S) if _fitted(dep) else None
    time_s = st.total_s if cost is None else cost.total_s
    active = fmt_count(param_count(m, active=True))
    lines = [f"one prompt of S = {S:,} tokens on {dep.tp} x {dep.pp} {dep.gpu.name}"]
    lines += equation(
        "FLOPs",
        "2 x N_active x S + L x heads x (d_qk + d_v) x S^2",
        f"2 x {active} x {S:,} + {m.layers} x {m.heads} x ({m.qk_dim} + {m.v_dim}) x {S:,}^2",
        f"{st.flops:.4g} FLOP",
    )
    weights = rl.weight_bytes_read(m, S, dep.weight_bytes_per_param) / dep.tp
    kv_tok = mem.kv_bytes_per_token(m, dep.kv_bytes_per_element) / KiB
    lines += equation(
        "bytes/GPU",
        "weights read/TP + S x KV/token / shards",
        f"{fmt_gb(weights)} + {S:,} x {kv_tok:,.2f} KiB / {mem.kv_shards(m, dep.tp)}",
        fmt_bytes(st.bytes),
    )
    lines += _time_lines(dep, st, cost, "prefill time")
    more, theta, bubble = _throughput_lines(dep, "Theta_P", S, time_s, micro_batches, inp.theta_p)
    values = {
        **_step_values(st, cost),
        "tokens": S,
        "pp_bubble": bubble,
        "theta_p_tokens_per_s_per_gpu": theta,
        "per_layer_s": time_s / m.layers,
    }
    return Step(
        "prefill",
        "Prefill time (TTFT compute)",
        "prefill FLOPs 2 x N x S; roofline and fitted step time",
        lines + more,
        values,
    )


def decode_batch(inp: PlanInputs, max_concurrency: int, notes: list[str]) -> int:
    """The decode batch: as given, else memory's limit lowered to meet the TPOT SLO."""
    dep, C = inp.decode, inp.decode_context_tokens
    if inp.decode_batch is not None:
        if max_concurrency >= 1 and inp.decode_batch > max_concurrency:
            notes.append(
                f"decode batch {inp.decode_batch} exceeds the {max_concurrency} "
                "requests whose KV fits a decode instance"
            )
        return inp.decode_batch
    batch = max(1, max_concurrency)
    if inp.slo_tpot_s is None:
        return batch
    b = max_batch_within(lambda n: decode_seconds(dep, n, C), inp.slo_tpot_s, batch)
    if b == 0:
        notes.append("TPOT SLO unreachable even at batch 1 on this decode instance")
        return 1
    return b


def decode_step(inp: PlanInputs, batch: int, max_concurrency: int) -> Step:
    dep, C = inp.decode, inp.decode_context_tokens
    m = dep.model
    st = rl.decode_step_time(dep, batch, C)
    cost = perf.decode_cost(dep, batch, C) if _fitted(dep) else None
    time_s = st.total_s if cost is None else cost.total_s
    if inp.decode_batch is not None:
        why = "as given"
    elif max_concurrency < 1:
        why = "nothing fits; batch 1 assumed"
    elif batch >= max_concurrency:
        why = "max concurrency"
    else:
        why = "largest batch meeting the TPOT SLO"
    weights = rl.weight_bytes_read(m, batch, dep.weight_bytes_per_param) / dep.tp
    kv_tok = mem.kv_bytes_per_token(m, dep.kv_bytes_per_element) / KiB
    lines = [f"batch B = {batch} ({why}), mean context C = {C:,} tokens, on {dep.gpu.name}"]
    lines += equation(
        "bytes/GPU",
        "weights read/TP + B x C x KV/token / shards",
        f"{fmt_gb(weights)} + {batch} x {C:,} x {kv_tok:,.2f} KiB / {mem.kv_shards(m, dep.tp)}",
        fmt_bytes(st.bytes),
    )
    lines += equation(
        "FLOPs",
        "2 x N_active x B + 2 x L x heads x (d_qk + d_v) x C x B",
        f"2 x {fmt_count(param_count(m, active=True))} x {batch} + 2 x {m.layers} x "
        f"{m.heads} x ({m.qk_dim} + {m.v_dim}) x {C:,} x {batch}",
        f"{st.flops:.4g} FLOP",
    )
    lines += _time_lines(dep, st, cost, "TPOT")
    more, theta, bubble = _throughput_lines(dep, "Theta_D", batch, time_s, batch, inp.theta_d)
    values = {
        **_step_values(st, cost),
        "batch": batch,
        "context_tokens": C,
        "pp_bubble": bubble,
        "tpot_s": time_s,
        "theta_d_tokens_per_s_per_gpu": theta,
    }
    return Step(
        "decode",
        "Decode step (TPOT)",
        "decode reads all weights and KV each step; roofline and fitted step time",
        lines + more,
        values,
    )


def transfer_step(inp: PlanInputs, prefill: dict) -> Step:
    m, S = inp.prefill.model, inp.prompt_tokens
    per_token = mem.kv_bytes_per_token(m, inp.prefill.kv_bytes_per_element)
    kv = per_token * S
    lines = equation("KV of one prompt", "S x KV/token", f"{S:,} x {per_token / KiB:,.2f} KiB", fmt_bytes(kv))
    lines.append(
        f"per-layer compute = prefill time / L = {fmt_s(prefill['time_s'])} / {m.layers}"
        f" = {fmt_s(prefill['per_layer_s'])}; {inp.nics} NIC(s) per request"
    )
    if inp.binary_units:
        lines.append("units: binary, a link's GB/s read as GiB/s (as KV sizes in GiB are)")
    lines.append(
        f"{'link':>10} {'B_net':>10} {'T = bytes/B_net':>16} {'per layer':>10}"
        f" {'eager':>10} {'layer-wise':>11}  exposed"
    )
    nets = {}
    for net in inp.links or DEFAULT_LINKS:
        t = kv_transfer(kv, m.layers, prefill["time_s"], net, inp.nics)
        nets[t.network] = t.to_dict()
        name = t.network if t.network.endswith("/s") else f"{t.network} Gb/s"
        lines.append(
            f"{name:>10} {fmt_si(t.bytes_per_s, 'B/s'):>10} {fmt_s(t.total_s):>16} "
            f"{fmt_s(t.per_layer_s):>10} {fmt_s(t.eager_exposed_s):>10} "
            f"{fmt_s(t.layerwise_exposed_s):>11}  "
            f"{'last layer only' if t.hidden else 'link lags compute'}"
        )
    lines.append("layer-wise leaves only the last layer exposed when per-layer transfer < per-layer compute")
    return Step(
        "transfer",
        "KV transfer P -> D, eager vs layer-wise",
        "T = KV bytes / link bandwidth; layer-wise overlap",
        lines,
        {"kv_bytes": kv, "binary_units": inp.binary_units, "networks": nets},
    )


def latency_step(inp: PlanInputs, prefill: dict, decode: dict, transfer: dict, notes: list[str]) -> Step:
    net = max(transfer["networks"].values(), key=lambda t: t["bytes_per_s"])
    exposed = net["layerwise_exposed_s"]
    ttft, tpot = prefill["time_s"] + exposed, decode["tpot_s"]
    lines = equation(
        "TTFT",
        f"prefill + layer-wise exposed transfer ({net['network']})",
        f"{fmt_s(prefill['time_s'])} + {fmt_s(exposed)}",
        fmt_s(ttft),
    )
    lines.append(f"TPOT = {fmt_s(tpot)} at batch {decode['batch']}")
    values = {"network": net["network"], "ttft_s": ttft, "tpot_s": tpot}
    for name, got, slo in (("TTFT", ttft, inp.slo_ttft_s), ("TPOT", tpot, inp.slo_tpot_s)):
        if slo is not None:
            met = got <= slo
            values[f"slo_{name.lower()}_met"] = met
            lines.append(f"{name} SLO {fmt_s(slo)}: {'met' if met else 'MISSED'}")
            if not met:
                notes.append(f"{name} {fmt_s(got)} misses the {fmt_s(slo)} SLO")
    if inp.lout is not None:
        e2e = request_latency_s(ttft, inp.lout, tpot)
        lines += equation(
            "latency", "TTFT + (Lout - 1) x TPOT", f"{fmt_s(ttft)} + {inp.lout - 1:,} x {fmt_s(tpot)}", fmt_s(e2e)
        )
        values["latency_s"] = e2e
    lines.append("unloaded floor: queueing is not modeled (the simulator does that)")
    return Step("latency", "Latency against the SLOs", "latency = TTFT + (Lout - 1) x TPOT", lines, values)


def pd_ratio_step(inp: PlanInputs, prefill: dict, decode: dict) -> Step:
    tp_, td = prefill["theta_p_tokens_per_s_per_gpu"], decode["theta_d_tokens_per_s_per_gpu"]
    r = pd_ratio(inp.lin, inp.lout, tp_, td)
    lines = equation(
        "N_D / N_P",
        "(Lout / Lin) x (Theta_P / Theta_D)",
        f"({inp.lout:,} / {inp.lin:,}) x ({tp_:,.0f} / {td:,.0f})",
        f"{r:.3g}",
    )
    lines.append(f"{r:.3g} decode GPUs per prefill GPU" if r >= 1 else f"{1 / r:.3g} prefill GPUs per decode GPU")
    return Step(
        "pd_ratio",
        "P:D ratio",
        "pools balanced: N_P x Theta_P / Lin = N_D x Theta_D / Lout",
        lines,
        {
            "ratio_d_per_p": r,
            "theta_p": tp_,
            "theta_d": td,
            "measured": inp.theta_p is not None or inp.theta_d is not None,
        },
    )


def _concurrency_count(inp: PlanInputs) -> tuple[list[str], dict]:
    """GPUs = ceil(peak QPS x occupancy / concurrency per GPU) x (1 + r)."""
    c = gpu_count(inp.qps * inp.occupancy_s, inp.concurrency_per_gpu, inp.redundancy)
    r = inp.redundancy
    lines = equation(
        "GPUs by concurrency",
        "ceil(QPS x occupancy / concurrency per GPU) x (1 + r)",
        f"ceil({inp.qps:g} x {inp.occupancy_s:g} s / {inp.concurrency_per_gpu:g}) "
        f"x {1 + r:g} = ceil({c.raw:.3g}) x {1 + r:g} = {c.base} x {1 + r:g}",
        f"{c.total} GPUs",
    )
    return lines, c.to_dict()


def gpu_count_step(inp: PlanInputs, prefill: dict, decode: dict, fit: dict) -> Step:
    basis = "GPUs = ceil(load / capacity per GPU) x (1 + redundancy)"
    r, lines, values = inp.redundancy, [], {}
    if inp.occupancy_s is not None:
        lines, values["by_concurrency"] = _concurrency_count(inp)
    if not fit["fits"]:
        lines.append("token pools not computed: one request does not fit a decode instance")
        return Step("gpu_count", "GPU count", basis, lines, {**values, "computed": False})
    if inp.lin is None:
        return Step("gpu_count", "GPU count with redundancy", basis, lines, {**values, "computed": True})
    values["computed"] = True
    for pool, tokens, theta, gpus in (
        ("prefill", inp.lin, prefill["theta_p_tokens_per_s_per_gpu"], inp.prefill.gpus),
        ("decode", inp.lout, decode["theta_d_tokens_per_s_per_gpu"], inp.decode.gpus),
    ):
        c = gpu_count(inp.qps * tokens, theta, r)
        lines += equation(
            f"{pool} GPUs",
            "ceil(QPS x tokens / Theta per GPU) x (1 + r)",
            f"ceil({inp.qps:g} x {tokens:,} / {theta:,.0f}) x {1 + r:g} = "
            f"ceil({c.raw:.3g}) x {1 + r:g} = {c.base} x {1 + r:g}",
            f"{c.total} GPUs",
        )
        instances = ceil_count(c.total / gpus)
        lines.append(f"  in whole instances of {gpus} GPU(s): {instances} = {instances * gpus} GPUs")
        values[pool] = {**c.to_dict(), "instances": instances, "gpus": instances * gpus}
    values["total_gpus"] = values["prefill"]["gpus"] + values["decode"]["gpus"]
    lines.append(f"total: {values['total_gpus']} GPUs (redundancy {r:.0%})")
    return Step("gpu_count", "GPU count with redundancy", basis, lines, values)


def spec_step(inp: PlanInputs, decode: dict) -> Step:
    """Speculative decoding: gamma drafts, each accepted with probability alpha."""
    k, a, c = inp.spec_k, inp.spec_acceptance, inp.spec_draft_cost
    tokens = expected_accepted_tokens(a, k)
    speedup = spec_speedup(a, k, c)
    lines = equation(
        "E[tokens/step]", "(1 - alpha^(gamma + 1)) / (1 - alpha)", f"(1 - {a:g}^{k + 1}) / (1 - {a:g})", f"{tokens:.4g}"
    )
    lines += equation(
        "speed-up",
        "E[tokens] / (gamma x draft cost + 1 verify step)",
        f"{tokens:.4g} / ({k} x {c:g} + 1)",
        f"{speedup:.4g}x",
    )
    tpot = decode["tpot_s"] / speedup
    lines.append(
        f"TPOT {fmt_s(decode['tpot_s'])} -> {fmt_s(tpot)} per output token (the verify step taken as one decode step)"
    )
    return Step(
        "spec",
        "Speculative decoding",
        "accepted tokens (1 - a^(g+1)) / (1 - a)",
        lines,
        {"expected_tokens_per_step": tokens, "speedup": speedup, "tpot_s": tpot},
    )
