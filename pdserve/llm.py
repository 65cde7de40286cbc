"""Offline API in the shape of vLLM's: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Sequence as Seq
from dataclasses import replace

from pdserve.config import EngineConfig
from pdserve.engine.generation_config import sampling_defaults
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import RequestOutput


def _is_ids(p) -> bool:
    return isinstance(p, (list, tuple)) and all(isinstance(t, numbers.Integral) for t in p)


def _listed(x):
    """A numpy array or a tensor as (nested) lists; anything else as it is."""
    return x.tolist() if hasattr(x, "tolist") and not isinstance(x, (str, list, tuple)) else x


def _prompt(p) -> tuple[str | list[int], str | None]:
    """A prompt as the engine takes it (text or token ids), from any form `generate` accepts,
    and the cache salt its dict gives (None: the sampling parameters' own, if any)."""
    p = _listed(p)
    if isinstance(p, dict):
        keys = set(p) - {"multi_modal_data", "mm_processor_kwargs", "cache_salt"}
        salt = p.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError("cache_salt must be a non-empty string if given")
        if keys == {"prompt"} and isinstance(p["prompt"], str):
            return p["prompt"], salt
        ids = _listed(p.get("prompt_token_ids"))
        if keys == {"prompt_token_ids"} and _is_ids(ids):
            return [int(t) for t in ids], salt
        if p.get("multi_modal_data"):
            raise ValueError("multi-modal prompts are not supported")
        raise ValueError(f"a prompt dict needs exactly one of 'prompt' (text) or 'prompt_token_ids', got {sorted(p)}")
    if isinstance(p, str):
        return p, None
    if _is_ids(p):
        return [int(t) for t in p], None
    raise ValueError(f"a prompt is a string, a list of token ids or a dict, not {type(p).__name__} {p!r:.60}")


class LLM:
    """Load a model once, then generate for batches of prompts.

    `model=None` loads the embedded SmolLM2-135M-Instruct. Other keyword
    arguments are engine arguments with vLLM's names (`block_size`,
    `max_num_batched_tokens`, `enable_chunked_prefill`, `dtype`, ...).
    """

    def __init__(
        self,
        model: str | None = None,
        generation_config: str = "auto",
        override_generation_config: dict | None = None,
        **engine_args,
    ):
        """`generation_config`, `override_generation_config`: where the default sampling
        parameters come from, as vLLM's arguments of those names (engine/generation_config.py):
        by default the model directory's generation_config.json."""
        self._defaults = sampling_defaults(model, generation_config, override_generation_config)
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args))
        self.engine.logprob_objects = True  # {token id: Logprob}, as vLLM's LLM gives them
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use without sampling parameters: SamplingParams() with the
        model's generation config applied (vLLM's method of this name)."""
        d = self._defaults
        if d.get("max_tokens") is not None:  # at most the context: a default must not be refused
            d = {**d, "max_tokens": min(d["max_tokens"], self.engine.max_model_len)}
        return SamplingParams(**d)

    def close(self) -> None:
        """Stop background work (the KV store's threads); the object is unusable after."""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Seq[int] | None = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list. A prompt is a string, a list of token ids, or, as
        in vLLM, a dict: `{"prompt": text}` or `{"prompt_token_ids": ids}`, either with an
        optional `"cache_salt"`: the prompt then reuses only KV cached for the same salt.
        `lora_request`: a `LoRARequest` for every prompt, or one (or None) per prompt (the LLM
        made with enable_lora=True), as in vLLM."""
        prompts = _listed(prompts)  # a numpy array or a tensor: one prompt (1-D) or a batch (2-D)
        if isinstance(prompts, (str, dict)) or _is_ids(prompts) and len(prompts) > 0:
            prompts = [prompts]
        prompts = [_prompt(p) for p in prompts]
        params = sampling_params or self.get_default_sampling_params()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must be one object or one per prompt")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("lora_request must be one LoRARequest (or None) or one per prompt")
        adapters: dict[int, str] = {}
        for r in loras:  # the call's adapters stay loaded while the rest of them load
            if r is not None and id(r) not in adapters:
                adapters[id(r)] = self.engine.add_lora(r, keep=adapters.values())
        # n > 1: n independent requests; the prompt's full blocks are shared via the prefix cache.
        order: list[tuple[int, str]] = []
        try:
            for i, ((prompt, salt), p) in enumerate(zip(prompts, params_list)):
                adapter = adapters[id(loras[i])] if loras[i] is not None else p.lora_adapter
                for j in range(p.n):
                    rid = f"offline-{next(self._ids)}"
                    sub = replace(
                        p,
                        n=1,
                        seed=None if p.seed is None else p.seed + j,
                        cache_salt=salt or p.cache_salt,
                        lora_adapter=adapter,
                    )
                    self.engine.add_request(rid, prompt, sub, priority=priority[i] if priority else 0)
                    order.append((i, rid))
            finals = self._run(use_tqdm, len(order))
        except BaseException:
            for _, rid in order:
                self.engine.abort_request(rid)
            raise
        results: list[RequestOutput | None] = [None] * len(prompts)
        for i, rid in order:
            out = finals[rid]
            if results[i] is None:
                results[i] = out
            else:
                comp = out.outputs[0]
                comp.index = len(results[i].outputs)
                results[i].outputs.append(comp)
        return results

    def _run(self, use_tqdm: bool, total: int) -> dict[str, RequestOutput]:
        finals: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            try:
                from tqdm import tqdm

                bar = tqdm(total=total, desc="requests")
            except ImportError:
                bar = None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return finals

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        **kw,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them; the arguments are
        vLLM's, in its order (`continue_final_message`: go on with the last message's text)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.apply_chat_template(
                c,
                add_generation_prompt,
                continue_final_message=continue_final_message,
                template_args=chat_template_kwargs,
                tools=tools,
                chat_template=chat_template,
            )
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, **kw)

    def get_tokenizer(self):
        return self.tokenizer
