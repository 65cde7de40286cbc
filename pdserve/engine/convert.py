"""`pdserve convert`: write a model (default: the embedded GGUF) as a Hugging Face directory.

The output holds config.json, model.safetensors, tokenizer.json and
tokenizer_config.json (with the chat template), so transformers, vLLM or any
other engine can be benchmarked on the very same weights.
"""

from __future__ import annotations

import json
import os
import stat

DTYPES = ("float32", "bfloat16", "float16")


def convert(model: str | None, out_dir: str, dtype: str = "float32") -> str:
    import torch
    from safetensors.torch import save_file

    from pdserve.engine.loader import load_model
    from pdserve.engine.tokenizer import Tokenizer

    loaded = load_model(model)
    tok = Tokenizer.from_loaded(loaded)
    os.makedirs(out_dir, exist_ok=True)
    cfg = loaded.config.to_hf()
    cfg["torch_dtype"] = dtype
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    target = getattr(torch, dtype)
    state = {
        k: v.to(target).contiguous()
        for k, v in loaded.state_dict.items()
        if not (k == "lm_head.weight" and loaded.config.tie_word_embeddings)
    }
    weights = os.path.join(out_dir, "model.safetensors")
    save_file(state, weights, metadata={"format": "pt"})
    # safetensors creates its file 0600; give it the mode open() gave config.json (0666 less the umask)
    os.chmod(weights, stat.S_IMODE(os.stat(os.path.join(out_dir, "config.json")).st_mode))
    tok.save(out_dir)
    return out_dir


def add_arguments(p) -> None:
    from pdserve import flags
    from pdserve.config import EngineConfig, canonical_dtype

    flags.add_arguments(p, [flags.Section(EngineConfig, only=("model",))])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--dtype",
        default="float32",
        type=canonical_dtype,  # bf16 is bfloat16, as everywhere
        choices=DTYPES,
        help="weight dtype on disk; float32 keeps the dequantized GGUF values exactly",
    )


def run(args) -> int:
    from pdserve.engine.loader import ModelLoadError

    try:
        out = convert(args.model, args.out, args.dtype)
    except ModelLoadError as e:
        print(f"pdserve convert: {e}")
        return 2
    print(f"wrote {out}: " + ", ".join(sorted(os.listdir(out))))
    return 0
