"""The GPU check's stages, one subcommand each, so that `gpu_check.sh` gives each its own
time limit and a hang in one cannot eat the budget of the others.

Every stage writes one JSON file under `--parts` as soon as it has its numbers, and
`report` merges whatever files exist into `results.json` and `summary.md`: a run cut
short still says what it measured.

    model        write a random-weight model (Hugging Face directory, safetensors, a tokenizer)
    bandwidth    device memory bandwidth from a large device-to-device copy
    pdserve      pdserve's offline API: batch-1 decode, a batched run, one long prefill
    transformers transformers' `generate` on the same weights: batch-1 decode
    report       merge the parts, compute the ratios the targets use

`--small` shrinks every shape and count so that the whole flow runs on a CPU in seconds
(tests/test_gpu_check.py runs it there).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

# Shapes of the two models the check builds (random weights: speed does not depend on them).
SHAPES = {
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        rope_theta=100000.0,
    ),
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    # --small: a shape a 2-core CPU runs in well under a second a step
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
        rope_theta=10000.0,
    ),
}

# What each measurement runs: (full size, --small)
WORKLOAD = {
    "decode_prompt": (32, 8),
    "decode_tokens": (128, 8),
    "batch_requests": (64, 4),
    "batch_prompt": (256, 16),
    "batch_tokens": (128, 8),
    "prefill_prompt": (2048, 64),
}

# Nominal HBM bandwidth by the name torch reports (most specific first); a GPU not listed gets
# the measured figure only. The device tool lends H100s and H200s.
NOMINAL_BYTES_PER_S = [
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),  # 40 GB
]


def nominal_bandwidth(gpu_name: str) -> float | None:
    for key, bytes_per_s in NOMINAL_BYTES_PER_S:
        if key in gpu_name:
            return bytes_per_s
    return None


TARGETS = {"roofline_pct": 60.0, "x_transformers": 3.0, "batch_over_single": 10.0}


def workload(small: bool) -> dict[str, int]:
    return {k: v[1] if small else v[0] for k, v in WORKLOAD.items()}


def write_part(parts: str, name: str, data: dict) -> None:
    """One stage's numbers, written at once (atomically: a killed stage leaves no half file)."""
    os.makedirs(parts, exist_ok=True)
    tmp = os.path.join(parts, f".{name}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, os.path.join(parts, f"{name}.json"))


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------- model


def write_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer whose ids cover the model's vocabulary: the check feeds token ids,
    so only the id range matters (the real tokenizer of either model is not on the device)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": f"t{vocab_size - 1}"}, f)


def hf_config(shape: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": shape["vocab_size"] - 1,
        **shape,
    }


def weight_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
    return out


def decode_read_bytes(cfg: dict, itemsize: int) -> int:
    """Bytes of weights one batch-1 decode step must read: every weight but the embedding
    table, of which it reads one row (tied embeddings: the table is the output head, read whole)."""
    total = 0
    for name, shape in weight_shapes(cfg).items():
        n = 1
        for s in shape:
            n *= s
        if name == "model.embed_tokens.weight" and not cfg["tie_word_embeddings"]:
            n = shape[1]
        total += n * itemsize
    return total


def cmd_model(a) -> None:
    import torch
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    shape = SHAPES[a.shape]
    cfg = hf_config(shape)
    os.makedirs(a.dir, exist_ok=True)
    with open(os.path.join(a.dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    write_tokenizer(a.dir, cfg["vocab_size"])
    dtype = getattr(torch, a.dtype)
    g = torch.Generator(device=a.device).manual_seed(0)
    state = {}
    for name, s in weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            w = torch.ones(s, dtype=dtype)
        else:
            w = (torch.randn(s, generator=g, device=a.device, dtype=torch.float32) * 0.02).to(dtype).cpu()
        state[name] = w.contiguous()
    save_file(state, os.path.join(a.dir, "model.safetensors"))
    itemsize = torch.empty(0, dtype=dtype).element_size()
    meta = {
        "shape": a.shape,
        "dtype": a.dtype,
        "params": sum(t.numel() for t in state.values()),
        "file_bytes": sum(t.numel() * itemsize for t in state.values()),
        "decode_read_bytes": decode_read_bytes(cfg, itemsize),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    with open(os.path.join(a.dir, "gpu_check_meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    write_part(a.parts, f"model-{a.shape}", meta)
    print(f"model {a.shape}: {meta['params'] / 1e9:.3f} B params in {meta['seconds']} s")


# ---------------------------------------------------------------- bandwidth


def cmd_bandwidth(a) -> None:
    import torch

    nbytes = (64 << 20) if a.small else (4 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=a.device)
    dst = torch.empty_like(src)
    src.fill_(1)
    for _ in range(3):
        dst.copy_(src)
    sync(a.device)
    iters = 5 if a.small else 20
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(a.device)
    seconds = (time.perf_counter() - t0) / iters
    # a copy reads every byte once and writes it once
    measured = 2 * nbytes / seconds
    data = {"device": a.device, "copy_bytes": nbytes, "iters": iters, "measured_bytes_per_s": measured}
    if a.device.startswith("cuda"):
        data["gpu_name"] = torch.cuda.get_device_name()
        data["nominal_bytes_per_s"] = nominal_bandwidth(data["gpu_name"])
    write_part(a.parts, "bandwidth", data)
    print(f"bandwidth: {measured / 1e12:.3f} TB/s (device-to-device copy of {nbytes >> 20} MiB)")


# ---------------------------------------------------------------- pdserve


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    # the last id is the eos token: kept out of prompts (it is ignored in outputs anyway)
    return [rng.randrange(1, vocab - 1) for _ in range(n)]


def model_meta(path: str) -> tuple[dict, dict]:
    cfg = json.loads(Path(path, "config.json").read_text())
    meta = json.loads(Path(path, "gpu_check_meta.json").read_text())
    return cfg, meta


def pdserve_engine(a, cfg: dict, w: dict):
    from pdserve import LLM

    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    tokens = max(w["batch_requests"] * (w["batch_prompt"] + w["batch_tokens"]), w["prefill_prompt"] + 16)
    kwargs = dict(
        dtype=a.dtype,
        device=a.device,
        enable_prefix_caching=False,  # every run computes its prompt
        max_num_seqs=max(64, w["batch_requests"]),
        max_num_batched_tokens=max(2048, w["prefill_prompt"]),
        kv_cache_memory_bytes=int(tokens * per_token * 1.5) + (64 << 20),
    )
    if a.enforce_eager is not None:
        kwargs["enforce_eager"] = a.enforce_eager == "on"
    return LLM(a.model, **kwargs), kwargs


def timed_generate(llm, prompts, params) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t0, outs


def cmd_pdserve(a) -> None:
    from pdserve import SamplingParams

    cfg, meta = model_meta(a.model)
    w = workload(a.small)
    rng = random.Random(1)
    vocab = cfg["vocab_size"]
    part = f"pdserve-{meta['shape']}"
    t0 = time.perf_counter()
    llm, kwargs = pdserve_engine(a, cfg, w)
    data = {
        "model": meta["shape"],
        "engine_args": {k: v for k, v in kwargs.items()},
        "load_s": round(time.perf_counter() - t0, 2),
    }
    graphs = getattr(llm.engine.runner, "graphs", None)
    data["cuda_graphs"] = bool(graphs is not None and graphs.capture)  # decode steps replay captured graphs

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)

    prompt = random_prompt(rng, w["decode_prompt"], vocab)
    llm.generate([prompt], params(4))  # warm-up: first calls compile, allocate, autotune
    # batch-1 decode: the time of N tokens minus the time of 1 (the prefill and first token)
    t1, _ = timed_generate(llm, [prompt], params(1))
    tn, outs = timed_generate(llm, [prompt], params(w["decode_tokens"]))
    n_out = len(outs[0].outputs[0].token_ids)
    data["decode"] = {
        "prompt_tokens": len(prompt),
        "output_tokens": n_out,
        "first_token_s": t1,
        "total_s": tn,
        "tokens_per_s": (n_out - 1) / max(tn - t1, 1e-9),
        "greedy_ids_head": list(outs[0].outputs[0].token_ids[:16]),
    }
    write_part(a.parts, part, data)
    print(f"pdserve {meta['shape']} batch-1 decode: {data['decode']['tokens_per_s']:.1f} tok/s")

    prompts = [random_prompt(rng, w["batch_prompt"], vocab) for _ in range(w["batch_requests"])]
    llm.generate(prompts[:2], params(2))
    tb, outs = timed_generate(llm, prompts, params(w["batch_tokens"]))
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    data["batch"] = {
        "requests": len(prompts),
        "prompt_tokens": w["batch_prompt"],
        "output_tokens_each": w["batch_tokens"],
        "output_tokens": produced,
        "total_s": tb,
        "output_tokens_per_s": produced / tb,
    }
    write_part(a.parts, part, data)
    print(f"pdserve {meta['shape']} {len(prompts)} requests: {data['batch']['output_tokens_per_s']:.1f} output tok/s")

    long_prompt = random_prompt(rng, w["prefill_prompt"], vocab)
    llm.generate([random_prompt(rng, w["prefill_prompt"], vocab)], params(1))  # warm-up at this length
    ttft, _ = timed_generate(llm, [long_prompt], params(1))
    data["prefill"] = {"prompt_tokens": len(long_prompt), "ttft_s": ttft, "tokens_per_s": len(long_prompt) / ttft}
    write_part(a.parts, part, data)
    print(f"pdserve {meta['shape']} prefill {len(long_prompt)}: TTFT {ttft * 1e3:.1f} ms")
    llm.close()


# ---------------------------------------------------------------- transformers


def cmd_transformers(a) -> None:
    import torch
    import transformers

    cfg, meta = model_meta(a.model)
    w = workload(a.small)
    rng = random.Random(1)  # the same prompt as the pdserve stage's batch-1 decode
    prompt = random_prompt(rng, w["decode_prompt"], cfg["vocab_size"])
    dtype = getattr(torch, a.dtype)
    t0 = time.perf_counter()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype)
    except TypeError:  # transformers before 4.56 names it torch_dtype
        model = transformers.AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=dtype)
    model = model.to(a.device).eval()
    load_s = time.perf_counter() - t0
    ids = torch.tensor([prompt], device=a.device)

    def run(n: int) -> tuple[float, list[int]]:
        sync(a.device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=0,
            )  # fmt: skip
        sync(a.device)
        return time.perf_counter() - start, out[0, ids.shape[1] :].tolist()

    run(4)  # warm-up
    t1, _ = run(1)
    tn, gen = run(w["decode_tokens"])
    data = {
        "model": meta["shape"],
        "transformers_version": transformers.__version__,
        "load_s": round(load_s, 2),
        "decode": {
            "prompt_tokens": len(prompt),
            "output_tokens": len(gen),
            "first_token_s": t1,
            "total_s": tn,
            "tokens_per_s": (len(gen) - 1) / max(tn - t1, 1e-9),
            "greedy_ids_head": gen[:16],
        },
    }
    write_part(a.parts, f"transformers-{meta['shape']}", data)
    print(f"transformers {meta['shape']} batch-1 decode: {data['decode']['tokens_per_s']:.1f} tok/s")


# ---------------------------------------------------------------- report


def read_parts(parts: str) -> dict[str, dict]:
    out = {}
    for p in sorted(Path(parts).glob("*.json")):
        try:
            out[p.stem] = json.loads(p.read_text())
        except ValueError:
            out[p.stem] = {"error": "unreadable part"}
    return out


def get(d: dict, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def model_summary(parts: dict, shape: str, bandwidth: float | None, nominal: float | None) -> dict:
    pd, hf, meta = (
        parts.get(f"pdserve-{shape}", {}),
        parts.get(f"transformers-{shape}", {}),
        parts.get(f"model-{shape}"),
    )
    single = get(pd, "decode", "tokens_per_s")
    batch = get(pd, "batch", "output_tokens_per_s")
    hf_single = get(hf, "decode", "tokens_per_s")
    s: dict = {
        "cuda_graphs": get(pd, "cuda_graphs"),
        "decode_tokens_per_s": single,
        "batch_output_tokens_per_s": batch,
        "prefill_tokens_per_s": get(pd, "prefill", "tokens_per_s"),
        "prefill_ttft_s": get(pd, "prefill", "ttft_s"),
        "transformers_decode_tokens_per_s": hf_single,
        "x_transformers": single / hf_single if single and hf_single else None,
        "batch_over_single": batch / single if single and batch else None,
    }
    read = get(meta, "decode_read_bytes") if meta else None
    s["decode_read_bytes"] = read
    for label, bw in (("measured", bandwidth), ("nominal", nominal)):
        roof = bw / read if bw and read else None
        s[f"roofline_tokens_per_s_{label}"] = roof
        s[f"roofline_pct_{label}"] = 100.0 * single / roof if roof and single else None
    return s


def verdict(value, target) -> str:
    if value is None:
        return "not measured"
    return "met" if value >= target else "missed"


def fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def cmd_report(a) -> int:
    parts = read_parts(a.parts)
    bw = get(parts, "bandwidth", "measured_bytes_per_s")
    nominal = get(parts, "bandwidth", "nominal_bytes_per_s")
    shapes = [s for s in ("llama3-8b", "smollm2-135m", "tiny") if any(k.endswith(s) for k in parts)]
    models = {s: model_summary(parts, s, bw, nominal) for s in shapes}
    parity = parts.get("parity", {"status": "not run"})
    key = models.get("llama3-8b") or (models.get(shapes[0]) if shapes else {})
    targets = {
        "roofline_pct": {"value": get(key, "roofline_pct_measured"), "target": TARGETS["roofline_pct"]},
        "x_transformers": {"value": get(key, "x_transformers"), "target": TARGETS["x_transformers"]},
        "batch_over_single": {"value": get(key, "batch_over_single"), "target": TARGETS["batch_over_single"]},
    }
    for t in targets.values():
        t["verdict"] = verdict(t["value"], t["target"])
    results = {"parity": parity, "bandwidth": parts.get("bandwidth"), "models": models, "targets": targets}
    results["parts"] = parts
    os.makedirs(a.out, exist_ok=True)
    Path(a.out, "results.json").write_text(json.dumps(results, indent=2))
    lines = [
        "# pdserve GPU check",
        "",
        f"Device: {get(parts, 'bandwidth', 'gpu_name') or get(parts, 'bandwidth', 'device') or '?'}",
        f"Parity tests (pytest -m gpu tests/gpu): **{parity.get('status')}**"
        + (f" (exit status {parity['rc']})" if "rc" in parity else ""),
        f"Copy bandwidth: {fmt(bw and bw / 1e12, '.2f')} TB/s measured"
        + (f", {nominal / 1e12:.1f} TB/s nominal" if nominal else ""),
        "",
        "| model | CUDA graphs | decode tok/s (batch 1) | transformers tok/s | x transformers "
        "| roofline tok/s (measured BW) | % roofline | batch out tok/s | batch / single | prefill tok/s | TTFT ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s, m in models.items():
        graphs = {True: "on", False: "off", None: "-"}[m["cuda_graphs"]]
        lines.append(
            f"| {s} | {graphs} | {fmt(m['decode_tokens_per_s'])} | {fmt(m['transformers_decode_tokens_per_s'])} "
            f"| {fmt(m['x_transformers'], '.2f')} | {fmt(m['roofline_tokens_per_s_measured'])} "
            f"| {fmt(m['roofline_pct_measured'])} | {fmt(m['batch_output_tokens_per_s'])} "
            f"| {fmt(m['batch_over_single'], '.1f')} | {fmt(m['prefill_tokens_per_s'], '.0f')} "
            f"| {fmt(m['prefill_ttft_s'] and m['prefill_ttft_s'] * 1e3)} |"
        )
    lines += ["", "Targets (issue #20, on the Llama-3-8B shape):", ""]
    names = {
        "roofline_pct": "batch-1 decode, % of the HBM roofline",
        "x_transformers": "batch-1 decode, x transformers",
        "batch_over_single": "64-request output tok/s / batch-1 tok/s",
    }
    for k, t in targets.items():
        lines.append(f"- {names[k]}: {fmt(t['value'], '.2f')} (target >= {t['target']:g}): {t['verdict']}")
    missing = [s for s in a.expect.split(",") if s and not any(k == s for k in parts)]
    if missing:
        lines += ["", f"Stages without results (failed or timed out; see logs/): {', '.join(missing)}"]
    summary = "\n".join(lines) + "\n"
    Path(a.out, "summary.md").write_text(summary)
    print(summary)
    return 0 if parity.get("status") in ("passed", "skipped on cpu") else 1


# ---------------------------------------------------------------- CLI


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--parts", required=True, help="folder of the stages' JSON files")
        sp.add_argument("--device", default="cuda")
        sp.add_argument("--dtype", default="bfloat16")
        sp.add_argument("--small", action="store_true", help="tiny counts (the CPU test of this flow)")
        return sp

    m = common(sub.add_parser("model"))
    m.add_argument("--shape", choices=sorted(SHAPES), required=True)
    m.add_argument("--dir", required=True)
    common(sub.add_parser("bandwidth"))
    for name in ("pdserve", "transformers"):
        sp = common(sub.add_parser(name))
        sp.add_argument("--model", required=True)
        if name == "pdserve":
            sp.add_argument(
                "--enforce-eager",
                choices=("on", "off"),
                default=None,
                help="pass enforce_eager to LLM (on: no CUDA graphs; default: not passed, the engine's default)",
            )
    r = sub.add_parser("report")
    r.add_argument("--parts", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--expect", default="", help="comma-separated part names that should exist")
    a = p.parse_args(argv)
    handler = {
        "model": cmd_model,
        "bandwidth": cmd_bandwidth,
        "pdserve": cmd_pdserve,
        "transformers": cmd_transformers,
        "report": cmd_report,
    }[a.cmd]
    return handler(a) or 0


if __name__ == "__main__":
    sys.exit(main())
