"""OpenAI's Responses API (`POST /v1/responses`), for text: what clients built on it send.

A request is read as the chat completion it amounts to (`instructions` as the system message,
`input` as the conversation, `max_output_tokens`, `text.format` as the response format) and runs
on the same path; only the reply's shape differs: a response object whose `output` holds a
message item (and, with a reasoning parser, a reasoning item before it), or, streamed, the
typed events OpenAI sends (`response.created`, `response.output_text.delta`, ...,
`response.completed`). Function tools work as on chat (named, required, or auto with a
tool-call parser), their calls returned as `function_call` items; earlier calls and their
outputs in `input` become the assistant's tool calls and the tool's messages. Not served, and
refused with a 400 naming the field: other tools, `previous_response_id` and item references
(responses are not stored), background responses, inputs other than text.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import Field

from pdserve.engine.sampling_params import MAX_CACHE_SALT_CHARS
from pdserve.server import protocol as P
from pdserve.server.engine_client import ChoiceOutput
from pdserve.server.errors import bad_request
from pdserve.server.format import ChatFormatter, TokenText, dumps
from pdserve.server.reasoning import ReasoningStream, split

_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class TextFormat(P._Strict):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = Field("", max_length=256)
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(P._Strict):
    format: TextFormat | None = None


class ResponsesRequest(P._Strict):
    model: str | None = None
    input: str | list[dict] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = False  # accepted; nothing is stored (previous_response_id is refused)
    tools: list[dict] | None = None  # function tools (as on chat: named, required, or auto with a parser)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    background: bool = False
    truncation: Literal["disabled"] = "disabled"
    # vLLM's extensions, as on chat
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=P.SEED_MIN, le=P.SEED_MAX)
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    def check(self) -> None:
        if self.previous_response_id:
            raise bad_request(
                "previous_response_id is not supported by this server (responses are not stored: send the "
                "conversation in input)",
                "previous_response_id",
            )
        if self.background:
            raise bad_request("background responses are not supported by this server", "background")
        for i, t in enumerate(self.tools or ()):
            if t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise bad_request(
                    f"tools[{i}]: only function tools ({{type: function, name, ...}}) are served", "tools"
                )

    def chat_tools(self) -> list[dict] | None:
        """The tools as chat takes them ({type, function: {name, description, parameters}})."""
        if not self.tools:
            return None
        keys = ("name", "description", "parameters", "strict")
        return [{"type": "function", "function": {k: t[k] for k in keys if t.get(k) is not None}} for t in self.tools]

    def chat_tool_choice(self):
        c = self.tool_choice
        if isinstance(c, dict) and c.get("type") == "function" and "name" in c:  # Responses' named form
            return {"type": "function", "function": {"name": c["name"]}}
        return c

    def messages(self) -> list[dict]:
        """The conversation as chat messages: the instructions, then the input's items."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        thought = None  # a reasoning item's text, for the assistant message after it
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind in ("function_call", "function_call_output"):
                out.append(_call_message(i, item, out, thought))
                thought = None
                continue
            if kind == "reasoning":  # an earlier response's output sent back with the conversation
                parts = item.get("content") or item.get("summary") or []
                texts = [p.get("text") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)]
                thought = "\n".join(texts) or None
                continue
            role = _ROLES.get(item.get("role")) if isinstance(item.get("role"), str) else None
            if kind != "message" or role is None:
                raise bad_request(
                    f"input[{i}]: only message items with a role of user, assistant, system or developer are "
                    f"served here (got type {kind!r})",
                    "input",
                )
            content = item.get("content")
            if isinstance(content, list):
                texts = []
                for part in content:
                    if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                        raise bad_request(f"input[{i}]: only text content parts are served here", "input")
                    if not isinstance(part.get("text"), str):
                        raise bad_request(f"input[{i}]: a text part's text is a string", "input")
                    texts.append(part["text"])
                content = "\n".join(texts)
            if not isinstance(content, str):
                raise bad_request(f"input[{i}]: content is a string or a list of text parts", "input")
            message = {"role": role, "content": content}
            if role == "assistant" and thought is not None:
                message["reasoning_content"] = thought  # templates that show earlier thinking read it
            thought = None
            out.append(message)
        return out

    def chat_request(self) -> P.ChatCompletionRequest:
        """The chat completion this response amounts to (validated as one)."""
        body: dict = {"messages": self.messages(), "stream": self.stream, "priority": self.priority}
        for name in (
            "model",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "seed",
            "cache_salt",
            "user",
        ):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.tools:
            body |= {"tools": self.chat_tools(), "tool_choice": self.chat_tool_choice()}
            if self.parallel_tool_calls is not None:
                body["parallel_tool_calls"] = self.parallel_tool_calls
        elif self.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict},
            }
        return P.parse_body(dumps(body).encode(), P.ChatCompletionRequest)

    def echo(self) -> dict:
        """The request's settings as a response object repeats them."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else TextFormat()
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "metadata": self.metadata or {},
            "user": self.user,
            "store": False,
            "tools": self.tools or [],
            "tool_choice": self.tool_choice or "auto",
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": None,
            "truncation": "disabled",
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)},
            "reasoning": None,
            "error": None,
            "incomplete_details": None,
        }


def _call_message(i: int, item: dict, out: list[dict], thought: str | None) -> dict:
    """A function_call item (an earlier call of the model) as the assistant message holding it,
    or a function_call_output item as the tool's message; consecutive calls share a message."""
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise bad_request(f"input[{i}]: a {item.get('type')} item needs its call_id", "input")
    if item["type"] == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise bad_request(f"input[{i}]: a function_call_output's output is a string", "input")
        return {"role": "tool", "tool_call_id": call_id, "content": output}
    name, arguments = item.get("name"), item.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise bad_request(f"input[{i}]: a function_call has a name and its arguments as a JSON string", "input")
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and thought is None:
        out[-1]["tool_calls"].append(call)  # the same turn's next call
        return out.pop()
    message = {"role": "assistant", "content": "", "tool_calls": [call]}
    if thought is not None:
        message["reasoning_content"] = thought
    return message


