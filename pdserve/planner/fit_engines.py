"""The engine host-cost terms of ``fitted.ENGINES``, fitted on Splitwise's BLOOM-176B runs.

Called by ``python -m pdserve.planner.fit_profiles --splitwise-git PATH`` after
the operator-level fit (``fit_profiles``), since the engine terms are what the
measured end-to-end steps leave once the operator model has priced them.
Offline only (numpy). Only BLOOM rows are read: the same file's Llama-2-70B
rows are the held-out set (``heldout.py``).
"""

from __future__ import annotations

from pdserve.planner.validate import consistent_run

MS = 1e-3

# BLOOM-176B (huggingface.co/bigscience/bloom config.json: 70 layers, hidden
# 14,336, 112 heads, vocab 250,880, tied embeddings). Its 4h GELU MLP (8h^2
# weights) is priced as a gated MLP of the same weights: intermediate 8h/3.
BLOOM = {
    "name": "bloom-176b",
    "layers": 70,
    "hidden": 14336,
    "heads": 112,
    "kv_heads": 112,
    "head_dim": 128,
    "intermediate": 38229,
    "vocab": 250880,
    "max_context_tokens": 2048,
    "tied_embeddings": True,
}
# decode steps are read from runs of 128 outputs (mean context prompt + 64), as the held-out set's
OUTPUTS = 128
SPLITWISE_GPUS = {"a100-80gb": ("a100", "a100-80gb"), "h100-80gb": ("h100", "h100-sxm")}


def _bloom_runs(rows: list[dict]) -> dict:
    runs: dict = {}
    for r in rows:
        if r["model"] != "bloom-176b" or r["hardware"] not in SPLITWISE_GPUS or int(r["token_size"]) != OUTPUTS:
            continue
        prompt_s, token_s, e2e_s = (float(r[c]) * MS for c in ("prompt_time", "token_time", "e2e_time"))
        if consistent_run(prompt_s, token_s, e2e_s, OUTPUTS):
            key = (r["hardware"], int(r["tensor_parallel"]), int(r["prompt_size"]), int(r["batch_size"]))
            runs.setdefault(key, []).append((prompt_s, token_s))
    return runs


def fit_issue_window(b, sync, gpu, measured) -> tuple[float, float]:
    """(window, synchronous per-sequence) seconds that best explain, in relative
    error, ``measured = sync + per_seq x b + max(gpu, window)`` (a grid search)."""
    import numpy as np

    b, sync, gpu, measured = (np.asarray(x, float) for x in (b, sync, gpu, measured))
    w = np.arange(0.0, 0.1, 5e-5)[:, None, None]
    per_seq = np.arange(0.0, 2e-3, 2e-6)[None, :, None]
    err = (((sync + per_seq * b + np.maximum(gpu, w)) / measured - 1.0) ** 2).sum(axis=2)
    i, j = np.unravel_index(np.argmin(err), err.shape)
    return float(w[i, 0, 0]), float(per_seq[0, j, 0])


def _bloom_steps(runs: dict, hw: str, gpu: str):
    """(decode, prefill) lists of (batch or prompt, operator-model StepCost, measured s) on one node."""
    import statistics

    from pdserve.planner import perf
    from pdserve.planner.deployment import Deployment
    from pdserve.planner.hardware import resolve_gpu
    from pdserve.planner.models import ModelShape

    dec, pre = [], []
    for (h, tp, prompt, batch), v in sorted(runs.items()):
        if h != hw:
            continue
        dep = Deployment(ModelShape(**BLOOM), resolve_gpu(gpu), tp=tp)
        if prompt == 512:  # decode steps hold the prompt plus half the 128 outputs
            dec.append((batch, perf.decode_cost(dep, batch, prompt + 64), statistics.median(t for _, t in v)))
        if batch == 1 and prompt <= 1024:
            pre.append((prompt, perf.prefill_cost(dep, prompt), statistics.median(p for p, _ in v)))
    return dec, pre


def fit_engine(rows: list[dict]) -> dict:
    """Host costs of Splitwise's vLLM beyond the operator model, per GPU kind,
    read two ways from the same BLOOM runs (both fit them to within 4%):

    - "vllm-2023": added to the step, ``fixed + per_seq x batch`` (decode) and
      ``prefill_fixed`` more for a step that prefills;
    - "vllm-2023-overlap": that eager engine's CPU issues a step's kernels while
      the GPU runs those already issued, so the issue window overlaps the GPU:
      ``step = sync + per_seq x batch + max(gpu, window)``, window stored per layer.

    ``sync`` is the CPU work Vidur profiled (the operator model's ``overhead_s``)."""
    import statistics

    import numpy as np

    runs = _bloom_runs(rows)
    out: dict = {"vllm-2023": {}, "vllm-2023-overlap": {}}
    for hw, (kind, gpu) in SPLITWISE_GPUS.items():
        dec, pre = _bloom_steps(runs, hw, gpu)
        b = np.array([x[0] for x in dec], float)
        per_seq, fixed = np.polyfit(b, np.array([m - c.total_s for _, c, m in dec]), 1)
        extra = statistics.median(m - c.total_s for _, c, m in pre) - fixed - per_seq
        out["vllm-2023"][kind] = {
            "fixed_s": round(float(fixed), 5),
            "per_seq_s": round(float(per_seq), 6),
            "prefill_fixed_s": round(float(extra), 4),
            "max_batch_fitted": int(max(b)),
        }
        window, sync_seq = fit_issue_window(
            b, [c.overhead_s for _, c, _ in dec], [c.gpu_s for _, c, _ in dec], [m for _, _, m in dec]
        )
        left = [m - (c.overhead_s + sync_seq + max(c.gpu_s, window)) for _, c, m in pre]
        out["vllm-2023-overlap"][kind] = {
            "per_seq_s": float(f"{sync_seq:.3g}"),
            "prefill_fixed_s": round(float(statistics.median(left)), 4),
            "launch_per_layer_s": float(f"{window / BLOOM['layers']:.3g}"),
            "max_batch_fitted": int(max(b)),
        }
    return out
