"""What serving a LoRA adapter costs on the embedded model, against the base model in the same engine.

    python benchmarks/lora.py [--rounds 3] [--rank 16] [--tokens 64] [--dtype auto]

Makes rank-`--rank` adapters of SmolLM2-135M on all seven projections with PEFT (random
weights: the cost does not depend on what an adapter learned), loads them into one engine
(`enable_lora`, `max_loras=4`) and, each round, runs every case on it one after another:

- decode, batch 1: one request at a time, output tokens per second from first token to last;
- decode, batch 8: eight requests at once, output tokens per second of wall time; all base,
  all one adapter, or four adapters two requests each (the grouped path: a product per adapter);
- prefill: one 1,024-token prompt, seconds to its first token.

Prints each adapter case's median ratio to the base case of the same round, with the spread
over the rounds, and the CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pdserve import LLM, LoRARequest, SamplingParams  # noqa: E402
from pdserve.config import cpu_description  # noqa: E402
from pdserve.engine.loader import default_model_path  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def make_adapters(directory: str, rank: int, count: int) -> list[str]:
    import transformers
    from peft import LoraConfig, get_peft_model

    d, f = os.path.split(default_model_path())
    paths = []
    for i in range(count):
        base = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        path = os.path.join(directory, f"adapter{i}")
        model.save_pretrained(path)
        paths.append(path)
    return paths


def decode_rate(llm, loras, tokens: int) -> float:
    """Output tokens per second: batch 1 from first token to last, a batch of wall time."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    if len(loras) == 1:
        t0 = time.perf_counter()
        out = llm.generate([PROMPT], params, lora_request=loras)[0]
        m = out.metrics
        span = m.get("last_token_time", 0) - m.get("first_token_time", 0)
        return (tokens - 1) / span if span > 0 else tokens / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    llm.generate([PROMPT] * len(loras), params, lora_request=loras)
    return len(loras) * tokens / (time.perf_counter() - t0)


def prefill_s(llm, lora, prompt_ids) -> float:
    t0 = time.perf_counter()
    llm.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=1), lora_request=lora)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(tmp, args.rank, 4)
        llm = LLM(
            dtype=args.dtype,
            enable_lora=True,
            max_loras=4,
            max_lora_rank=max(16, args.rank),
            enable_prefix_caching=False,
        )
        reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
        prompt = (llm.tokenizer.encode(PROMPT * 80))[:1024]
        cases = {
            "decode batch 1, one adapter": (lambda r: decode_rate(llm, [r], args.tokens), reqs[0], None, "tok/s"),
            "decode batch 8, one adapter": (
                lambda r: decode_rate(llm, r, args.tokens),
                [reqs[0]] * 8,
                [None] * 8,
                "tok/s",
            ),
            "decode batch 8, four adapters": (
                lambda r: decode_rate(llm, r, args.tokens),
                [reqs[i // 2] for i in range(8)],
                [None] * 8,
                "tok/s",
            ),
            "prefill 1024 tokens, one adapter": (lambda r: prefill_s(llm, r, prompt), reqs[0], None, "s"),
        }
        decode_rate(llm, [reqs[0]] * 2, 8)  # warm up both paths
        decode_rate(llm, [None] * 2, 8)
        ratios: dict[str, list[float]] = {k: [] for k in cases}
        raw: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
        for _ in range(args.rounds):
            for name, (fn, lora, base, unit) in cases.items():
                b = fn(base if base is not None or unit == "s" else None)
                a = fn(lora)
                raw[name].append((b, a))
                ratios[name].append(a / b)
        print(f"# LoRA cost on {cpu_description()}; dtype {llm.engine.config.device.dtype}; rank {args.rank}")
        print(f"# {args.rounds} paired rounds; adapter / base, median [min-max]; prefill: time ratio (>1 slower)")
        for name, (_, _, _, unit) in cases.items():
            r = ratios[name]
            b = statistics.median(x for x, _ in raw[name])
            a = statistics.median(y for _, y in raw[name])
            print(
                f"{name:34s} {statistics.median(r):.2f}x [{min(r):.2f}-{max(r):.2f}]  base {b:.3g} {unit}, adapter {a:.3g} {unit}"
            )
        llm.close()


if __name__ == "__main__":
    main()
