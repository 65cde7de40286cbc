"""Tokenizer and chat template, read from the same source as the weights.

A Hugging Face directory brings its own tokenizer.json; a GGUF file carries the
vocabulary, merges, special tokens and chat template in its metadata, from
which we build an equivalent `tokenizers` BPE tokenizer.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from pdserve.engine.loader import LoadedModel, ModelLoadError, gguf_field, model_dir_files

# Pre-tokenizer regexes named by GGUF's `tokenizer.ggml.pre` (the split rules the
# original tokenizers use; digits are split one by one for SmolLM).
_GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_after(regex: str | None, digits: bool = False):
    steps = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if regex is not None:
        steps.append(pre_tokenizers.Split(Regex(regex), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex is None))
    return pre_tokenizers.Sequence(steps)


_PRE_TOKENIZERS = {
    "smollm": lambda: _byte_level_after(None, digits=True),
    "gpt2": lambda: _byte_level_after(None),
    "default": lambda: _byte_level_after(None),
    "llama-bpe": lambda: _byte_level_after(_LLAMA3_RE),
    "llama3": lambda: _byte_level_after(_LLAMA3_RE),
    "qwen2": lambda: _byte_level_after(_QWEN2_RE),
}


class Tokenizer:
    """Encode/decode plus chat template; the engine sees only this class."""

    def __init__(
        self, tok: HFTokenizer, *, bos_token_id=None, eos_token_ids=(), add_bos=False, chat_template: str | None = None
    ):
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = [int(i) for i in eos_token_ids]
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = {t_id for t_id, t in tok.get_added_tokens_decoder().items() if t.special}
        self._template = None

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` tokenizer underneath (structured outputs read its vocabulary)."""
        return self._tok

    # ---- construction
    @classmethod
    def from_loaded(cls, loaded: LoadedModel) -> Tokenizer:
        if loaded.gguf_reader is not None:
            return cls.from_gguf(loaded.gguf_reader)
        return cls.from_hf_dir(loaded.source, loaded.config.bos_token_id, loaded.config.eos_token_id)

    @classmethod
    def from_gguf(cls, reader) -> Tokenizer:
        kind = gguf_field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(
                f"GGUF tokenizer model {kind!r} is not supported (only BPE 'gpt2'); "
                "pass a Hugging Face directory with tokenizer.json instead"
            )
        tokens = gguf_field(reader, "tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges") or ()]
        types = gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
        tok = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
        pre = gguf_field(reader, "tokenizer.ggml.pre", "default")
        if pre not in _PRE_TOKENIZERS:
            raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} is not supported")
        tok.pre_tokenizer = _PRE_TOKENIZERS[pre]()
        tok.decoder = decoders.ByteLevel()
        # CONTROL (3) and USER_DEFINED (4) tokens must be matched whole, before BPE.
        special = [AddedToken(tokens[i], special=True, normalized=False) for i, ty in enumerate(types) if ty in (3, 4)]
        tok.add_special_tokens(special)
        eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
        return cls(
            tok,
            bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=[] if eos is None else [eos],
            add_bos=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
            chat_template=gguf_field(reader, "tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str, bos_token_id=None, eos_token_ids=()) -> Tokenizer:
        files = model_dir_files(path)
        if "tokenizer.json" not in files:
            raise ModelLoadError(f"{path} has no tokenizer.json")
        tok = HFTokenizer.from_file(files["tokenizer.json"])
        cfg = json.load(open(files["tokenizer_config.json"])) if "tokenizer_config.json" in files else {}
        template = cfg.get("chat_template")
        if "chat_template.jinja" in files:
            template = open(files["chat_template.jinja"]).read()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        eos = list(eos_token_ids)
        if not eos and isinstance(cfg.get("eos_token"), str):
            eos = [tok.token_to_id(cfg["eos_token"])]
        return cls(
            tok,
            bos_token_id=bos_token_id,
            eos_token_ids=eos,
            add_bos=False,  # tokenizer.json's post-processor adds BOS where the model wants it
            chat_template=template,
        )

    # ---- use
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        template_args: dict | None = None,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        documents: list[dict] | None = None,
    ) -> str:
        """The conversation as the model's prompt. `continue_final_message`: the text ends
        with the last message's content, for the model to go on with it (no end-of-turn after
        it), as transformers and vLLM do. `template_args`: more variables for the template
        (vLLM's chat_template_kwargs); they never replace the ones set here, `tools` among them.
        `chat_template`: another template than the model's (offline, as vLLM's LLM.chat takes).
        `documents`: for retrieval-augmented templates, as transformers passes them."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if chat_template is not None:
            template = _compile_cached(chat_template)
        elif not self.chat_template:
            raise ValueError("this model has no chat template; use a plain prompt")
        else:
            if self._template is None:
                self._template = _compile_template(self.chat_template)
            template = self._template
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        fixed = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": bos,
            "eos_token": eos,
        }
        if tools:
            fixed["tools"] = tools
        if documents:
            fixed["documents"] = documents
        text = template.render({**(template_args or {}), **fixed})
        if continue_final_message:
            last = messages[-1].get("content") if messages else None
            if not isinstance(last, str) or not last.strip() or last.strip() not in text:
                raise ValueError("continue_final_message: the last message's content is not in the rendered prompt")
            at = text.rindex(last.strip())
            # the template may have trimmed the content's trailing space: keep what it kept
            kept = last.lstrip() if text[at : at + len(last.lstrip())] == last.lstrip() else last.strip()
            text = text[: at + len(kept)]
        return text

    def save(self, out_dir: str) -> None:
        """Write tokenizer.json + tokenizer_config.json (with the chat template)."""
        self._tok.save(os.path.join(out_dir, "tokenizer.json"))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None,
            "eos_token": self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None,
            "add_bos_token": self.add_bos,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 30,
        }
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, indent=2, ensure_ascii=False)


@functools.lru_cache(maxsize=16)
def _compile_cached(source: str):
    """Templates given per call (offline, or a trusted request's): compiled once each."""
    return _compile_template(source)


# what one product in a template may make: chat templates multiply short separators, never more
_TEMPLATE_MAX_PRODUCT = 1 << 20


def _compile_template(source: str):
    """A chat template, rendered in Jinja's sandbox (a template is code: it must reach nothing).
    `"x" * n` and `a ** b` are bounded too: the sandbox caps `range`, not these, and one such
    product in a template could ask for gigabytes (or a number of a million digits)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if (
                        isinstance(seq, (str, list, tuple))
                        and isinstance(n, int)
                        and len(seq) * n > _TEMPLATE_MAX_PRODUCT
                    ):
                        raise SecurityError(f"the template makes a sequence of over {_TEMPLATE_MAX_PRODUCT} items")
            if operator == "**" and isinstance(right, int) and isinstance(left, int) and abs(right) > 64:
                raise SecurityError("the template raises to a power over 64")
            return super().call_binop(context, operator, left, right)

    def raise_exception(msg):
        raise ValueError(msg)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting a UTF-8 char.

    Decodes a short window of recent tokens; text that ends in the replacement
    character is an incomplete byte sequence and is held back until it completes.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens=True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-6:])  # context so leading spaces decode right
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def step(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full_text = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""
