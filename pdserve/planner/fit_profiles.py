"""Refit the step-time model's constants from Vidur's operator profiles.

    python -m pdserve.planner.fit_profiles --vidur-git PATH/TO/vidur/.git \
        --splitwise-git PATH/TO/splitwise-sim/.git

reads the per-operator CSVs of microsoft/vidur (``git show`` at the commits
named in ``fitted.SOURCES``), fits each operator class's terms per GPU kind,
and prints the constants as Python to paste into ``fitted.py``. Offline only:
the planner never imports this module, so numpy stays out of ``pdserve plan``.

What is fitted, with ``t`` a kernel's measured median time:

- dense GEMM (q/k/v, o, gate/up, down projections of every profiled model):
  ``t = launch + max(FLOPs / (eff_c x peak), bytes / (eff_b x bandwidth))``;
- element-wise kernels of one layer (two norms, RoPE, SwiGLU, residual adds):
  ``t = fixed + bytes_per_elem x tokens x hidden / bandwidth / eff``;
- attention prefill ``t = fixed + per_token_head x tokens x heads + FLOPs of
  the chunk's causal pairs / (causal_eff x peak) + FLOPs of its pairs against
  cached tokens / (cached_eff x peak)``; attention decode ``t = fixed + KV bytes
  / (eff x bw)``; H100 takes A100's at FlashAttention-2's H100/A100 share of peak;
- all-reduce per TP size: ``t = latency + bytes / bus_bytes_per_s``;
- per-step CPU work (schedule, sample, prepare inputs, process outputs, and the
  driver-to-worker hop under TP): ``t = fixed + per_seq x batch``;
- with ``--splitwise-git``, the "vllm-2023" engine's extra host costs, from
  what Splitwise measured end to end for BLOOM-176B (TP 8, DGX-A100 and
  DGX-H100): the eager engine's kernel-issue window, which overlaps the GPU
  (``step = sync + max(gpu, window)``, window ``fixed + per_seq x batch`` over
  batches 1-64, prompt 512), and a prefill step's synchronous extra (median
  over prompts of 128-1,024 tokens; longer BLOOM prompts pay ALiBi's
  materialised bias in that vLLM, which a RoPE model does not). Llama-2-70B's
  rows of the same file are the held-out set and are not read.
"""

from __future__ import annotations

import argparse
import csv
import io
import subprocess

from pdserve.planner.fitted import SOURCES
from pdserve.planner.hardware import GPUS

PEAKS = {"a100": GPUS["a100-80gb"], "h100": GPUS["h100-sxm"]}
# Best share of the dense BF16 peak FlashAttention-2 reaches, by its authors:
# "50-73% of the theoretical maximum FLOPs/s on A100" (Dao, arXiv 2307.08691,
# abstract) and "only 35% utilization on the H100" (Shah et al., FlashAttention-3,
# arXiv 2407.08608, abstract): it does not use Hopper's TMA and warp-group MMA.
# The profiled attention kernels (Vidur's and the 2023 engines') are of that generation.
FA2_PEAK_SHARE = {"a100": 0.73, "h100": 0.35}
DTYPE_BYTES = 2
MS = 1e-3


def _csv(git_dir: str, commit: str, path: str) -> list[dict]:
    text = subprocess.run(
        ["git", f"--git-dir={git_dir}", "show", f"{commit}:{path}"], check=True, capture_output=True, text=True
    ).stdout
    return list(csv.DictReader(io.StringIO(text)))


