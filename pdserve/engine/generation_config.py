"""A model's own sampling defaults: its generation_config.json, applied as vLLM applies it.

Model makers ship recommended sampling settings (Qwen2.5: temperature 0.7, top_p 0.8,
repetition_penalty 1.05; Llama 3: temperature 0.6, top_p 0.9) in `generation_config.json`.
vLLM uses them as the defaults of every request that does not set its own (`--generation-config
auto`, its default), and so does pdserve: a field the request gives wins, a field it leaves out
takes the model's value, and `max_new_tokens` caps `max_tokens` (the request's, or the context
the prompt leaves). `--generation-config vllm` ignores the file (the defaults are then the API's
own); a directory path reads that directory's file instead of the model's;
`--override-generation-config '{"temperature": 0.5}'` sets or replaces single values.
"""

from __future__ import annotations

import json
import os

from pdserve.config import ConfigError

# generation_config.json's name -> SamplingParams' (the fields vLLM takes from it)
KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
FILE = "generation_config.json"


def sampling_defaults(model: str | None, source: str = "auto", overrides: str | dict | None = None) -> dict:
    """The SamplingParams defaults that requests take where they leave a field out.

    `source`: "auto" (the model directory's generation_config.json, if it has one; a GGUF file
    has none), "vllm" (none), or a directory holding one. `overrides`: values by
    generation_config's names (JSON text or a dict) that replace the file's. Raises ConfigError
    for a file or override that cannot be read or holds a value no request could."""
    if source == "vllm":
        path = None
    elif source == "auto":
        path = os.path.join(model, FILE) if model and os.path.isdir(model) else None
    else:
        path = os.path.join(source, FILE)
        if not os.path.isfile(path):
            raise ConfigError(f"--generation-config {source}: no {FILE} there (or 'auto', 'vllm')")
    cfg: dict = {}
    if path is not None and os.path.isfile(path):
        try:
            with open(path) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {path}: {e}") from e
        if not isinstance(cfg, dict):
            raise ConfigError(f"{path} is not a JSON object")
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except ValueError as e:
            raise ConfigError(f"--override-generation-config is not JSON: {e}") from e
    if overrides is not None and not isinstance(overrides, dict):
        raise ConfigError("--override-generation-config is a JSON object, e.g. '{\"temperature\": 0.5}'")
    unknown = sorted(set(overrides or {}) - set(KEYS))
    if unknown:
        raise ConfigError(f"--override-generation-config: unknown {unknown}; known: {sorted(KEYS)}")
    merged = {**{k: v for k, v in cfg.items() if k in KEYS and v is not None}, **(overrides or {})}
    out = {KEYS[k]: v for k, v in merged.items()}
    from pdserve.engine.sampling_params import InvalidRequest, SamplingParams

    try:
        SamplingParams(**out)  # a default no request could carry is the operator's mistake, found now
    except (InvalidRequest, TypeError) as e:
        raise ConfigError(f"the generation config's defaults {out}: {e}") from e
    return out


def with_defaults(given: dict, defaults: dict, max_tokens: int | None) -> tuple[dict, int | None]:
    """A request's sampling fields (`given`: those it set) over the defaults, and its max_tokens
    capped by the default's, as vLLM caps it."""
    fields = {k: v for k, v in defaults.items() if k != "max_tokens"}
    most = defaults.get("max_tokens")
    if most is not None:
        max_tokens = most if max_tokens is None else min(max_tokens, most)
    return {**fields, **given}, max_tokens
