"""Structured outputs: generation held to a JSON schema, a regex, a choice or a grammar.

Each constrained sequence has a matcher (llguidance's ``LLMatcher``: an Earley parser over the
grammar with a lexer, which knows the tokenizer's vocabulary). Before every sampling step the
matcher gives the set of tokens that keep the output a valid prefix of the language; every
other token's logit becomes -inf, then sampling runs as usual (greedy, temperature, top-p ...).
Once the grammar is complete only an end-of-sequence token is allowed, so the request ends
with finish reason "stop".

The matcher follows the sequence's output rather than the sampler's choices: before each step
it consumes whatever output tokens it has not seen. So a sequence that arrives with tokens
already generated (a decode worker continuing what a prefill worker sampled first, or a request
replayed after its worker died) is checked and continued from where it is.

The grammar is compiled when the request arrives (the servers do it on a thread of its own,
not the engine's, and the engine then finds it in a cache keyed by the constraint's content):
a schema or regex that does not compile is the request's 400, never a failed step. Compiling
runs on a thread with a large stack, since the library builds a grammar recursively and a long
chain of rules would otherwise overflow the stack and kill the process. The parser's own limits
bound what one grammar may cost (lexer states, Earley items per step, grammar size); each
sequence's matcher is a copy of the compiled one (a microsecond), never a new compile.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict

import numpy as np
import torch

from pdserve.engine.sampling_params import InvalidRequest, StructuredOutputsParams

log = logging.getLogger(__name__)

# What one request's grammar may cost. llguidance's defaults allow ~250k lexer states (1-2 kB
# each): fine for one trusted caller, not for a server shared by many.
_LIMITS = {
    "max_lexer_states": 20_000,
    "max_grammar_size": 100_000,
    "step_lexer_fuel": 200_000,  # ~15 ms of lexer work per token at most
    "step_max_items": 50_000,
}
# Compiled grammars kept for reuse (a request's choices, the same schema sent again)
CACHE_SIZE = 128
# The stack of the thread that compiles: the library recurses once per rule of a chain
_STACK_BYTES = 256 << 20
_stack_lock = threading.Lock()

# Whitespace a JSON output may hold between two tokens: enough for pretty-printing, bounded so
# that a model fond of blank space cannot spend its whole budget on it (the library's default
# allows any run of it, and a small model will take that).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{1,32}"


def _on_big_stack(fn, *args):
    """fn(*args) on a new thread with a large stack; its result, or what it raised."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # handed to the caller
            box["error"] = e

    with _stack_lock:  # the size applies to threads started while it is set
        try:
            old = threading.stack_size(_STACK_BYTES)
        except (ValueError, RuntimeError):  # a platform that cannot size thread stacks
            return fn(*args)
        try:
            t = threading.Thread(target=run, name="pdserve-grammar", daemon=True)
            t.start()
        finally:
            threading.stack_size(old)
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _schema_text(schema) -> str:
    """A JSON schema as JSON text: the library parses text with a depth limit, where it would
    walk a deeply nested Python object recursively."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as e:
            raise InvalidRequest(f"the JSON schema is not JSON: {e}", "structured_outputs") from None
        except RecursionError:
            raise InvalidRequest("the JSON schema is nested too deeply", "structured_outputs") from None
        if not isinstance(parsed, dict):
            raise InvalidRequest("the JSON schema must be an object", "structured_outputs")
        return schema
    try:
        return json.dumps(schema, sort_keys=True)
    except RecursionError:
        raise InvalidRequest("the JSON schema is nested too deeply", "structured_outputs") from None
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"the JSON schema is not JSON: {e}", "structured_outputs") from None


def cache_key(so: StructuredOutputsParams) -> tuple:
    """What the compiled grammar depends on: the constraint's content, not its object."""
    kind = so.kind
    if kind == "json":
        content = _schema_text(so.json)
    elif kind == "choice":
        content = json.dumps(so.choice)
    elif kind == "json_object":
        content = ""
    else:
        content = getattr(so, kind)
    return kind, content, bool(so.disable_any_whitespace)


def _json_options(disable_any_whitespace: bool, schema_text: str = "") -> dict:
    """(defaults, overrides) of the JSON compiler: a schema's own "x-guidance" whitespace
    options replace the default bound, and disable_any_whitespace wins over both."""
    if disable_any_whitespace:
        return {"defaults": None, "overrides": {"whitespace_flexible": False, "whitespace_pattern": None}}
    try:
        own = json.loads(schema_text).get("x-guidance") if schema_text else None
    except (ValueError, RecursionError, AttributeError):
        own = None
    if isinstance(own, dict) and ("whitespace_pattern" in own or "whitespace_flexible" in own):
        return {"defaults": None, "overrides": None}
    return {"defaults": {"whitespace_pattern": JSON_WHITESPACE}, "overrides": None}


def _grammar_text(key: tuple) -> str:
    """The constraint as llguidance's grammar text (not yet checked)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    kind, content, compact = key
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(content, **_json_options(compact, content))
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', **_json_options(compact))
    if kind == "regex":
        return LLMatcher.grammar_from_regex(content)
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(content)))
    try:  # Lark as it is; GBNF (llama.cpp's, vLLM's "grammar") converted to Lark
        lark = any_to_lark(content)
    except Exception as e:  # the converter's own errors (RecursionError too): the grammar is at fault
        raise InvalidRequest(f"the grammar is neither Lark nor GBNF: {e}", "structured_outputs") from None
    return LLMatcher.grammar_from_lark(lark)


def _error_line(err: str) -> str:
    """The library's error without the parser state it dumps with it (kilobytes of tokens)."""
    for line in err.splitlines():
        if line.startswith("Error:"):
            return line[len("Error:") :].strip()[:300]
    return (err.strip().splitlines() or [""])[0][:300]


class CompiledGrammar:
    """A checked grammar: a matcher in its start state that sequences copy."""

    __slots__ = ("key", "template")

    def __init__(self, key: tuple, template):
        self.key, self.template = key, template


class StructuredOutputs:
    """Compiles requests' constraints (cached by content) and keeps one matcher per
    constrained sequence.

    Built by the engine; the tokenizer's vocabulary is read into llguidance on the first
    constrained request (a quarter of a second for 49k tokens), not at start-up."""

    def __init__(self, tokenizer, eos_token_ids, vocab_size: int):
        self._hf_tokenizer = tokenizer.backend  # a `tokenizers.Tokenizer`
        self.vocab_size = vocab_size  # the model's logits, which may be wider than the vocabulary
        # the end-of-sequence tokens the tokenizer has (the model's config may name others)
        known = self._hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids if 0 <= int(t) < known)
        self._lltok = None
        self._limits = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._guides: dict[str, _Guide] = {}

    def _tokenizer(self):
        with self._lock:
            if self._lltok is None:
                if not self.eos_token_ids:
                    raise InvalidRequest(
                        "structured outputs need an end-of-sequence token, and this model's tokenizer has none",
                        "structured_outputs",
                    )
                import llguidance

                self._lltok = llguidance.LLTokenizer(self._hf_tokenizer.to_str(), eos_token=self.eos_token_ids)
                self._limits = llguidance.LLParserLimits(**_LIMITS)
            return self._lltok

    def compile(self, so: StructuredOutputsParams) -> CompiledGrammar:
        """The checked grammar, from the cache or compiled now; InvalidRequest (a 400) when it
        does not compile. Thread-safe: the servers call it off the engine thread."""
        key = cache_key(so)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = _on_big_stack(self._build, key, self._tokenizer())
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, key: tuple, tok) -> CompiledGrammar:
        from llguidance import LLMatcher

        try:
            grammar = _grammar_text(key)
        except ValueError as e:  # InvalidRequest is one too
            if isinstance(e, InvalidRequest):
                raise
            raise InvalidRequest(f"structured_outputs: {e}", "structured_outputs") from None
        matcher = LLMatcher(tok, grammar, limits=self._limits, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"structured_outputs: {matcher.get_error().strip()}", "structured_outputs")
        return CompiledGrammar(key, matcher)

    def forget(self, seq_id: str) -> None:
        self._guides.pop(seq_id, None)

    def allowed(self, seq_id: str, so: StructuredOutputsParams, output: list[int], start: int = 0) -> torch.Tensor:
        """[vocab] bool, on the host: the tokens that keep this sequence's output valid, its
        output so far (from `start` on: what a reasoning model wrote after its thinking)
        consumed first."""
        guide = self._guides.get(seq_id)
        if guide is None or guide.consumed > len(output):  # new, or the id was reused
            guide = self._guides[seq_id] = _Guide(self, self.compile(so), seq_id)
            guide.consumed = start
        guide.consume(output)
        return guide.allowed()


class _Guide:
    """One sequence's matcher and how many of its output tokens it has consumed."""

    __slots__ = ("owner", "matcher", "consumed", "bitmask", "failed", "seq_id")

    def __init__(self, owner: StructuredOutputs, compiled: CompiledGrammar, seq_id: str):
        self.owner = owner
        self.matcher = compiled.template.deep_copy()
        self.consumed = 0
        self.bitmask = torch.zeros((owner._lltok.vocab_size + 31) // 32, dtype=torch.int32)
        self.failed = False
        self.seq_id = seq_id

    def _fail(self, why: str) -> None:
        # the output cannot be held to the grammar any more: the mask lets only EOS through
        self.failed = True
        log.warning("request %s: its structured output ends here: %s", self.seq_id, _error_line(why))

    def consume(self, output: list[int]) -> None:
        for t in output[self.consumed :]:
            if self.failed or self.matcher.is_stopped():
                break
            if not self.matcher.consume_token(t):
                # a token the grammar did not allow (one generated elsewhere), or a limit reached
                self._fail(self.matcher.get_error() or f"token {t} is outside the grammar")
        self.consumed = len(output)

    def allowed(self) -> torch.Tensor:
        vocab = self.owner.vocab_size
        if not self.failed and self.matcher.is_error():  # a parser limit reached while computing
            self._fail(self.matcher.get_error())
        if self.failed or self.matcher.is_stopped():
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[[t for t in self.owner.eos_token_ids if t < vocab]] = True
            return mask
        self.matcher.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.bitmask.numel() * 4)
        if self.matcher.is_error():
            return self.allowed()
        # bit t % 32 of word t // 32 is token t; the words are little-endian
        bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), bitorder="little")
        mask = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, bits.size)
        mask[:n] = torch.from_numpy(bits[:n])
        if not mask.any():  # the parser found nothing to extend it with
            self._fail("no token can continue it")
            return self.allowed()
        return mask
