"""A capacity plan: the planner's formulas applied in the order capacity is
worked out by hand (weights -> KV -> concurrency -> throughput/latency -> GPU
count), each step kept as printable lines plus machine-readable values."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.planner import steps, steps_speed
from pdserve.planner.deployment import Deployment


@dataclass(frozen=True)
class PlanInputs:
    prefill: Deployment
    decode: Deployment  # same model and parallelism; its GPU may differ
    context_tokens: int  # tokens a request may hold in KV (sizes memory)
    lin: int | None = None  # mean prompt tokens
    lout: int | None = None  # mean output tokens
    qps: float | None = None  # peak requests/s
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    # P->D links as (label, effective bytes/s); default: the 100/200/400 Gbps table
    links: tuple[tuple[str, float], ...] = ()
    nics: int = 1  # NICs a request's KV crosses in parallel
    redundancy: float = 0.3  # spare share of GPUs, 30% as in the capacity worked example
    binary_units: bool = False  # read a link's "GB/s" as GiB/s, as hand calculations often do
    decode_batch: int | None = None  # None: memory's limit, lowered to meet the TPOT SLO
    theta_p: float | None = None  # measured prefill tokens/s per GPU, instead of the model's
    theta_d: float | None = None  # measured decode tokens/s per GPU
    occupancy_s: float | None = None  # mean seconds a request holds a slot
    concurrency_per_gpu: float | None = None  # requests one GPU carries at once
    spec_k: int | None = None  # draft tokens per speculative step (gamma)
    spec_acceptance: float | None = None  # per-token acceptance rate (alpha)
    spec_draft_cost: float = 0.0  # one draft token's cost, in target steps

    def __post_init__(self) -> None:
        for name in ("context_tokens", "lin", "lout", "nics", "decode_batch", "spec_k"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("qps", "slo_ttft_s", "slo_tpot_s", "theta_p", "theta_d", "occupancy_s", "concurrency_per_gpu"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.redundancy < 0:
            raise ValueError(f"redundancy must be >= 0, got {self.redundancy}")
        if (self.lin is None) != (self.lout is None):
            raise ValueError("give --lin and --lout together")
        if self.qps is not None and self.lin is None and self.occupancy_s is None:
            raise ValueError("--qps needs --lin and --lout (or --occupancy-s)")
        if (self.spec_k is None) != (self.spec_acceptance is None):
            raise ValueError("give --spec-k and --spec-acceptance together")
        if self.spec_acceptance is not None and not 0.0 <= self.spec_acceptance < 1.0:
            raise ValueError(f"spec acceptance must be in [0, 1), got {self.spec_acceptance}")
        if self.spec_draft_cost < 0:
            raise ValueError(f"spec draft cost must be >= 0, got {self.spec_draft_cost}")
        if (self.occupancy_s is None) != (self.concurrency_per_gpu is None):
            raise ValueError("give --occupancy-s and --concurrency-per-gpu together")
        if self.prefill.model != self.decode.model:
            raise ValueError("prefill and decode must serve the same model")

    @property
    def prompt_tokens(self) -> int:
        """Tokens one prefill computes and ships: Lin, else the whole context."""
        return self.lin if self.lin is not None else self.context_tokens

    @property
    def decode_context_tokens(self) -> int:
        """Mean context a decode step reads: the prompt plus half the output."""
        if self.lin is None:
            return self.context_tokens
        return self.lin + self.lout // 2


@dataclass
class Plan:
    inputs: PlanInputs
    steps: list[steps.Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "inputs": steps.describe_inputs(self.inputs),
            "results": {s.key: s.values for s in self.steps},
            "steps": [s.to_dict() for s in self.steps],
            "notes": list(self.notes),
        }

    def render(self) -> str:
        out = [steps.headline(self.inputs), ""]
        for i, step in enumerate(self.steps, 1):
            section = f"  ({step.section})" if step.section else ""
            out.append(f"[{i}] {step.title}{section}")
            out.extend("    " + line for line in step.lines)
            out.append("")
        if self.notes:
            out.append("Notes:")
            out.extend(f"  - {n}" for n in self.notes)
        return "\n".join(out).rstrip() + "\n"


def make_plan(inp: PlanInputs) -> Plan:
    """Every step of the plan, in order; later steps read earlier values."""
    plan = Plan(inp)
    add, notes = plan.steps.append, plan.notes
    add(steps.hardware_step(inp, notes))
    add(steps.weights_step(inp))
    add(steps.kv_step(inp))
    fit = steps.fit_step(inp, notes)
    add(fit)
    # The decode batch is also the number of requests in flight, which sets
    # how many micro-batches keep a PP pipeline busy on both sides.
    n = fit.values["max_concurrency"]
    batch = steps_speed.decode_batch(inp, n, notes)
    prefill = steps_speed.prefill_step(inp, micro_batches=batch)
    decode = steps_speed.decode_step(inp, batch, n)
    transfer = steps_speed.transfer_step(inp, prefill.values)
    add(prefill)
    add(decode)
    add(transfer)
    add(steps_speed.latency_step(inp, prefill.values, decode.values, transfer.values, notes))
    if inp.lin is not None:
        add(steps_speed.pd_ratio_step(inp, prefill.values, decode.values))
    if inp.qps is not None:
        add(steps_speed.gpu_count_step(inp, prefill.values, decode.values, fit.values))
    if inp.spec_k is not None:
        add(steps_speed.spec_step(inp, decode.values))
    if inp.prefill.crosses_node:
        notes.append(
            f"TP={inp.prefill.tp} spans nodes: every all-reduce crosses the NIC (keep TP inside one NVLink node)"
        )
    if inp.prefill.latency_model == "roofline":
        notes.append(
            "roofline numbers are upper bounds on speed; derate with --compute-efficiency / --bandwidth-efficiency"
        )
    else:
        notes.append(
            "times are the fitted model (docs/planner.md); the roofline lower bound "
            "is shown beside each, and --latency-model roofline uses it instead"
        )
    return plan
