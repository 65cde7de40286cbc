"""Agreement of an engine mode with `transformers` in a given dtype (teacher-forced).

Each prompt is decoded greedily by the pdserve engine under test. The reference
model (transformers, loaded from the same GGUF, in the dtype named) then reads
prompt + the engine's own output in one forward pass and, at every generated
position, names its greedy token given the engine's history. Reported:

- top-1 agreement: the share of generated tokens the reference would also have
  picked;
- the log-probability gap at each step: the reference's log-probability of its
  own top token minus that of the engine's token (0 where they agree); its mean,
  and the median and maximum over the disagreements (near-ties are small gaps);
- where the engine's greedy sequence first parts from the reference's choice.

Used by `benchmarks/agreement.py` and `tests/engine/test_bf16_agreement.py`;
needs the `transformers` test extra.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field

import torch

from pdserve.engine.sampling_params import SamplingParams

# The engine's numeric modes by name: keyword arguments for `LLM`, and the transformers dtype a
# mode is judged against besides float32. "int8": fp32 with activations rounded to int8 per 32
# values for every product on GGUF blocks (what dtype="auto" picks on CPUs without native bf16).
ENGINE_MODES = {
    "float32": ({"dtype": "float32"}, "float32"),
    "bfloat16": ({"dtype": "bfloat16"}, "bfloat16"),
    "int8": ({"dtype": "float32", "int8_activations": True}, "float32"),
}

PARITY_TEXT = (
    "The history of computing is a story of people building tools to think faster. "
    "Charles Babbage designed engines of brass; Ada Lovelace saw that they could compose music. "
    "Later, vacuum tubes gave way to transistors, and transistors to integrated circuits. "
)
SHORT_PROMPTS = [
    "Hi there, how are you?",
    "What is the capital of France? Answer in one sentence.",
    "List three primary colours:",
    "def fibonacci(n):\n    ",
]


def parity_prompts(tok, long_lengths=(120, 400, 900, 1500)) -> list[list[int]]:
    """The prompts of tests/engine/test_parity_hf.py: 4 short ones and long ones of
    varied sentences cut to `long_lengths` tokens."""
    ids = [tok.encode(p) for p in SHORT_PROMPTS]
    sentences = PARITY_TEXT.split(". ")
    for target in long_lengths:
        words: list[str] = []
        i = 0
        while len(tok.encode(" ".join(words))) < target:
            words.append(sentences[i % 3] + f" (note {i}).")
            i += 1
        ids.append(tok.encode(" ".join(words))[:target])
    return ids


def load_reference(model_path: str, dtype: torch.dtype):
    """transformers' own Llama on the GGUF's weights (its own dequantizer), in `dtype`."""
    import transformers

    d, f = os.path.split(model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=dtype)
    return model.eval()


@dataclass
class Agreement:
    steps: int = 0
    agree: int = 0
    gaps: list[float] = field(default_factory=list)  # per step, 0 where they agree
    split_gaps: list[float] = field(default_factory=list)  # at the disagreements (0: an exact tie)
    first_split: list[int] = field(default_factory=list)  # per prompt: first disagreeing step (or its length)

    @property
    def top1(self) -> float:
        return self.agree / max(1, self.steps)

    def within(self, gap: float) -> int:
        """Steps where the chosen token is the reference's top, or trails it by at most `gap`
        nats: a near-tie that rounding alone can flip (bf16 steps are 0.25 apart at logit 50)."""
        return self.agree + sum(g <= gap for g in self.split_gaps)

    def summary(self) -> dict:
        bad = self.split_gaps
        return {
            "steps": self.steps,
            "top1": round(self.top1, 4),
            "mean_logprob_gap": round(statistics.fmean(self.gaps), 4) if self.gaps else 0.0,
            "disagreements": len(bad),
            "exact_ties": sum(g == 0 for g in bad),
            "median_gap_at_disagreements": round(statistics.median(bad), 4) if bad else 0.0,
            "max_gap": round(max(bad), 4) if bad else 0.0,
            "median_first_split": statistics.median(self.first_split) if self.first_split else 0,
        }


def engine_outputs(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, p)]


@torch.no_grad()
def measure(reference, prompts: list[list[int]], outputs: list[list[int]]) -> Agreement:
    """Teacher-forced agreement of `outputs` (the engine's greedy tokens) with `reference`."""
    res = Agreement()
    for p, out in zip(prompts, outputs):
        ids = torch.tensor([list(p) + list(out)], device=reference.device)
        logits = reference(ids, attention_mask=torch.ones_like(ids)).logits[0].float().cpu()
        lp = torch.log_softmax(logits[len(p) - 1 : len(p) - 1 + len(out)], dim=-1)
        chosen = torch.tensor(out)
        top = lp.argmax(-1)
        gaps = (lp.max(-1).values - lp.gather(-1, chosen[:, None])[:, 0]).clamp_min(0)
        same = top == chosen
        res.steps += len(out)
        res.agree += int(same.sum())
        res.gaps.extend(0.0 if s else float(g) for s, g in zip(same.tolist(), gaps.tolist()))
        res.split_gaps.extend(float(g) for s, g in zip(same.tolist(), gaps.tolist()) if not s)
        split = (~same).nonzero()
        res.first_split.append(int(split[0, 0]) if len(split) else len(out))
    return res
