"""Reading tool calls out of a model's own output (`tool_choice: "auto"`).

With "auto" the model decides between answering and calling, and writes calls in the syntax
its chat template taught it; a parser for that syntax turns them into OpenAI's `tool_calls`.
vLLM's flags choose one: `--enable-auto-tool-choice --tool-call-parser NAME`, with vLLM's names:

`hermes`: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2.5
and Qwen3 and the many models trained on their format). Text outside the tags is the message's
content. A block that is not such JSON stays in the content, tags and all, as the model wrote it.
Streamed, text is passed on as content until a tag may be starting (a suffix that is a prefix
of `<tool_call>` is held back); a call is sent whole once its closing tag arrives (its arguments
complete, as one delta); at the end, what is held goes out as content.

`llama3_json` (Llama 3.1-3.3): the whole answer is one or more JSON objects `{"name": ...,
"parameters": {...}}` (or "arguments"), separated by `;`, perhaps after `<|python_tag|>`.
`pythonic` (Llama 3.2 and 4, and others): the whole answer is a Python list of calls with
keyword arguments, `[get_weather(city="Paris"), add(a=1, b=2)]` (Llama 4 wraps it in
`<|python_start|>`...`<|python_end|>`); only literal values are read, nothing is evaluated.
`mistral`: text, then `[TOOL_CALLS]` and the calls: a JSON list of `{"name", "arguments"}`, or
(newer tokenizers) `name[ARGS]{...}` or `name{...}`, each after its own `[TOOL_CALLS]`.
For these three an answer that starts like calls (or, for mistral, the text after the marker) is
held until the output ends and read then: calls if it parses as calls, else the text as written.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _call(block: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one block's JSON, or None if it is not a call."""
    try:
        obj = json.loads(block, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # not JSON, NaN or Infinity, or nested past the parser
        return None
    return _call_of(obj, needs_arguments=False)


def _call_of(obj, needs_arguments: bool) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a parsed call object, or None if it is not one. Without
    `arguments` (or `parameters`) it is a call only where the syntax marks it as one (hermes'
    tags): a JSON answer with a "name" in it is not a call. Arguments that do not make valid
    JSON (a number past float range reads as infinity) are not a call either."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if needs_arguments and "arguments" not in obj and "parameters" not in obj:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return obj["name"], args
    return _dumped(obj["name"], args)


def _dumped(name: str, args) -> tuple[str, str] | None:
    try:
        return name, json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return None


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse(text: str, parser: str = "hermes") -> tuple[str | None, list[tuple[str, str]]]:
    """The whole output's content (None when it is only calls and blank space) and its calls."""
    stream = reader(parser)
    content, calls = stream.feed(text)
    more_content, more_calls = stream.finish()
    content += more_content
    calls += more_calls
    if calls and not content.strip():
        return None, calls
    return content.strip() if calls else content, calls


@dataclass
class HermesStream:
    """One choice's output as it streams: `feed` returns what can be sent now.

    Inside a call the text is kept in pieces and only its last few characters are searched
    again for the closing tag, so a long call costs linear time, not quadratic. Blank text
    after a call is held until more text shows it is part of an answer (then it goes out in
    front of it) or the output ends (then it is dropped): the space around calls is no answer."""

    held: str = ""  # outside a call: a suffix that may begin the opening tag
    in_call: bool = False
    seen_call: bool = False
    blank: str = ""  # blank text after a call, not yet sent
    parts: list = field(default_factory=list)  # inside a call: its text so far
    tail: str = ""  # inside a call: the last characters, where a closing tag may be starting

    def _content(self, text: str) -> str:
        if not self.seen_call:
            return text
        if not text.strip():
            self.blank += text
            return ""
        text, self.blank = self.blank + text, ""
        return text

    def feed(self, new_text: str) -> tuple[str, list[tuple[str, str]]]:
        content, calls = "", []
        text = new_text
        while True:
            if not self.in_call:
                text, self.held = self.held + text, ""
                i = text.find(_OPEN)
                if i >= 0:
                    content += self._content(text[:i])
                    text, self.in_call, self.parts, self.tail = text[i + len(_OPEN) :], True, [], ""
                    continue
                k = next((k for k in range(min(len(_OPEN) - 1, len(text)), 0, -1) if _OPEN.startswith(text[-k:])), 0)
                content += self._content(text[: len(text) - k])
                self.held = text[len(text) - k :]
                break
            window = self.tail + text
            j = window.find(_CLOSE)
            if j < 0:
                self.parts.append(text)
                self.tail = window[-(len(_CLOSE) - 1) :]
                break
            cut = j - len(self.tail)  # where the closing tag starts in `text` (< 0: in earlier text)
            body = "".join(self.parts) + text[: max(cut, 0)]
            if cut < 0:
                body = body[:cut]
            call = _call(body)
            if call is None:  # not a call after all: the model's text, as it wrote it
                content += self._content(_OPEN + body + _CLOSE)
            else:
                calls.append(call)
                self.seen_call = True
            text, self.in_call, self.parts, self.tail = text[cut + len(_CLOSE) :], False, [], ""
        return content, calls

    def finish(self) -> tuple[str, list[tuple[str, str]]]:
        """What is held at the end: a call whose closing tag never came (the model stopped
        right after its JSON) if it parses, else the text."""
        if self.in_call:
            body, self.in_call, self.parts, self.tail = "".join(self.parts), False, [], ""
            call = _call(body)
            if call is not None:
                self.seen_call = True
                return "", [call]
            return self._content(_OPEN + body), []
        held, self.held = self.held, ""
        return self._content(held), []


# ---- the syntaxes read once the output has ended


def _json_calls(text: str) -> list[tuple[str, str]] | None:
    """llama3_json: JSON call objects separated by `;` (or blank space), and nothing else."""
    dec, calls, i = json.JSONDecoder(parse_constant=_no_constant), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (calls and text[i] == ";")):
            i += 1
        if i == len(text):
            return calls or None
        try:
            obj, i = dec.raw_decode(text, i)
        except (ValueError, RecursionError):
            return None
        call = _call_of(obj, needs_arguments=True)
        if call is None:
            return None
        calls.append(call)


