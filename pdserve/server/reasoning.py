"""Splitting a reasoning model's thinking from its answer (vLLM's `--reasoning-parser`).

Reasoning models write their thinking between `<think>` and `</think>`, then the answer. With a
parser the chat API returns the thinking apart, as vLLM does: in `message.reasoning` (and under
its older name `reasoning_content`, which clients still read), the answer in `content`; streamed,
in the deltas' fields of the same names.

`deepseek_r1` (DeepSeek-R1 and its distills, QwQ): the template opens `<think>` in the prompt, so
the output is thinking from its first token up to `</think>` (a leading `<think>` is dropped);
output without `</think>` is all thinking (cut short by max_tokens).
`qwen3` (Qwen3, whose thinking can be switched off with chat_template_kwargs
`{"enable_thinking": false}`): thinking only when the output opens with `<think>`; otherwise it
is all answer.

A structured output (a JSON schema, a regex, a named or required tool call) holds, as in vLLM,
only once the thinking is closed: the model thinks freely, then writes what the grammar allows
(the server gives the engine the tags' token ids: SamplingParams.reasoning_token_ids), and the
parser reads it as any output. Where the tokenizer has no single-token tags the grammar holds
from the first token, and such a *constrained* output is read as qwen3 reads any: thinking only
where it opens with `<think>` (its grammar allowed thinking first), else all answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PARSERS = ("deepseek_r1", "qwen3")
_START, _END = "<think>", "</think>"


def _prefix_len(text: str, tag: str) -> int:
    """How many of `text`'s last characters could begin `tag`."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


@dataclass
class ReasoningStream:
    """One choice's output as it streams: `feed` returns (thinking, answer) that can go now."""

    parser: str
    constrained: bool = False  # the output is held to a grammar: thinking only after <think>
    state: str = "start"  # start (before the first characters decide) | think | answer
    held: str = ""  # text that may be the start of a tag
    blank: list = field(default_factory=list)  # at the start: the blank text so far, in pieces

    def __post_init__(self):
        if self.parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {self.parser!r}; known: {', '.join(PARSERS)}")

    def feed(self, new_text: str) -> tuple[str, str]:
        if self.state == "start":
            if not self.held:  # blank so far: only the new text is looked at (no quadratic rescans)
                head = new_text.lstrip()
                self.blank.append(new_text[: len(new_text) - len(head)])
            else:
                head = self.held + new_text
            self.held = ""
            if head.startswith(_START):
                self.state, self.blank, text = "think", [], head[len(_START) :]
            elif _START.startswith(head):  # blank, or the opening tag in pieces: wait
                self.held = head
                return "", ""
            else:
                self.state = "think" if self._opens_thinking else "answer"
                text, self.blank = "".join(self.blank) + head, []
        else:
            text, self.held = self.held + new_text, ""
        if self.state == "start":
            return "", ""
        if self.state == "answer":
            return "", text
        i = text.find(_END)
        if i >= 0:
            self.state = "answer"
            return text[:i], text[i + len(_END) :]
        k = _prefix_len(text, _END)
        self.held = text[len(text) - k :]
        return text[: len(text) - k], ""

    def finish(self) -> tuple[str, str]:
        """What is held at the end: part of a tag that never completed, as text of its side."""
        held, self.held = self.held, ""
        if self.state == "start":  # only blank text, or a tag's first characters
            held, self.blank = "".join(self.blank) + held, []
            return (held, "") if self._opens_thinking else ("", held)
        return (held, "") if self.state == "think" else ("", held)

    @property
    def _opens_thinking(self) -> bool:
        """Whether the output is thinking from its first token, without an opening tag."""
        return self.parser == "deepseek_r1" and not self.constrained


def split(text: str, parser: str, constrained: bool = False) -> tuple[str | None, str | None]:
    """A whole output's (thinking, answer); None for a side it does not have."""
    s = ReasoningStream(parser, constrained)
    r, c = s.feed(text)
    r2, c2 = s.finish()
    r, c = r + r2, c + c2
    return (r if r else None), (c if c else None)