class NamedEvent(str):
    """An event's JSON that knows its type: streamed with an `event:` line naming it, as OpenAI
    streams the Responses API (clients that dispatch on the SSE event name read it there)."""

    kind: str

    def __new__(cls, kind: str, data: str):
        out = super().__new__(cls, data)
        out.kind = kind
        return out

    def __getnewargs__(self):  # copies and pickles keep the name
        return (self.kind, str(self))


class ResponsesFormatter:
    """A response object and its stream events from one choice's outputs (n is 1 here). It
    stands where format.ChatFormatter stands for the chat route (server/streaming.py drives it)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        token_text: TokenText,
        req: ResponsesRequest,
        prompt_tokens: int,
        reasoning: str | None = None,
        constrained: bool = False,
        tool_calls=None,
    ):
        """`tool_calls`: protocol.ToolCalls of a request with tools: the output is read for calls
        as on chat (format.ChatFormatter's reading), and streamed whole at its end."""
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text
        self.req = req
        self.prompt_tokens = prompt_tokens
        self.reasoning = reasoning
        self._thinker = ReasoningStream(reasoning, constrained) if reasoning else None
        self.constrained = constrained
        self._seq = 0  # events' sequence_number
        self._items: list[dict] = []  # output items opened so far, in order
        self._open: dict | None = None  # the item text goes into now
        self._texts: dict[str, list[str]] = {}  # item id -> its text so far
        self._tokens = 0
        self._calls = (
            ChatFormatter(request_id, model, token_text, 1, None, tool_calls=tool_calls) if tool_calls else None
        )
        self._held: list[str] = []  # with tools: the output, read for calls at its end

    # ---- the response object
    def _response(self, status: str, output: list[dict], usage: dict | None, reason: str | None = None) -> dict:
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "output": output,
            "usage": usage,
            **self.req.echo(),
        }
        if reason == "length":
            out["status"] = "incomplete"
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    def _usage(self, output_tokens: int, cached: int | None = None) -> dict:
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached or 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + output_tokens,
        }

    @staticmethod
    def _message(item_id: str, text: str | None, status: str = "completed") -> dict:
        """A message item; `text` None: as it is announced, before its part is added."""
        parts = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": parts}

    @staticmethod
    def _reasoning_item(item_id: str, text: str | None, status: str = "completed") -> dict:
        parts = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {"id": item_id, "type": "reasoning", "status": status, "summary": [], "content": parts}

    def full(self, finals: list[ChoiceOutput], u: dict) -> dict:
        c = finals[0].final
        output = self._output(c.text, c.finish_reason)
        usage = self._usage(u["completion_tokens"], c.num_cached_tokens)
        return self._response("completed", output, usage, c.finish_reason)

    def _output(self, whole: str, reason: str | None) -> list[dict]:
        """A whole output's items: its thinking, its answer, the calls read from the answer."""
        thought, text = split(whole, self.reasoning, self.constrained) if self.reasoning else (None, whole)
        status = "incomplete" if reason == "length" else "completed"
        calls: list[dict] = []
        if self._calls is not None and text is not None:  # (None: it never stopped thinking, no call)
            message, _ = self._calls._tool_message(text, reason)
            text, calls = message.get("content"), message.get("tool_calls") or []
        output = []
        if thought is not None:
            output.append(self._reasoning_item(f"rs_{uuid.uuid4().hex}", thought, status))
        if text or not calls:
            output.append(self._message(f"msg_{uuid.uuid4().hex}", text or "", status))
        for call in calls:
            output.append(
                {
                    "id": f"fc_{uuid.uuid4().hex}",
                    "type": "function_call",
                    "status": "completed",
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": call["function"]["arguments"],
                }
            )
        return output

    # ---- the stream (server/streaming.py: preamble, chunk_json per output, nothing at the end)
    stream_end = ""  # no data: [DONE]: OpenAI's Responses streams end with response.completed (or failed)

    def error_event(self, err) -> str:
        """A failure after the stream began, as OpenAI's Responses streams report one."""
        body = err.body()["error"]
        code = body.get("code") or body.get("type")
        return self._event("error", code=code, message=body.get("message"), param=body.get("param"))

    def _event(self, kind: str, **fields) -> str:
        self._seq += 1
        return NamedEvent(kind, dumps({"type": kind, "sequence_number": self._seq - 1, **fields}))

    def preamble(self) -> list[str]:
        return [
            self._event(kind, response=self._response("in_progress", [], None))
            for kind in ("response.created", "response.in_progress")
        ]

    def _open_item(self, kind: str) -> list[str]:
        out = self._close_item()
        prefix = "rs" if kind == "reasoning" else "msg"
        item_id = f"{prefix}_{uuid.uuid4().hex}"
        item = (self._reasoning_item if kind == "reasoning" else self._message)(item_id, None, "in_progress")
        self._items.append(item)
        self._open = item
        self._texts[item_id] = []
        index = len(self._items) - 1
        out.append(self._event("response.output_item.added", output_index=index, item=item))
        part = (self._reasoning_item if kind == "reasoning" else self._message)(item_id, "")["content"][0]
        out.append(
            self._event("response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=part)
        )
        return out

    def _close_item(self, status: str = "completed") -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self._items.index(item)
        text = "".join(self._texts[item["id"]])
        done = (self._reasoning_item if item["type"] == "reasoning" else self._message)(item["id"], text, status)
        self._items[index] = done
        where = dict(item_id=item["id"], output_index=index, content_index=0)
        kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
        extra = {} if item["type"] == "reasoning" else {"logprobs": []}
        return [
            self._event(f"response.{kind}.done", text=text, **where, **extra),
            self._event("response.content_part.done", part=done["content"][0], **where),
            self._event("response.output_item.done", output_index=index, item=done),
        ]

    def _delta(self, kind: str, text: str) -> list[str]:
        out = [] if self._open is not None and self._open["type"] == kind else self._open_item(kind)
        item = self._open
        self._texts[item["id"]].append(text)
        event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(
            self._event(
                event, item_id=item["id"], output_index=len(self._items) - 1, content_index=0, delta=text, **extra
            )
        )
        return out

    def chunk_json(self, index: int, out: ChoiceOutput, include_usage: bool, usage_now: dict | None = None):
        """The events this output makes: a list of JSON texts (each one server-sent event)."""
        self._tokens += len(out.new_token_ids)
        if self._calls is not None:
            return self._held_events(out)
        thought, text = "", out.new_text
        if self._thinker is not None:
            thought, text = self._thinker.feed(out.new_text)
            if out.final:
                more, rest = self._thinker.finish()
                thought, text = thought + more, text + rest
        events: list[str] = []
        if thought:
            events += self._delta("reasoning", thought)
        if text:
            events += self._delta("message", text)
        if out.final:
            if not any(i["type"] == "message" for i in self._items):
                events += self._open_item("message")  # an empty answer is still a message
            events += self._finished(out.final)
        return events or None

    def _finished(self, final) -> list[str]:
        """The end: the open item closed, then the whole response in a completed event."""
        reason = final.finish_reason
        events = self._close_item("incomplete" if reason == "length" else "completed")
        response = self._response(
            "completed", list(self._items), self._usage(self._tokens, final.num_cached_tokens), reason
        )
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=response)]

    def _held_events(self, out: ChoiceOutput) -> list[str] | None:
        """With tools: nothing until the output ends (whether it is calls is known only then),
        then every item's events, as OpenAI sends them, and the completed response."""
        self._held.append(out.new_text)
        if not out.final:
            return None
        events: list[str] = []
        for item in self._output("".join(self._held), out.final.finish_reason):
            if item["type"] != "function_call":  # thinking or answer: as a stream would have sent it
                text = item["content"][0]["text"]
                events += self._delta(item["type"], text) if text else self._open_item(item["type"])
                continue
            events += self._close_item()
            index = len(self._items)
            self._items.append(item)
            where = dict(item_id=item["id"], output_index=index)
            announced = {**item, "arguments": "", "status": "in_progress"}
            events += [
                self._event("response.output_item.added", output_index=index, item=announced),
                self._event("response.function_call_arguments.delta", delta=item["arguments"], **where),
                self._event("response.function_call_arguments.done", arguments=item["arguments"], **where),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
        return events + self._finished(out.final)

    def usage_chunk(self, u: dict) -> dict:  # never asked for: the completed event carries usage
        raise NotImplementedError

    def resume(self, index: int, token_ids: list[int]) -> None:
        raise NotImplementedError  # the front resumes chat and completions streams only