def _literal(node: ast.AST):
    return ast.literal_eval(node)  # constants, lists, dicts, tuples, sets: nothing runs


def _pythonic_calls(text: str) -> list[tuple[str, str]] | None:
    """pythonic: `[f(a=1), g(b="x")]`: a list of calls by name with literal keyword arguments."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        # a call of a plain name (as vLLM's parser reads them), keyword arguments only
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
            return None
        try:
            args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):  # not a literal
            return None
        call = _dumped(node.func.id, args) if len(args) == len(node.keywords) else None  # not **kwargs
        if call is None:
            return None
        calls.append(call)
    return calls


_MISTRAL = "[TOOL_CALLS]"
# one optional run of blanks on each side of [ARGS]: adjacent `\s*`s backtrack quadratically
_MISTRAL_NAMED = re.compile(r"([A-Za-z_][\w.\-]*)\s*(?:\[ARGS\]\s*)?(?=\{)")


def _mistral_calls(text: str) -> list[tuple[str, str]] | None:
    """The text after the first [TOOL_CALLS]: a JSON list (or one object) of calls, or segments
    `name[ARGS]{...}` / `name{...}`, each after its own [TOOL_CALLS]."""
    calls = []
    dec = json.JSONDecoder(parse_constant=_no_constant)
    for segment in text.split(_MISTRAL):
        segment = segment.strip()
        if segment[:1] in ("[", "{"):  # a list of calls (or one): what follows it is ignored, as vLLM
            try:
                obj, _ = dec.raw_decode(segment)
            except (ValueError, RecursionError):
                return None
            found = [_call_of(o, needs_arguments=True) for o in (obj if isinstance(obj, list) else [obj])]
            if not found or None in found:
                return None
            calls += found
            continue
        m = _MISTRAL_NAMED.match(segment)
        if m is None:
            continue  # no call in it (vLLM skips such a segment too)
        try:
            args, _ = dec.raw_decode(segment, m.end())
        except (ValueError, RecursionError):
            return None
        call = _dumped(m.group(1), args) if isinstance(args, dict) else None
        if call is None:
            return None
        calls.append(call)
    return calls or None


@dataclass
class WholeStream:
    """A syntax whose calls are read when the output ends (module doc). `openers`: how an
    answer made of calls starts (after blank space); `marker`: or, anywhere in the text, where
    the calls begin (content streams until then). Text that cannot be the start of calls
    streams as content at once."""

    read: object  # text -> calls or None
    openers: tuple[str, ...] = ()
    marker: str = ""
    strip: tuple[str, ...] = ()  # wrappers removed before reading (Llama 4's python tags)
    seen_call: bool = False
    buf: str = ""  # held: the start of the answer while it may be calls, or the marker
    parts: list = field(default_factory=list)  # held once it may be calls: the rest, in pieces
    state: str = "undecided"  # "text" | "calls"

    def feed(self, new_text: str) -> tuple[str, list[tuple[str, str]]]:
        if self.state == "calls":
            self.parts.append(new_text)  # joined once, at the end: a long call costs linear time
            return "", []
        text, self.buf = self.buf + new_text, ""
        if self.marker:
            i = text.find(self.marker)
            if i >= 0:
                self.state, self.buf = "calls", text[i:]
                return text[:i], []
            k = next(
                (k for k in range(min(len(self.marker) - 1, len(text)), 0, -1) if self.marker.startswith(text[-k:])),
                0,
            )
            self.buf = text[len(text) - k :]
            return text[: len(text) - k], []
        if self.state == "text":
            return text, []
        head = text.lstrip()
        if any(head.startswith(o) for o in self.openers):
            self.state, self.buf = "calls", text
            return "", []
        if not head or any(o.startswith(head) for o in self.openers):
            self.buf = text  # blank so far, or the start of an opener: wait
            return "", []
        self.state = "text"
        return text, []

    def finish(self) -> tuple[str, list[tuple[str, str]]]:
        held, self.buf, self.parts = self.buf + "".join(self.parts), "", []
        if self.state != "calls":
            return held, []
        body = held[len(self.marker) :] if self.marker else held.strip()
        for tag in self.strip:  # a wrapper at either end, not the same text inside a value
            body = body.strip().removeprefix(tag).removesuffix(tag)
        try:
            calls = self.read(body)
        except (RecursionError, ValueError, TypeError, MemoryError):  # whatever a parser missed: text
            calls = None
        if not calls:
            return held, []  # not calls after all: the model's text as it wrote it
        self.seen_call = True
        return "", calls


def reader(parser: str):
    """A streaming reader of one choice's output in `parser`'s syntax (one of PARSERS)."""
    if parser == "hermes":
        return HermesStream()
    if parser == "llama3_json":
        return WholeStream(_json_calls, openers=("{", "<|python_tag|>"), strip=("<|python_tag|>",))
    if parser == "pythonic":
        return WholeStream(
            _pythonic_calls, openers=("[", "<|python_start|>"), strip=("<|python_start|>", "<|python_end|>")
        )
    if parser == "mistral":
        return WholeStream(_mistral_calls, marker=_MISTRAL)
    raise ValueError(f"unknown tool-call parser {parser!r}; known: {', '.join(PARSERS)}")
