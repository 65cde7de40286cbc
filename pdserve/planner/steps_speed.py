"""The plan's speed and sizing steps: roofline prefill and decode, KV transfer,
latency against the SLOs, the P:D ratio and the GPU count."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.planner import memory as mem
from pdserve.planner import roofline as rl
from pdserve.planner.capacity import gpu_count, max_batch_within, pd_ratio, request_latency_s
from pdserve.planner.deployment import Deployment
from pdserve.planner.models import param_count
from pdserve.planner.steps import Step, equation
from pdserve.planner.transfer import kv_transfer
from pdserve.planner.units import KiB, ceil_count, fmt_bytes, fmt_count, fmt_gb, fmt_s, fmt_si

if TYPE_CHECKING:  # plan.py imports this module
    from pdserve.planner.plan import PlanInputs


def _time_lines(dep: Deployment, st: rl.StepTime, name: str) -> list[str]:
    ridge = rl.ridge_point(dep.peak_flops, dep.memory_bytes_per_s)
    ai = rl.arithmetic_intensity(st.flops / dep.tp, st.bytes)
    lines = [f"AI = FLOPs/TP / bytes = {ai:,.1f} FLOP/B; ridge = peak / bandwidth = "
             f"{fmt_si(dep.peak_flops, 'FLOP/s')} / {fmt_si(dep.memory_bytes_per_s, 'B/s')} "
             f"= {ridge:,.0f} FLOP/B -> {st.bound}-bound"]
    lines += equation(name, "max(FLOPs / (TP x peak), bytes / bandwidth) + TP all-reduce + PP hops",
                      f"max({fmt_s(st.compute_s)}, {fmt_s(st.memory_s)}) + {fmt_s(st.comm_s)}"
                      f" + {fmt_s(st.pp_s)}", fmt_s(st.total_s))
    if dep.tp > 1:
        n = 2 * dep.model.layers
        lines.append(f"TP all-reduce: 2 x {dep.model.layers} layers = {n} per iteration x "
                     f"{fmt_s(st.comm_s / n)} = {fmt_s(st.comm_s)} "
                     f"({st.comm_s / st.total_s:.0%} of it)  [seed 000 §1.1]")
    return lines


def _throughput_lines(dep: Deployment, name: str, tokens: int, st: rl.StepTime,
                      micro_batches: int) -> tuple[list[str], float, float]:
    bubble = rl.pp_bubble_ratio(dep.pp, micro_batches)
    theta = rl.tokens_per_s_per_gpu(dep, tokens, st, micro_batches)
    lines = []
    if dep.pp > 1:
        lines += equation("PP bubble", "(P - 1) / (P + B - 1)",
                          f"({dep.pp} - 1) / ({dep.pp} + {micro_batches} - 1)", f"{bubble:.1%}")
    lines += equation(name, "tokens x PP x (1 - bubble) / (time x TP x PP)",
                      f"{tokens:,} x {dep.pp} x {1 - bubble:.3g} / "
                      f"({fmt_s(st.total_s)} x {dep.gpus})",
                      f"{theta:,.0f} tokens/s per GPU")
    return lines, theta, bubble


def _step_values(st: rl.StepTime) -> dict:
    return {"flops": st.flops, "bytes_per_gpu": st.bytes, "compute_s": st.compute_s,
            "memory_s": st.memory_s, "tp_comm_s": st.comm_s, "pp_hop_s": st.pp_s,
            "time_s": st.total_s, "bound": st.bound}


def prefill_step(inp: PlanInputs, micro_batches: int) -> Step:
    dep, S = inp.prefill, inp.prompt_tokens
    m = dep.model
    st = rl.prefill_time(dep, S)
    active = fmt_count(param_count(m, active=True))
    lines = [f"one prompt of S = {S:,} tokens on {dep.tp} x {dep.pp} {dep.gpu.name}"]
    lines += equation("FLOPs", "2 x N_active x S + L x heads x (d_qk + d_v) x S^2",
                      f"2 x {active} x {S:,} + {m.layers} x {m.heads}"
                      f" x ({m.qk_dim} + {m.v_dim}) x {S:,}^2", f"{st.flops:.4g} FLOP")
    weights = rl.weight_bytes_read(m, S, dep.weight_bytes_per_param) / dep.tp
    kv_tok = mem.kv_bytes_per_token(m, dep.kv_bytes_per_element) / KiB
    lines += equation("bytes/GPU", "weights read/TP + S x KV/token / shards",
                      f"{fmt_gb(weights)} + {S:,} x {kv_tok:,.2f} KiB / {mem.kv_shards(m, dep.tp)}",
                      fmt_bytes(st.bytes))
    lines += _time_lines(dep, st, "prefill time")
    more, theta, bubble = _throughput_lines(dep, "Theta_P", S, st, micro_batches)
    values = {**_step_values(st), "tokens": S, "pp_bubble": bubble,
              "theta_p_tokens_per_s_per_gpu": theta, "per_layer_s": st.total_s / m.layers}
    return Step("prefill", "Roofline prefill (TTFT compute)",
                "seed 000 §2.1, seed 003 §1.1, §2.1", lines + more, values)


def decode_batch(inp: PlanInputs, max_concurrency: int, notes: list[str]) -> int:
    """The decode batch: memory's limit, lowered to meet the TPOT SLO."""
    dep, C = inp.decode, inp.decode_context_tokens
    batch = max(1, max_concurrency)
    if inp.slo_tpot_s is None:
        return batch
    b = max_batch_within(lambda n: rl.decode_step_time(dep, n, C).total_s, inp.slo_tpot_s, batch)
    if b == 0:
        notes.append("TPOT SLO unreachable even at batch 1 on this decode instance")
        return 1
    return b