def _gemm_rows(rows: list[dict]):
    """(flops, bytes, seconds) of every projection in an MLP/attention CSV."""
    out = []
    for r in rows:
        h, e = int(r["n_embd"]), int(r["n_expanded_embd"])
        heads, kv = int(r["n_head"]), int(r["n_kv_head"])
        tp, t = int(r["num_tensor_parallel_workers"]), int(r["num_tokens"])
        d = h // heads
        gated = r["use_gated_mlp"] == "True"
        shapes = {
            "attn_pre_proj": (h, (heads + 2 * kv) * d // tp),
            "attn_post_proj": (heads * d // tp, h),
            "mlp_up_proj": (h, (2 if gated else 1) * e // tp),
            "mlp_down_proj": (e // tp, h),
        }
        for op, (k, n) in shapes.items():
            sec = float(r[f"time_stats.{op}.median"]) * MS
            out.append((2.0 * t * k * n, DTYPE_BYTES * (k * n + t * k + t * n), sec))
    return out


def fit_gemm(rows, peak: float, bw: float) -> dict:
    import numpy as np

    f, b, y = (np.array(c) for c in zip(*rows))
    best = None
    for ec in np.arange(0.30, 1.001, 0.01):
        for eb in np.arange(0.30, 1.001, 0.01):
            core = np.maximum(f / (ec * peak), b / (eb * bw))
            launch = max(0.0, float(np.median(y - core)))
            err = float(np.mean(((core + launch) / y - 1.0) ** 2))
            if best is None or err < best[0]:
                best = (err, ec, eb, launch)
    err, ec, eb, launch = best
    return {
        "compute_eff": round(float(ec), 2),
        "bandwidth_eff": round(float(eb), 2),
        "launch_s": round(launch, 7),
        "rms_rel_err": round(err**0.5, 3),
        "rows": len(y),
    }


def fit_elementwise(rows: list[dict], bw: float) -> dict:
    """One layer's norms, RoPE, activation and two residual adds, as one memory-bound term."""
    import numpy as np

    x, y = [], []
    for r in rows:
        t, h = int(r["num_tokens"]), int(r["n_embd"])
        sec = sum(
            float(r[f"time_stats.{op}.median"])
            for op in ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act")
        ) + 2 * float(r["time_stats.add.median"])
        x.append(t * h * DTYPE_BYTES / bw)
        y.append(sec * MS)
    a = np.vstack([np.ones(len(x)), x]).T
    w = 1.0 / np.array(y)
    (fixed, per), *_ = np.linalg.lstsq(a * w[:, None], np.array(y) * w, rcond=None)
    return {"fixed_s": round(float(fixed), 7), "bytes_per_token_hidden": round(float(per), 2)}


def fit_attention(rows: list[dict], peak: float, bw: float) -> dict:
    """Prefill: ``fixed + per_token_head x tokens x heads + 4 d heads x (causal pairs /
    causal_eff + cached pairs / cached_eff) / peak``; decode: ``fixed + KV bytes / (eff x bw)``.
    The chunk's own causal pairs and its pairs against cached tokens get separate
    shares of peak: one share for both misprices prompts with no cached prefix by
    up to 44% in this very profile (Vidur's rows are mostly chunks after a cache)."""
    import numpy as np

    pre_a, pre_y, dec_x, dec_y = [], [], [], []
    for r in rows:
        heads, kv = int(r["n_q_head"]), int(r["n_kv_head"])
        tp, d = int(r["num_tensor_parallel_workers"]), int(r["n_embd"]) // int(r["n_q_head"])
        ctx = int(r["kv_cache_size"])
        if r["is_prefill"] == "True":
            n, h = int(r["prefill_chunk_size"]), heads / tp
            pre_a.append([1.0, n * h, 4.0 * d * h * n * (n + 1) / 2.0 / peak, 4.0 * d * h * n * ctx / peak])
            pre_y.append(float(r["time_stats.attn_prefill.median"]) * MS)
        else:
            batch = int(r["batch_size"])
            dec_x.append(2.0 * d * max(1, kv // tp) * DTYPE_BYTES * ctx * batch / bw)
            dec_y.append(float(r["time_stats.attn_decode.median"]) * MS)
    y = np.array(pre_y)
    (fixed, per_tok, causal, cached), *_ = np.linalg.lstsq(np.array(pre_a) / y[:, None], y / y, rcond=None)
    out = {
        "prefill": {
            "fixed_s": round(float(fixed), 7),
            "per_token_head_s": float(f"{per_tok:.3g}"),
            "causal_eff": round(1.0 / float(causal), 3),
            "cached_eff": round(1.0 / float(cached), 3),
        }
    }
    y = np.array(dec_y)
    a = np.vstack([np.ones(len(dec_x)), dec_x]).T
    (fixed, slope), *_ = np.linalg.lstsq(a / y[:, None], y / y, rcond=None)
    out["decode"] = {"fixed_s": round(float(fixed), 7), "eff": round(1.0 / float(slope), 3)}
    return out


def attention_on(kind: str, a100: dict) -> dict:
    """A100's attention fit carried to another kind: prefill attention at the share
    of peak FlashAttention-2 reaches there (FA2_PEAK_SHARE), decode (bandwidth-bound) as is."""
    scale = FA2_PEAK_SHARE[kind] / FA2_PEAK_SHARE["a100"]
    pre = dict(a100["prefill"])
    pre["causal_eff"] = round(pre["causal_eff"] * scale, 3)
    pre["cached_eff"] = round(pre["cached_eff"] * scale, 3)
    return {"prefill": pre, "decode": dict(a100["decode"])}


def fit_allreduce(rows: list[dict]) -> dict:
    """Latency and bus bandwidth of one all-reduce per TP size (one node)."""
    import numpy as np

    out = {}
    for n in sorted({int(r["num_workers"]) for r in rows}):
        pts = [
            (int(r["size"]), float(r["time_stats.all_reduce.median"]) * MS)
            for r in rows
            if int(r["num_workers"]) == n and int(r["devices_per_node"]) >= n and int(r["size"]) <= 64 * 2**20
        ]
        if not pts:  # only within one node: TP across nodes is not a deployment we price
            continue
        x = np.array([p[0] for p in pts], dtype=float)
        y = np.array([p[1] for p in pts])
        a = np.vstack([np.ones(len(x)), x]).T
        (lat, per), *_ = np.linalg.lstsq(a / y[:, None], y / y, rcond=None)
        out[n] = {"latency_s": round(float(lat), 7), "bytes_per_s": round(1.0 / float(per), -8)}
    return out


def fit_cpu(rows: list[dict]) -> dict:
    """Per-step CPU work by TP: the driver-to-worker hop only exists with TP > 1."""
    import numpy as np

    out = {}
    for tp in sorted({int(r["tensor_parallel_degree"]) for r in rows}):
        b, y = [], []
        for r in rows:
            if int(r["tensor_parallel_degree"]) != tp:
                continue
            b.append(int(r["batch_size"]))
            y.append(
                sum(
                    float(r[k])
                    for k in (
                        "schedule_median",
                        "sampler_e2e_median",
                        "prepare_inputs_e2e_median",
                        "process_model_outputs_median",
                        "ray_comm_time_mean",
                    )
                )
                * MS
            )
        a = np.vstack([np.ones(len(b)), b]).T
        (fixed, per), *_ = np.linalg.lstsq(a, np.array(y), rcond=None)
        out[tp] = {"fixed_s": round(float(fixed), 6), "per_seq_s": round(float(per), 7)}
    return out


def fit_all(git_dir: str) -> dict:
    src = SOURCES["vidur"]
    head, attn_commit, cpu_commit = src["commit"], src["attention_commit"], src["cpu_commit"]
    fits = {}
    for kind, gpu in PEAKS.items():
        mlp = []
        for model in src["models"][kind]:
            mlp += _csv(git_dir, head, f"data/profiling/compute/{kind}/{model}/mlp.csv")
        fits[kind] = {
            "gemm": fit_gemm(_gemm_rows(mlp), gpu.bf16_flops, gpu.memory_bytes_per_s),
            "elementwise": fit_elementwise(mlp, gpu.memory_bytes_per_s),
            "allreduce": fit_allreduce(_csv(git_dir, head, f"data/profiling/network/{kind}_dgx/all_reduce.csv")),
        }
    a100 = PEAKS["a100"]
    attn = fit_attention(
        _csv(git_dir, attn_commit, "data/profiling/a100/attention.csv"), a100.bf16_flops, a100.memory_bytes_per_s
    )
    cpu = fit_cpu(_csv(git_dir, cpu_commit, "data/profiling/a100/cpu_overheads.csv"))
    for kind in fits:  # only A100 attention and CPU profiles exist (see fitted.py)
        fits[kind]["attention"] = attn if kind == "a100" else attention_on(kind, attn)
        fits[kind]["cpu"] = cpu
    return fits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vidur-git", help="git directory of a microsoft/vidur clone")
    p.add_argument(
        "--splitwise-git",
        help="git directory of a Mutinifni/splitwise-sim clone: fit the vllm-2023 engine terms (fitted.ENGINES)",
    )
    args = p.parse_args(argv)
    import pprint

    if args.vidur_git:
        pprint.pprint(fit_all(args.vidur_git), sort_dicts=False, width=100)
    if args.splitwise_git:
        src = SOURCES["splitwise_bloom"]
        rows = _csv(args.splitwise_git, src["commit"], src["path"])
        from pdserve.planner.fit_engines import fit_engine

        pprint.pprint(fit_engine(rows), sort_dicts=False, width=100)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
