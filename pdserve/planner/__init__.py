"""Capacity planner: pure functions from model shapes and hardware figures to
memory, roofline time, KV transfer time, P:D ratio and GPU count.

The contract: every function here is side-effect free and standard-library
only, so the simulator and the router can import the same cost model the
`pdserve plan` command prints. Formulas and their seed sections:

- ``memory``: weight bytes; KV bytes per token / request (MHA, GQA, MLA);
  fit and max concurrency (seed 000 §3.1, seed 003 §3.1-3.3, §7.2).
- ``roofline``: ridge point, prefill and decode iteration time with TP
  all-reduce and PP bubble (seed 000 §1.1, §1.2, §2.1; seed 003 §2.1-2.3).
- ``transfer``: KV transfer time, eager vs layer-wise exposure (seed 000 §3.1, §3.3).
- ``capacity``: P:D ratio (seed 000 §5.3), GPU count with redundancy
  (seed 003 §7.4), request latency (seed 003 §1.3).
- ``models`` / ``hardware``: the catalogs, as data with a source per figure.
- ``plan``: all of the above in order, as printable steps and a dict.
"""
from pdserve.planner.capacity import gpu_count, pd_ratio, request_latency_s
from pdserve.planner.deployment import Deployment
from pdserve.planner.hardware import GPUS, Accelerator, resolve_gpu
from pdserve.planner.memory import kv_bytes, kv_bytes_per_token, max_concurrency, weight_bytes
from pdserve.planner.models import MODELS, ModelShape, param_count, resolve_model
from pdserve.planner.plan import Plan, PlanInputs, make_plan
from pdserve.planner.roofline import decode_step_time, pp_bubble_ratio, prefill_time
from pdserve.planner.transfer import exposed_transfer_s, kv_transfer, transfer_time_s

__all__ = [
    "Accelerator", "Deployment", "GPUS", "MODELS", "ModelShape", "Plan", "PlanInputs",
    "decode_step_time", "exposed_transfer_s", "gpu_count", "kv_bytes", "kv_bytes_per_token",
    "kv_transfer", "make_plan", "max_concurrency", "param_count", "pd_ratio",
    "pp_bubble_ratio", "prefill_time", "request_latency_s", "resolve_gpu", "resolve_model",
    "transfer_time_s", "weight_bytes",
]