def decode_step(inp: PlanInputs, batch: int, max_concurrency: int) -> Step:
    dep, C = inp.decode, inp.decode_context_tokens
    m = dep.model
    st = rl.decode_step_time(dep, batch, C)
    if max_concurrency < 1:
        why = "nothing fits; batch 1 assumed"
    elif batch >= max_concurrency:
        why = "max concurrency"
    else:
        why = "largest batch meeting the TPOT SLO"
    weights = rl.weight_bytes_read(m, batch, dep.weight_bytes_per_param) / dep.tp
    kv_tok = mem.kv_bytes_per_token(m, dep.kv_bytes_per_element) / KiB
    lines = [f"batch B = {batch} ({why}), mean context C = {C:,} tokens, on {dep.gpu.name}"]
    lines += equation("bytes/GPU", "weights read/TP + B x C x KV/token / shards",
                      f"{fmt_gb(weights)} + {batch} x {C:,} x {kv_tok:,.2f} KiB / "
                      f"{mem.kv_shards(m, dep.tp)}", fmt_bytes(st.bytes))
    lines += equation("FLOPs", "2 x N_active x B + 2 x L x heads x (d_qk + d_v) x C x B",
                      f"2 x {fmt_count(param_count(m, active=True))} x {batch} + 2 x {m.layers} x "
                      f"{m.heads} x ({m.qk_dim} + {m.v_dim}) x {C:,} x {batch}",
                      f"{st.flops:.4g} FLOP")
    lines += _time_lines(dep, st, "TPOT")
    more, theta, bubble = _throughput_lines(dep, "Theta_D", batch, st, batch)
    values = {**_step_values(st), "batch": batch, "context_tokens": C, "pp_bubble": bubble,
              "tpot_s": st.total_s, "theta_d_tokens_per_s_per_gpu": theta}
    return Step("decode", "Roofline decode step (TPOT)", "seed 003 §2.2-2.3, seed 000 §1.1-1.2",
                lines + more, values)


def transfer_step(inp: PlanInputs, prefill: dict) -> Step:
    m, S = inp.prefill.model, inp.prompt_tokens
    per_token = mem.kv_bytes_per_token(m, inp.prefill.kv_bytes_per_element)
    kv = per_token * S
    lines = equation("KV of one prompt", "S x KV/token", f"{S:,} x {per_token / KiB:,.2f} KiB",
                     fmt_bytes(kv))
    lines.append(f"per-layer compute = prefill time / L = {fmt_s(prefill['time_s'])} / {m.layers}"
                 f" = {fmt_s(prefill['per_layer_s'])}; {inp.nics} NIC(s) per request")
    lines.append(f"{'network':>8} {'B_net':>10} {'T = bytes/B_net':>16} {'per layer':>10}"
                 f" {'eager':>10} {'layer-wise':>11}  exposed")
    nets = {}
    for gbps in inp.networks_gbps:
        t = kv_transfer(kv, m.layers, prefill["time_s"], gbps, inp.nics)
        nets[gbps] = t.to_dict()
        lines.append(f"{gbps:>5} Gb {fmt_si(t.bytes_per_s, 'B/s'):>10} {fmt_s(t.total_s):>16} "
                     f"{fmt_s(t.per_layer_s):>10} {fmt_s(t.eager_exposed_s):>10} "
                     f"{fmt_s(t.layerwise_exposed_s):>11}  "
                     f"{'last layer only' if t.hidden else 'link lags compute'}")
    lines.append("layer-wise leaves only the last layer exposed when per-layer transfer "
                 "< per-layer compute")
    return Step("transfer", "KV transfer P -> D, eager vs layer-wise", "seed 000 §3.1, §3.3",
                lines, {"kv_bytes": kv, "networks": nets})


