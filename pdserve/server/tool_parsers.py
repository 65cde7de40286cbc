"""Reading tool calls out of a model's own output (`tool_choice: "auto"`).

With "auto" the model decides between answering and calling, and writes calls in the syntax
its chat template taught it; a parser for that syntax turns them into OpenAI's `tool_calls`.
vLLM's flags choose one: `--enable-auto-tool-choice --tool-call-parser NAME`.

`hermes`: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2.5
and Qwen3 and the many models trained on their format). Text outside the tags is the message's
content. A block that is not such JSON stays in the content, tags and all, as the model wrote it.

Streaming: text is passed on as content until a tag may be starting (a suffix that is a prefix
of `<tool_call>` is held back); a call is sent whole once its closing tag arrives (its arguments
complete, as one delta); at the end, what is held goes out as content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

PARSERS = ("hermes",)

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _call(block: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one block's JSON, or None if it is not a call."""
    try:
        obj = json.loads(block, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # not JSON, NaN or Infinity, or nested past the parser
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The whole output's content (None when it is only calls and blank space) and its calls."""
    stream = HermesStream()
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
