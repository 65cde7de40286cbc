"""OpenAI response shapes for completions and chat, streamed and whole.

A formatter turns engine outputs (`ChoiceOutput`, engine_client.py: text deltas,
token ids, logprob dicts, the whole completion at the end) into the JSON objects
OpenAI's API returns; it keeps the little
per-choice state a stream needs (text offsets, whether the role was sent).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

from pdserve.server import tool_parsers
from pdserve.server.engine_client import ChoiceOutput, Completion
from pdserve.server.errors import APIError
from pdserve.server.reasoning import ReasoningStream, split

dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; `cached_tokens` given: with its prompt_tokens_details."""
    u = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def cached_prompt_tokens(per_choice: dict[int, int | None], n: int) -> int:
    """Prompt tokens the request found cached: per prompt, the fewest any of its n choices
    found (the other choices hit the blocks the first one computed, which were not cached
    when the request came), summed over the prompts. `per_choice`: by choice index (prompt
    i's choices are i*n .. i*n+n-1); a choice that did not say counts none."""
    fewest: dict[int, int] = {}
    for index, cached in per_choice.items():
        fewest[index // n] = min(fewest.get(index // n, cached or 0), cached or 0)
    return sum(fewest.values())


def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character: the bytes that
    print as themselves keep their code point, the other 68 are moved to 256+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    moved = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + moved)] = b
            moved += 1
    return table


_BYTE_OF_CHAR = _byte_level_decoder()