def latency_step(inp: PlanInputs, prefill: dict, decode: dict, transfer: dict,
                 notes: list[str]) -> Step:
    gbps = max(inp.networks_gbps)
    exposed = transfer["networks"][gbps]["layerwise_exposed_s"]
    ttft, tpot = prefill["time_s"] + exposed, decode["tpot_s"]
    lines = equation("TTFT", f"prefill + layer-wise exposed transfer ({gbps} Gbps)",
                     f"{fmt_s(prefill['time_s'])} + {fmt_s(exposed)}", fmt_s(ttft))
    lines.append(f"TPOT = {fmt_s(tpot)} at batch {decode['batch']}")
    values = {"network_gbps": gbps, "ttft_s": ttft, "tpot_s": tpot}
    for name, got, slo in (("TTFT", ttft, inp.slo_ttft_s), ("TPOT", tpot, inp.slo_tpot_s)):
        if slo is not None:
            met = got <= slo
            values[f"slo_{name.lower()}_met"] = met
            lines.append(f"{name} SLO {fmt_s(slo)}: {'met' if met else 'MISSED'}")
            if not met:
                notes.append(f"{name} {fmt_s(got)} misses the {fmt_s(slo)} SLO")
    if inp.lout is not None:
        e2e = request_latency_s(ttft, inp.lout, tpot)
        lines += equation("latency", "TTFT + (Lout - 1) x TPOT",
                          f"{fmt_s(ttft)} + {inp.lout - 1:,} x {fmt_s(tpot)}", fmt_s(e2e))
        values["latency_s"] = e2e
    lines.append("unloaded floor: queueing is not modeled (the simulator does that)")
    return Step("latency", "Latency against the SLOs", "seed 003 §1.3", lines, values)


def pd_ratio_step(inp: PlanInputs, prefill: dict, decode: dict) -> Step:
    tp_, td = prefill["theta_p_tokens_per_s_per_gpu"], decode["theta_d_tokens_per_s_per_gpu"]
    r = pd_ratio(inp.lin, inp.lout, tp_, td)
    lines = equation("N_D / N_P", "(Lout / Lin) x (Theta_P / Theta_D)",
                     f"({inp.lout:,} / {inp.lin:,}) x ({tp_:,.0f} / {td:,.0f})", f"{r:.3g}")
    lines.append(f"{r:.3g} decode GPUs per prefill GPU" if r >= 1
                 else f"{1 / r:.3g} prefill GPUs per decode GPU")
    return Step("pd_ratio", "P:D ratio", "seed 000 §5.3", lines,
                {"ratio_d_per_p": r, "theta_p": tp_, "theta_d": td})


def gpu_count_step(inp: PlanInputs, prefill: dict, decode: dict, fit: dict) -> Step:
    if not fit["fits"]:
        return Step("gpu_count", "GPU count", "seed 003 §7.4",
                    ["not computed: one request does not fit a decode instance"],
                    {"computed": False})
    r, lines, values = inp.redundancy, [], {"computed": True}
    for pool, tokens, theta, gpus in (
            ("prefill", inp.lin, prefill["theta_p_tokens_per_s_per_gpu"], inp.prefill.gpus),
            ("decode", inp.lout, decode["theta_d_tokens_per_s_per_gpu"], inp.decode.gpus)):
        c = gpu_count(inp.qps * tokens, theta, r)
        lines += equation(f"{pool} GPUs", "ceil(QPS x tokens / Theta per GPU) x (1 + r)",
                          f"ceil({inp.qps:g} x {tokens:,} / {theta:,.0f}) x {1 + r:g} = "
                          f"ceil({c.raw:.3g}) x {1 + r:g} = {c.base} x {1 + r:g}",
                          f"{c.total} GPUs")
        instances = ceil_count(c.total / gpus)
        lines.append(f"  in whole instances of {gpus} GPU(s): {instances} = "
                     f"{instances * gpus} GPUs")
        values[pool] = {**c.to_dict(), "instances": instances, "gpus": instances * gpus}
    values["total_gpus"] = values["prefill"]["gpus"] + values["decode"]["gpus"]
    lines.append(f"total: {values['total_gpus']} GPUs (redundancy {r:.0%})")
    return Step("gpu_count", "GPU count with redundancy", "seed 003 §7.4", lines, values)
