"""Capacity planner: pure functions from model shapes and hardware figures to
memory, step time, KV transfer time, P:D ratio and GPU count.

The contract: every function here is side-effect free and standard-library
only, so the simulator and the router can import the same cost model the
`pdserve plan` command prints.

- ``memory``: weight bytes; KV bytes per token / request (MHA, GQA, MLA);
  fit and max concurrency.
- ``roofline``: ridge point, prefill and decode iteration time with TP
  all-reduce and PP bubble: the lower bound.
- ``perf``: the fitted step time (per-operator efficiencies and launches,
  all-reduces, per-step CPU work), constants in ``fitted`` with their sources.
- ``transfer``: KV transfer time over any link, eager vs layer-wise exposure.
- ``capacity``: P:D ratio, GPU count with redundancy, request latency,
  speculative decoding's accepted tokens and speed-up.
- ``models`` / ``hardware``: the catalogs, as data with a source per figure.
- ``plan``: all of the above in order, as printable steps and a dict.
"""

from pdserve.planner.capacity import (
    expected_accepted_tokens,
    gpu_count,
    pd_ratio,
    request_latency_s,
    spec_speedup,
)
from pdserve.planner.deployment import Deployment
from pdserve.planner.hardware import GPUS, Accelerator, resolve_gpu
from pdserve.planner.memory import (
    kv_bytes,
    kv_bytes_per_token,
    max_concurrency,
    weight_bytes,
)
from pdserve.planner.models import MODELS, ModelShape, param_count, resolve_model
from pdserve.planner.perf import StepCost, decode_cost, prefill_cost, step_time
from pdserve.planner.plan import Plan, PlanInputs, make_plan
from pdserve.planner.roofline import decode_step_time, pp_bubble_ratio, prefill_time
from pdserve.planner.transfer import (
    exposed_transfer_s,
    kv_transfer,
    link,
    transfer_time_s,
)

__all__ = [
    "GPUS",
    "MODELS",
    "Accelerator",
    "Deployment",
    "ModelShape",
    "Plan",
    "PlanInputs",
    "StepCost",
    "decode_cost",
    "decode_step_time",
    "expected_accepted_tokens",
    "exposed_transfer_s",
    "gpu_count",
    "kv_bytes",
    "kv_bytes_per_token",
    "kv_transfer",
    "link",
    "make_plan",
    "max_concurrency",
    "param_count",
    "pd_ratio",
    "pp_bubble_ratio",
    "prefill_cost",
    "prefill_time",
    "request_latency_s",
    "resolve_gpu",
    "resolve_model",
    "spec_speedup",
    "step_time",
    "transfer_time_s",
    "weight_bytes",
]