class TokenText:
    """Token id -> its text and its raw bytes, memoised (logprob responses name every token).

    The text of a token that holds part of a UTF-8 character is not valid on
    its own, so `bytes_of` recovers the real bytes from the byte-level symbols.
    """

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> str:
        s = self._text.get(token_id)
        if s is None:
            s = self._text[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return s

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def bytes_of(self, token_id: int) -> list[int]:
        b = self._bytes.get(token_id)
        if b is None:
            sym = self._tok.id_to_token(token_id) or ""
            if sym and all(c in _BYTE_OF_CHAR for c in sym):
                b = [_BYTE_OF_CHAR[c] for c in sym]
            else:  # a special or added token: its text is its content
                b = list(self(token_id).encode())
            self._bytes[token_id] = b
        return b


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    # the engine's entry is {sampled: lp, **top_k}; the top k are the k largest
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


class _Base:
    object_name = ""
    chunk_object_name = ""
    _delta_key = ""  # where a streamed chunk's text goes: '"text":' or '"delta":{"content":'
    _delta_end = ""

    def __init__(
        self,
        request_id: str,
        model: str,
        token_text: TokenText,
        num_choices: int,
        top_logprobs: int | None,
        *,
        prompt_ids: list[list[int]] | None = None,
        tokens_as_ids: bool = False,
        prompt_logprobs: int | None = None,
    ):
        """`prompt_ids` (per prompt): vLLM's return_token_ids, the prompt's token ids and each
        choice's generated ones go in the response; `tokens_as_ids`: vLLM's
        return_tokens_as_token_ids, logprobs name tokens "token_id:N" rather than by text;
        `prompt_logprobs`: vLLM's, each prompt token's logprob and that many top ones."""
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text
        self.top_logprobs = top_logprobs  # None: no logprobs asked for
        self.num_choices = num_choices
        self.prompt_ids = prompt_ids
        self.tokens_as_ids = tokens_as_ids
        self.prompt_logprobs = prompt_logprobs
        head = dumps({"id": self.id, "object": self.chunk_object_name, "created": self.created, "model": self.model})
        self._chunk_head = head[:-1] + ',"choices":[{"index":'

    def chunk_json(
        self, index: int, out: ChoiceOutput, include_usage: bool, usage_now: dict | None = None
    ) -> str | None:
        """`chunk()` as JSON text. The common chunk (text only, not the last) is written
        straight from a template: it is one per token per stream, the hot path. `usage_now`:
        the choice's usage so far, on every chunk (vLLM's continuous_usage_stats)."""
        if out.finished or self.top_logprobs is not None or self.prompt_ids is not None:
            chunk = self.chunk_with_ids(index, out)
            if chunk is None:
                return None
            if include_usage:
                chunk["usage"] = usage_now  # as OpenAI does: usage only on the last chunk
            return dumps(chunk)
        if not out.new_text:
            return None  # bytes of an unfinished character: nothing to show yet
        tail = f',"usage":{dumps(usage_now)}}}' if include_usage else "}"
        return (
            f"{self._chunk_head}{index},{self._delta_key}{dumps(out.new_text)}{self._delta_end},"
            f'"logprobs":null,"finish_reason":null}}]{tail}'
        )

    def chunk_with_ids(self, index: int, out: ChoiceOutput) -> dict | None:
        """`chunk()`, with the new token ids when they are asked for (return_token_ids): then
        every token is sent, even one whose text is not complete yet."""
        chunk = self.chunk(index, out)
        if self.prompt_ids is None or (chunk is None and not out.new_token_ids):
            return chunk
        if chunk is None:
            chunk = self._envelope(self.chunk_object_name, [self._empty_choice(index)])
        chunk["choices"][0]["token_ids"] = out.new_token_ids
        return chunk

    def _empty_choice(self, index: int) -> dict:
        raise NotImplementedError

    def prompt_logprobs_json(self, c: Completion) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token (the first None: nothing predicts it)
        {token id: {logprob, rank, decoded_token}} of the token itself and the top k, ranks in
        the whole vocabulary; -inf as -9999.0, as vLLM sends it."""
        entries, ranks = c.prompt_logprobs, c.prompt_logprob_ranks or []
        if entries is None:
            raise APIError(502, "the engine returned no prompt logprobs (a worker older than the router?)")
        out: list[dict | None] = []
        for i, entry in enumerate(entries):
            if entry is None:
                out.append(None)
                continue
            (own, own_lp), *_ = entry.items()  # the prompt token first, then the top ones
            row = {str(own): self._logprob_obj(own, own_lp, ranks[i] if i < len(ranks) else None)}
            for rank, (t, lp) in enumerate(_top(entry, self.prompt_logprobs), 1):
                row.setdefault(str(t), self._logprob_obj(t, lp, rank))
            out.append(row)
        return out

    def _logprob_obj(self, token_id: int, lp: float, rank: int | None) -> dict:
        # the token's text even with return_tokens_as_token_ids, as vLLM gives it here
        return {"logprob": max(lp, -9999.0), "rank": rank, "decoded_token": self.token_text(token_id)}

    def label(self, token_id: int) -> str:
        """How logprobs name a token: its text, or "token_id:N" (return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if self.tokens_as_ids else self.token_text(token_id)

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def resume(self, index: int, token_ids: list[int]) -> None:
        """Choice `index` streamed `token_ids` before its stream was resumed elsewhere."""

    def usage_chunk(self, u: dict) -> dict:
        return {**self._envelope(self.chunk_object_name, []), "usage": u}


class CompletionFormatter(_Base):
    object_name = chunk_object_name = "text_completion"
    _delta_key = '"text":'

    def __init__(
        self, *a, echo_texts: list[str] | None = None, echo_ids: list[list[int]] | None = None, n: int = 1, **kw
    ):
        """`echo_texts`: per prompt, the text echoed before each of its choices; with logprobs,
        `echo_ids` are its tokens, listed with their logprobs (the engine's prompt logprobs)
        before the generated ones, as OpenAI's legacy API and vLLM do."""
        super().__init__(*a, **kw)
        self.echo_texts = echo_texts  # per prompt; choice i echoes prompt i // n
        self.echo_ids = echo_ids if echo_texts and self.top_logprobs is not None else None
        self.n = n
        # text offsets run through every listed token, each after the text of the one before
        # (as vLLM counts them): with echo, the prompt's tokens come first
        self._offsets = [0] * self.num_choices
        self._prompt_sent: set[int] = set()
        self._ids_sent: set[int] = set()  # choices whose prompt_token_ids went out (return_token_ids)

    def _logprobs(self, index: int, token_ids: list[int], entries: list[dict | None]) -> dict | None:
        """The legacy logprobs of `token_ids`, offsets continuing the choice's; a None entry
        (the first prompt token's: nothing predicts it) lists the token with null logprobs."""
        if self.top_logprobs is None:
            return None
        tokens, offsets = [], []
        for t in token_ids:
            tokens.append(self.label(t))
            offsets.append(self._offsets[index])
            self._offsets[index] += len(self.token_text(t))
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else e[t] for t, e in zip(token_ids, entries)],
            "top_logprobs": [None if e is None else self._top_dict(t, e) for t, e in zip(token_ids, entries)],
            "text_offset": offsets,
        }

    def _prompt_part(self, index: int, prompt_lps: list[dict | None] | None) -> dict:
        """The echoed prompt's tokens as logprobs, offsets from 0; the generated tokens'
        offsets continue after them. Called before the generated part of the same choice."""
        ids = self.echo_ids[index // self.n]
        if prompt_lps is None or len(prompt_lps) != len(ids):
            raise APIError(502, "the engine returned no logprobs for the prompt (a worker older than the router?)")
        self._offsets[index] = 0
        return self._logprobs(index, ids, prompt_lps)

    @staticmethod
    def _join(a: dict | None, b: dict | None) -> dict | None:
        if a is None or b is None:
            return a if b is None else b
        return {k: a[k] + b[k] for k in a}

    def _top_dict(self, token_id: int, entry: dict[int, float]) -> dict[str, float]:
        items = _top(entry, self.top_logprobs)
        if all(t != token_id for t, _ in items):  # the sampled token is always listed
            items = [(token_id, entry[token_id])] + items
        return {self.label(t): lp for t, lp in items}

    def resume(self, index: int, token_ids: list[int]) -> None:
        listed = list(self.echo_ids[index // self.n]) if self.echo_ids is not None else []
        self._offsets[index] = sum(len(self.token_text(t)) for t in listed + list(token_ids))
        self._prompt_sent.add(index)  # the resumed stream sent the echo already
        self._ids_sent.add(index)

    def _echo(self, index: int) -> str:
        return self.echo_texts[index // self.n] if self.echo_texts else ""

    def _empty_choice(self, index: int) -> dict:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": None}

    def chunk_with_ids(self, index: int, out: ChoiceOutput) -> dict | None:
        chunk = super().chunk_with_ids(index, out)
        if chunk is not None and self.prompt_ids is not None and index not in self._ids_sent:
            self._ids_sent.add(index)  # each choice's first chunk names its prompt's ids
            chunk["choices"][0]["prompt_token_ids"] = self.prompt_ids[index // self.n]
        return chunk

    def preamble(self) -> list[dict]:
        if not self.echo_texts or self.echo_ids is not None:
            return []  # with logprobs the echo goes with the prompt's logprobs, in the first chunk
        return [
            self._envelope(
                self.chunk_object_name, [{"index": i, "text": self._echo(i), "logprobs": None, "finish_reason": None}]
            )
            for i in range(self.num_choices)
        ]

    def chunk(self, index: int, out: ChoiceOutput) -> dict | None:
        if not out.new_text and not out.finished and self.top_logprobs is None:
            return None  # bytes of an unfinished character: nothing to show yet
        prompt_part = None
        if self.echo_ids is not None and index not in self._prompt_sent:
            self._prompt_sent.add(index)
            prompt_part = self._prompt_part(index, out.prompt_logprobs)
        choice = {
            "index": index,
            "text": out.new_text if prompt_part is None else self._echo(index) + out.new_text,
            "logprobs": self._logprobs(index, out.new_token_ids, out.new_logprobs or []),
            "finish_reason": out.final.finish_reason if out.final else None,
        }
        if prompt_part is not None:
            choice["logprobs"] = self._join(prompt_part, choice["logprobs"])
        if out.final:
            choice["stop_reason"] = out.final.stop_reason
        return self._envelope(self.chunk_object_name, [choice])

    def full(self, finals: list[ChoiceOutput], u: dict) -> dict:
        choices = []
        for index, out in enumerate(finals):
            c = out.final
            prompt_part = self._prompt_part(index, c.prompt_logprobs) if self.echo_ids is not None else None
            lps = self._join(prompt_part, self._logprobs(index, c.token_ids, c.logprobs or []))
            choices.append(
                {
                    "index": index,
                    "text": self._echo(index) + c.text,
                    "logprobs": lps,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
            if self.prompt_ids is not None:
                choices[-1] |= {"prompt_token_ids": self.prompt_ids[index // self.n], "token_ids": c.token_ids}
            if self.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = self.prompt_logprobs_json(c)
        return {**self._envelope(self.object_name, choices), "usage": u}


class ChatFormatter(_Base):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    _delta_key = '"delta":{"content":'
    _delta_end = "}"

    def __init__(
        self,
        *args,
        tool_calls=None,
        reasoning: str | None = None,
        include_reasoning: bool = True,
        constrained: bool = False,
        **kw,
    ):
        super().__init__(*args, **kw)
        # protocol.ToolCalls: the output is the arguments of a named function, or a JSON list
        # of calls ("required"); it is returned as `tool_calls`, not as content
        self.tool_calls = tool_calls
        # the reasoning parser (server/reasoning.py): the thinking goes in `reasoning` (and
        # `reasoning_content`), the rest is the answer (and what a tool parser reads)
        self.reasoning = reasoning
        self.include_reasoning = include_reasoning
        self.constrained = constrained  # the output is held to a grammar (reasoning.py)
        self._thinkers: dict[int, ReasoningStream] = {}
        self._streamed: dict[int, list[str]] = {}  # per choice: the pieces of text so far ("required")
        self._headed: set[int] = set()  # choices whose named call's head went out
        self._readers: dict[int, object] = {}  # per choice, tool_choice "auto": tool_parsers.reader
        self._num_calls: dict[int, int] = {}  # per choice: calls streamed so far ("auto")

    def _call(self, name: str, arguments: str, index: int | None = None) -> dict:
        call = {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function"}
        if index is not None:
            call = {"index": index, **call}
        return {**call, "function": {"name": name, "arguments": arguments}}

    def _parsed_calls(self, text: str) -> list[dict] | None:
        """A "required" output's calls ([{name, parameters}]) as OpenAI's tool_calls, or None
        when it is not a complete list (cut by max_tokens, or a grammar that had to end it)."""
        try:
            calls = json.loads(text)
        except (ValueError, RecursionError):
            return None
        if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c for c in calls):
            return None
        return [(c["name"], dumps(c.get("parameters", {}))) for c in calls]

    def _tool_message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a tool-call output, and its finish reason."""
        if self.tool_calls.parser is not None:  # "auto": the calls the model wrote, if any
            content, calls = tool_parsers.parse(text, self.tool_calls.parser)
            if not calls:
                return {"role": "assistant", "content": text}, finish_reason
            if not self.tool_calls.parallel:  # parallel_tool_calls false: the first call only
                calls = calls[:1]
            reason = "tool_calls" if finish_reason == "stop" else finish_reason
            return {"role": "assistant", "content": content, "tool_calls": [self._call(n, a) for n, a in calls]}, reason
        if self.tool_calls.named is not None:
            return {"role": "assistant", "content": None, "tool_calls": [self._call(self.tool_calls.named, text)]}, (
                finish_reason
            )
        calls = self._parsed_calls(text)
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return {"role": "assistant", "content": None, "tool_calls": [self._call(n, a) for n, a in calls]}, reason

    def resume(self, index: int, token_ids: list[int]) -> None:
        # a resumed stream already sent the named call's head (its arguments went out as deltas);
        # a "required" list is sent whole at the end, so the text it had is needed again; an
        # "auto" reader is brought to where the stream was (what it sent is not sent again)
        if not token_ids:
            return
        auto = self.tool_calls is not None and self.tool_calls.parser is not None
        # "auto" reads the text with special tokens kept (a call's tags may be some)
        answer = self.token_text.decode(token_ids, skip_special_tokens=not auto)
        if self.reasoning is not None:  # the splitter goes on from where it was; tools read the answer
            answer = self._thinker(index).feed(answer)[1]
        if self.tool_calls is None:
            return
        if self.tool_calls.named is not None:
            if answer:
                self._headed.add(index)  # the head went out with the first of the answer
        elif self.tool_calls.parser is None:
            self._streamed[index] = [answer]
        else:
            _, calls = self._reader(index).feed(answer)
            self._num_calls[index] = len(calls)

    def _reader(self, index: int):
        r = self._readers.get(index)
        if r is None:
            r = self._readers[index] = tool_parsers.reader(self.tool_calls.parser)
        return r

    def _chunk_logprobs(self, out: ChoiceOutput) -> dict | None:
        return self._logprobs(out.new_token_ids, out.new_logprobs or []) if self.top_logprobs is not None else None

    def _auto_chunk(self, index: int, out: ChoiceOutput) -> dict | None:
        reader = self._reader(index)
        content, calls = reader.feed(out.new_text)
        if out.final:
            more, last = reader.finish()
            content, calls = content + more, calls + last
        delta: dict = {"content": content} if content else {}
        first = self._num_calls.get(index, 0)
        if calls and not self.tool_calls.parallel:  # parallel_tool_calls false: the first call only
            calls = calls[: max(0, 1 - first)]
        if calls:
            self._num_calls[index] = first + len(calls)
            delta["tool_calls"] = [self._call(n, a, first + k) for k, (n, a) in enumerate(calls)]
        if not delta and not out.final and self.top_logprobs is None:
            return None
        reason = out.final.finish_reason if out.final else None
        if reason == "stop" and reader.seen_call:
            reason = "tool_calls"
        return self._delta_chunk(index, out, delta, reason)

    def chunk_json(self, index: int, out: ChoiceOutput, include_usage: bool, usage_now: dict | None = None):
        if self.tool_calls is None and self.reasoning is None:
            return super().chunk_json(index, out, include_usage, usage_now)
        chunk = self.chunk_with_ids(index, out)
        if chunk is None:
            return None
        if include_usage:
            chunk["usage"] = usage_now
        return dumps(chunk)

    def _tool_chunk(self, index: int, out: ChoiceOutput) -> dict | None:
        if self.tool_calls.parser is not None:
            return self._auto_chunk(index, out)
        reason = out.final.finish_reason if out.final else None
        delta: dict = {}
        if self.tool_calls.named is not None:
            if index not in self._headed:
                if out.new_text:  # the call's head, with the first of its arguments (none while it thinks)
                    self._headed.add(index)
                    delta = {"tool_calls": [self._call(self.tool_calls.named, out.new_text, 0)]}
            elif out.new_text:
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": out.new_text}}]}
        else:  # "required": the list is parsed whole, then sent
            self._streamed.setdefault(index, []).append(out.new_text)
            if out.final:
                message, reason = self._tool_message("".join(self._streamed.pop(index)), reason)
                if "tool_calls" in message:
                    delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]}
                else:
                    delta = {"content": message["content"]}
        if not delta and not out.final and self.top_logprobs is None:
            return None
        return self._delta_chunk(index, out, delta, reason)

    def _logprobs(self, token_ids: list[int], entries: list[dict]) -> dict | None:
        if self.top_logprobs is None:
            return None
        content = []
        for t, e in zip(token_ids, entries):
            s = self.label(t)
            top = (
                [
                    {"token": self.label(tt), "logprob": lp, "bytes": self.token_text.bytes_of(tt)}
                    for tt, lp in _top(e, self.top_logprobs)
                ]
                if self.top_logprobs
                else []
            )
            content.append({"token": s, "logprob": e[t], "bytes": self.token_text.bytes_of(t), "top_logprobs": top})
        return {"content": content}

    def _empty_choice(self, index: int) -> dict:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": None}

    def preamble(self) -> list[dict]:
        chunks = [
            self._envelope(
                self.chunk_object_name,
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
            )
            for i in range(self.num_choices)
        ]
        if self.prompt_ids is not None:  # return_token_ids: the prompt's, on each choice's first, as vLLM
            for chunk in chunks:
                chunk["prompt_token_ids"] = self.prompt_ids[0]
        return chunks

    def _thinker(self, index: int) -> ReasoningStream:
        t = self._thinkers.get(index)
        if t is None:
            t = self._thinkers[index] = ReasoningStream(self.reasoning, self.constrained)
        return t

    def chunk(self, index: int, out: ChoiceOutput) -> dict | None:
        if self.reasoning is None:
            return self._answer_chunk(index, out)
        thinker = self._thinker(index)
        thought, answer = thinker.feed(out.new_text)
        if out.final:
            more, rest = thinker.finish()
            thought, answer = thought + more, answer + rest
        chunk = self._answer_chunk(index, dataclasses.replace(out, new_text=answer))
        if thought and self.include_reasoning:
            if chunk is None:
                chunk = self._envelope(self.chunk_object_name, [self._empty_choice(index)])
            chunk["choices"][0]["delta"] |= {"reasoning": thought, "reasoning_content": thought}
        return chunk

    def _answer_chunk(self, index: int, out: ChoiceOutput) -> dict | None:
        if self.tool_calls is not None:
            return self._tool_chunk(index, out)
        if not out.new_text and not out.finished and self.top_logprobs is None:
            return None
        delta = {"content": out.new_text} if out.new_text else {}
        return self._delta_chunk(index, out, delta, out.final.finish_reason if out.final else None)

    def _delta_chunk(self, index: int, out: ChoiceOutput, delta: dict, reason: str | None) -> dict:
        """A streamed chunk of one choice: its delta, the new tokens' logprobs, and at the end
        the finish and stop reasons."""
        choice = {"index": index, "delta": delta, "logprobs": self._chunk_logprobs(out), "finish_reason": reason}
        if out.final:
            choice["stop_reason"] = out.final.stop_reason
        return self._envelope(self.chunk_object_name, [choice])

    def full(self, finals: list[ChoiceOutput], u: dict) -> dict:
        choices = []
        for i, c in enumerate(out.final for out in finals):
            text, thought = c.text, None
            if self.reasoning is not None:
                thought, text = split(c.text, self.reasoning, self.constrained)
            message, reason = {"role": "assistant", "content": text}, c.finish_reason
            if self.tool_calls is not None and text is not None:  # (None: it never stopped thinking)
                message, reason = self._tool_message(text, c.finish_reason)
            if thought is not None and self.include_reasoning:
                message |= {"reasoning": thought, "reasoning_content": thought}
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": self._logprobs(c.token_ids, c.logprobs or []),
                    "finish_reason": reason,
                    "stop_reason": c.stop_reason,
                }
            )
            if self.prompt_ids is not None:
                choices[-1]["token_ids"] = c.token_ids
        out = {**self._envelope(self.object_name, choices), "usage": u}
        if self.prompt_logprobs is not None:  # one prompt: the first choice computed it
            out["prompt_logprobs"] = self.prompt_logprobs_json(finals[0].final)
        if self.prompt_ids is not None:
            out["prompt_token_ids"] = self.prompt_ids[0]
        return out
