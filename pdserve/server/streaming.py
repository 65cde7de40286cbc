"""Server-sent events and whole responses from a `RequestGroup`, with client-gone handling.

Whatever way a response ends — finished, engine error, client disconnect, task
cancelled at shutdown — the group is aborted in a `finally`, so a request never
keeps its KV blocks after nobody is listening.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from pdserve.control_api import STREAM_COMMENT, tokens_comment
from pdserve.server.engine_client import RequestStream
from pdserve.server.errors import APIError
from pdserve.server.format import cached_prompt_tokens, dumps, usage

log = logging.getLogger("pdserve.server")
DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {dumps(obj)}\n\n"


def _event_lines(chunk: str) -> str:
    kind = getattr(chunk, "kind", None)  # responses.NamedEvent
    return f"event: {kind}\ndata: {chunk}\n\n" if kind else f"data: {chunk}\n\n"


async def read_body(request, limit_bytes: int) -> bytes:
    """The request body, or 413 as soon as it passes `limit_bytes` (checked before reading it all)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
        raise APIError(413, f"the request body is {declared} bytes; the limit is {limit_bytes}")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit_bytes:
            raise APIError(413, f"the request body is over the limit of {limit_bytes} bytes")
        parts.append(part)
    return b"".join(parts)


async def sse_events(
    group: RequestStream | None,
    fmt,
    include_usage: bool,
    num_prompt_tokens: int,
    on_done=None,
    *,
    tag_tokens: bool = False,
    indices: list[int] | None = None,
    completion_tokens: int = 0,
    preamble: bool = True,
    choice_prompt_tokens: list[int] | None = None,
    choice_tokens_before: dict[int, int] | None = None,
    cached_per_prompt_of: int | None = None,
) -> AsyncIterator[str]:
    """The SSE body of a streamed response; one write per engine step, however many chunks it made.

    For a front that resumes streams (control_api: TOKEN_IDS_HEADER): `tag_tokens` writes each
    chunk's token ids as a comment before it. A resumed stream runs only the choices that had not
    finished (`group` is None when none is left): `indices` maps the group's choices to the
    client's, `completion_tokens` counts what streamed before, and the preamble is not sent again.
    `choice_prompt_tokens` (per choice, the client's order): every chunk carries its choice's usage
    so far (vLLM's continuous_usage_stats), counting on from `choice_tokens_before` (a resumed
    stream's, per client choice). `cached_per_prompt_of` (the request's n): the usage chunk
    says how many prompt tokens were found cached (format.cached_prompt_tokens).
    """
    per_choice: dict[int, int] = dict(choice_tokens_before or {})
    end = getattr(fmt, "stream_end", DONE)  # the Responses API's streams end with their last event
    cached: dict[int, int | None] = {}
    finish = "error"
    try:
        if tag_tokens:
            yield f"{STREAM_COMMENT}{fmt.created}\n\n"
        if preamble:
            for obj in fmt.preamble():  # chunks (dicts), or the Responses API's events (named JSON)
                yield _event_lines(obj) if isinstance(obj, str) else sse(obj)
        while group is not None and (batch := await group.next_batch()) is not None:
            parts = []
            for i, out in batch:
                index = i if indices is None else indices[i]
                completion_tokens += len(out.new_token_ids)
                if out.num_cached_tokens is not None:
                    cached.setdefault(index, out.num_cached_tokens)
                now = None
                if choice_prompt_tokens is not None:
                    per_choice[index] = per_choice.get(index, 0) + len(out.new_token_ids)
                    now = usage(choice_prompt_tokens[index], per_choice[index])
                chunk = fmt.chunk_json(index, out, include_usage, now)
                tag = tokens_comment(index, out.new_token_ids, out.finished) if tag_tokens else ""
                if isinstance(chunk, list):  # several events (the Responses API's, named)
                    parts.append(tag + "".join(_event_lines(c) for c in chunk))
                elif chunk is not None:
                    parts.append(f"{tag}data: {chunk}\n\n")
                elif tag:
                    parts.append(f"{tag}\n")
            if parts:
                yield "".join(parts)
        if include_usage:
            n = cached_per_prompt_of
            details = None if n is None else cached_prompt_tokens(cached, n)
            yield sse(fmt.usage_chunk(usage(num_prompt_tokens, completion_tokens, details)))
        finish = "ok"
        if end:
            yield end
    except APIError as e:
        # headers are gone already: the error travels as an event, then the stream ends cleanly
        finish = f"error {e.status}"
        named = getattr(fmt, "error_event", None)  # the Responses API's typed error event
        yield _event_lines(named(e)) if named is not None else e.sse()
        if end:
            yield end
    except (asyncio.CancelledError, GeneratorExit):
        finish = "client gone"
        raise
    finally:
        if group is not None:
            group.abort()
        if on_done is not None:
            on_done(finish, completion_tokens)


async def collect(group: RequestStream, receive) -> list:
    """Final output per choice for a non-streamed response; aborts if the client disconnects first."""
    finals: dict[int, object] = {}
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        while True:
            getter = asyncio.ensure_future(group.next_batch())
            done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                raise APIError(499, "the client closed the connection")
            batch = getter.result()
            if batch is None:
                return [finals[i] for i in range(len(group.subs))]
            for index, out in batch:
                if out.finished:
                    finals[index] = out
    finally:
        watcher.cancel()
        group.abort()


async def wait_disconnect(receive) -> None:
    """Returns when the client closes the connection. For after the body was read: the next
    ASGI message can then only be the disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass
