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

The grammar is compiled when the request is added: a schema or regex that does not compile is
the request's 400, never a failed step. The parser's own limits bound what one grammar may
cost (lexer states, Earley items per step, grammar size).
"""

from __future__ import annotations

import json
import logging
import threading

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


# Whitespace a JSON output may hold between two tokens: enough for pretty-printing, bounded so
# that a model fond of blank space cannot spend its whole budget on it (the library's default
# allows any run of it, and a small model will take that).
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{1,32}"


def _json_options(so: StructuredOutputsParams) -> dict:
    """(defaults, overrides) of the JSON compiler: a schema's own "x-guidance" options come
    between them, so a caller can widen the whitespace, and disable_any_whitespace wins."""
    if so.disable_any_whitespace:
        return {"defaults": None, "overrides": {"whitespace_flexible": False}}
    return {"defaults": {"whitespace_pattern": JSON_WHITESPACE}, "overrides": None}


def _grammar_text(so: StructuredOutputsParams) -> str:
    """The request's constraint as llguidance's grammar text (not yet checked)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    kind = so.kind
    if kind == "json":
        schema = so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InvalidRequest(f"the JSON schema is not JSON: {e}", "structured_outputs") from None
        if not isinstance(schema, dict):
            raise InvalidRequest("the JSON schema must be an object", "structured_outputs")
        return LLMatcher.grammar_from_json_schema(schema, **_json_options(so))
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, **_json_options(so))
    if kind == "regex":
        return LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    try:  # Lark as it is; GBNF (llama.cpp's, vLLM's "grammar") converted to Lark
        lark = any_to_lark(so.grammar)
    except Exception as e:  # the converter's own errors: the caller's grammar is at fault
        raise InvalidRequest(f"the grammar is neither Lark nor GBNF: {e}", "structured_outputs") from None
    return LLMatcher.grammar_from_lark(lark)


class StructuredOutputs:
    """Compiles requests' constraints and keeps one matcher per constrained sequence.

    Built by the engine; the tokenizer's vocabulary is read into llguidance on the first
    constrained request (a quarter of a second for 49k tokens), not at start-up."""

    def __init__(self, tokenizer, eos_token_ids, vocab_size: int):
        self._hf_tokenizer = tokenizer.backend  # a `tokenizers.Tokenizer`
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self.vocab_size = vocab_size  # the model's logits, which may be wider than the vocabulary
        self._lltok = None
        self._limits = None
        self._lock = threading.Lock()
        self._guides: dict[str, _Guide] = {}

    def _tokenizer(self):
        with self._lock:
            if self._lltok is None:
                import llguidance

                self._lltok = llguidance.LLTokenizer(self._hf_tokenizer.to_str(), eos_token=self.eos_token_ids)
                self._limits = llguidance.LLParserLimits(**_LIMITS)
            return self._lltok

    def compile(self, so: StructuredOutputsParams) -> str:
        """The checked grammar text; InvalidRequest (a 400) when it does not compile."""
        from llguidance import LLMatcher

        tok = self._tokenizer()
        try:
            grammar = _grammar_text(so)
        except ValueError as e:
            raise InvalidRequest(f"structured_outputs: {e}", "structured_outputs") from None
        err = LLMatcher.validate_grammar(grammar, tok, limits=self._limits)
        if err and not err.startswith("WARNING"):
            raise InvalidRequest(f"structured_outputs: {err.strip()}", "structured_outputs")
        return grammar

    def forget(self, seq_id: str) -> None:
        self._guides.pop(seq_id, None)

    def allowed(self, seq_id: str, so: StructuredOutputsParams, output: list[int], device) -> torch.Tensor:
        """[vocab] bool: the tokens that keep this sequence's output valid, its output so far
        consumed first."""
        guide = self._guides.get(seq_id)
        if guide is None or guide.consumed > len(output):  # new, or the id was reused
            guide = self._guides[seq_id] = _Guide(self, so)
        guide.consume(output)
        return guide.allowed(device)


class _Guide:
    """One sequence's matcher and how many of its output tokens it has consumed."""

    __slots__ = ("owner", "matcher", "consumed", "bitmask", "failed")

    def __init__(self, owner: StructuredOutputs, so: StructuredOutputsParams):
        from llguidance import LLMatcher

        self.owner = owner
        grammar = getattr(so, "_grammar", None) or owner.compile(so)
        self.matcher = LLMatcher(owner._tokenizer(), grammar, limits=owner._limits, log_level=0)
        self.consumed = 0
        self.bitmask = torch.zeros((owner._lltok.vocab_size + 31) // 32, dtype=torch.int32)
        self.failed = False

    def consume(self, output: list[int]) -> None:
        for t in output[self.consumed :]:
            if not self.failed and not self.matcher.is_stopped() and not self.matcher.consume_token(t):
                # a token the grammar did not allow (one generated elsewhere, or a parser limit
                # reached): the rest of the output can only end it
                self.failed = True
                log.warning("structured output left its grammar: %s", self.matcher.get_error() or "token refused")
        self.consumed = len(output)

    def allowed(self, device) -> torch.Tensor:
        vocab = self.owner.vocab_size
        if self.failed or self.matcher.is_stopped():
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[[t for t in self.owner.eos_token_ids if t < vocab]] = True
            return mask.to(device)
        self.matcher.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.bitmask.numel() * 4)
        # bit t % 32 of word t // 32 is token t; the words are little-endian
        bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), bitorder="little")
        mask = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, bits.size)
        mask[:n] = torch.from_numpy(bits[:n])
        if not mask.any():  # the parser found nothing to extend it with (a limit): end it
            self.failed = True
            return self.allowed(device)
        return mask.to(device)
