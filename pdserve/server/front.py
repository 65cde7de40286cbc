"""The front of a `pdserve serve` deployment: it holds the clients' connections.

Under `pdserve serve` the router runs as a supervised child on a loopback port and
is restarted when it dies. Clients connect to this front, which runs inside the
launcher (the process whose end is the deployment's end anyway) and forwards
every request to the router. What it adds is that a router crash loses nothing:

- a request the router had not answered when it died is sent again (the launcher
  holds the router's listening socket, so while it restarts, connections wait in
  the backlog rather than being refused);
- a stream cut mid-way is resumed. The router writes each chunk's token ids as SSE
  comments for the front (control_api.TOKEN_IDS_HEADER), which removes them and
  keeps, per choice, what the client has been sent. When the stream breaks, the
  front posts the client's body and those tokens to the restarted router
  (`/internal/resume/...`, signed with the cluster secret), which continues every
  unfinished choice on a worker from its prompt and tokens so far, under the same
  id: the client sees one stream with a pause in it.

Internal routes (`/internal/*`) are the cluster's, not the public's: the front checks
their signature (`auth.read_signed`: the header before any of the body, so an
unauthenticated caller gets a 401 and makes the front buffer nothing) and signs them
again for the router, which refuses a signature made out to another receiver.

It parses no OpenAI body and keeps nothing but the streams in flight: a plain ASGI
app over httpx, small enough not to be the part that fails. While it drains
(SIGTERM to the launcher), new generation requests get 503 with `Retry-After`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx

from pdserve import auth
from pdserve.control_api import (
    STREAM_COMMENT,
    TOKEN_IDS_HEADER,
    TOKENS_COMMENT,
    ResumedChoice,
    ResumeRequest,
    parse_tokens_comment,
)
from pdserve.server.errors import APIError
from pdserve.server.streaming import wait_disconnect

log = logging.getLogger("pdserve.front")

RESUMABLE_PATHS = ("/v1/completions", "/v1/chat/completions")  # a stream cut mid-way goes on
# relayed as they come, counted in flight, refused while draining; retried before any answer
GENERATION_PATHS = (*RESUMABLE_PATHS, "/v1/responses")
INTERNAL_PREFIX = "/internal/"  # the router guards these (auth.InternalAuth): so does the front
# hop-by-hop headers, and those the front sets itself
_DROPPED = {
    b"host",
    b"content-length",
    b"connection",
    b"keep-alive",
    b"transfer-encoding",
    b"te",
    b"upgrade",
    b"proxy-connection",
    b"trailer",
    b"date",
    b"server",
    TOKEN_IDS_HEADER.encode(),
    auth.AUTH_HEADER.encode(),  # made out to the front: an internal request is signed again for the router
}
_DONE = b"data: [DONE]"
# how a Responses API stream ends (it has no data: [DONE], as OpenAI's has none)
_RESPONSES_END = {
    b"event: " + kind for kind in (b"response.completed", b"response.incomplete", b"response.failed", b"error")
}
RETRY_WINDOW_S = 60.0  # how long a request or a cut stream waits for the router to come back


class _TooLarge(Exception):
    pass


class _ClientGone(Exception):
    pass


class _Stream:
    """One streamed response as the client has received it: the events forwarded so far and,
    per choice, the token ids they carried (read from the router's comments, then removed)."""

    def __init__(self, request_id: str, responses: bool = False):
        self.request_id = request_id
        self.responses = responses  # a Responses API stream: named events, no [DONE]
        self.created = 0
        self.choices: dict[int, ResumedChoice] = {}
        self.done = False  # the client has had the stream's end (data: [DONE], or a final named event)
        self.events = 0  # forwarded so far (the sequence number of a Responses stream's next event)
        self._buf = b""

    def feed(self, data: bytes) -> bytes:
        """The complete events in `data` (and what came before it) for the client, comments removed.
        Tokens count as sent with the event that carries them; a half event waits for its end."""
        self._buf += data
        *events, self._buf = self._buf.split(b"\n\n")
        out = []
        for ev in events:
            lines = []
            for line in ev.split(b"\n"):
                if line.startswith(TOKENS_COMMENT.encode()):
                    index, ids, finished = parse_tokens_comment(line.decode())
                    c = self.choices.setdefault(index, ResumedChoice(index=index))
                    c.token_ids += ids
                    c.finished = c.finished or finished
                elif line.startswith(STREAM_COMMENT.encode()):
                    self.created = int(line[len(STREAM_COMMENT) :])
                elif line:
                    lines.append(line)
                    self.done = self.done or line == _DONE or (self.responses and line in _RESPONSES_END)
            if lines:
                out.append(b"\n".join(lines) + b"\n\n")
                self.events += 1
        return b"".join(out)

    def resume_body(self, body: bytes) -> bytes:
        return (
            ResumeRequest(
                body=body.decode(),
                request_id=self.request_id,
                created=self.created,
                choices=list(self.choices.values()),
            )
            .model_dump_json()
            .encode()
        )


class Front:
    """The ASGI app. `router_url`: where the router listens (loopback); `secret`: the cluster's,
    to check internal requests and to sign them (and resumes) for the router; `max_body_bytes`:
    the router's --max-request-body-bytes."""

    def __init__(
        self,
        router_url: str,
        secret: bytes,
        max_body_bytes: int = 1 << 20,
        retry_window_s: float = RETRY_WINDOW_S,
        aliases=(),
    ):
        self.router_url = router_url.rstrip("/")
        self.signer = auth.http_auth(secret)
        # `aliases`: the deployment's names its socket cannot tell (--internal-aliases)
        self.verifier = auth.Verifier(secret, aliases=aliases)
        self.max_body_bytes = max_body_bytes
        self.retry_window_s = retry_window_s
        self.draining = False
        self.in_flight = 0
        self.counters = {"retried": 0, "resumed": 0, "failed": 0}
        self._http: httpx.AsyncClient | None = None

    # ---- ASGI
    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        try:
            if scope["method"] == "POST" and scope["path"] in GENERATION_PATHS:
                await self._generation(scope, receive, send)
            elif scope["path"].startswith(INTERNAL_PREFIX):
                body = await auth.read_signed(self.verifier, scope, receive, send, who="front: ")
                if body is not None:
                    await self._forward(scope, body, send, signed=True)
            else:
                await self._forward(scope, await _read_body(receive, self.max_body_bytes), send)
        except _TooLarge as e:
            await _answer(send, APIError(413, str(e)))
        except _ClientGone:
            pass

    async def _lifespan(self, receive, send):
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self._http = httpx.AsyncClient(
                    base_url=self.router_url,
                    trust_env=False,
                    timeout=httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None),
                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                )
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self._http.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ---- everything but generation: forwarded as it is (internal requests, checked, signed again)
    async def _forward(self, scope, body: bytes, send, signed: bool = False):
        # an internal POST is not sent twice (it may have been applied): its sender retries
        once = scope["method"] == "POST" and signed
        deadline = time.monotonic() + (0.0 if once else self.retry_window_s)
        while True:
            try:
                resp = await self._http.send(self._request(scope, body), auth=self.signer if signed else None)
                break
            except httpx.TransportError as e:
                if time.monotonic() >= deadline:
                    return await _answer(
                        send,
                        APIError(
                            503,
                            f"the router is not reachable now ({type(e).__name__}); retry shortly",
                            headers={"Retry-After": "2"},
                        ),
                    )
                await asyncio.sleep(0.25)
        content = resp.content
        if scope["path"] == "/metrics" and resp.status_code == 200:
            content += self._metrics().encode()
        await _start(send, resp.status_code, resp.headers, len(content))
        await send({"type": "http.response.body", "body": content})

    def _request(self, scope, body: bytes, path: str | None = None, token_ids: bool = False) -> httpx.Request:
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _DROPPED]
        client = scope.get("client")
        if client:
            headers.append((b"x-forwarded-for", client[0].encode()))
        if token_ids:
            headers.append((TOKEN_IDS_HEADER.encode(), b"1"))
        if path is None:
            path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
            if scope.get("query_string"):
                path += "?" + scope["query_string"].decode("latin-1")
        return self._http.build_request(scope["method"], path, headers=headers, content=body)

    def _metrics(self) -> str:
        lines = []
        for key, doc in (
            ("retried", "Requests the front sent again because the router died before answering."),
            ("resumed", "Streams the front resumed on a restarted router after it died mid-stream."),
            ("failed", "Requests the front gave up on: the router did not come back in time."),
        ):
            name = f"pdserve:front_requests_{key}_total"
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} counter", f"{name} {self.counters[key]}"]
        name = "pdserve:front_internal_auth_refused_total"  # the router counts those it refuses itself
        doc = "Internal requests the front refused for a missing, stale, replayed or wrong signature, unread."
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} counter", f"{name} {self.verifier.refused}"]
        return "\n".join(lines) + "\n"

    # ---- generation: retried and resumed
    async def _generation(self, scope, receive, send):
        body = await _read_body(receive, self.max_body_bytes)
        if self.draining:
            return await _answer(
                send, APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
            )
        self.in_flight += 1
        relay = asyncio.ensure_future(self._relay(scope, body, send))
        gone = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.in_flight -= 1
            for t in (relay, gone):
                t.cancel()
            await asyncio.gather(relay, gone, return_exceptions=True)
        if relay.done() and not relay.cancelled() and relay.exception() is not None:
            raise relay.exception()

    async def _relay(self, scope, body: bytes, send) -> None:
        stream: _Stream | None = None  # set once the client has the response's head
        deadline = time.monotonic() + self.retry_window_s
        path = scope["path"]
        while True:
            if stream is None:
                req, signed = self._request(scope, body, token_ids=True), None
            else:
                resume_path = "/internal/resume/" + path[len("/v1/") :]
                req = self._request({**scope, "method": "POST"}, stream.resume_body(body), resume_path, token_ids=True)
                signed = self.signer
            try:
                resp = await self._http.send(req, stream=True, auth=signed)
            except httpx.TransportError as e:
                if not await self._wait_again(deadline, e):
                    return await self._give_up(send, stream, e)
                continue
            try:
                if stream is None and (
                    resp.status_code != 200 or not resp.headers.get("content-type", "").startswith("text/event-stream")
                ):
                    content = await resp.aread()  # a whole answer: nothing reached the client yet
                    await _start(send, resp.status_code, resp.headers, len(content))
                    await send({"type": "http.response.body", "body": content})
                    return
                if stream is None:
                    stream = _Stream(resp.headers.get("x-request-id", ""), responses=path == "/v1/responses")
                    await _start(send, 200, resp.headers, None)
                elif resp.status_code != 200:  # the restarted router refused the resume
                    content = await resp.aread()
                    err = _router_error(resp.status_code, content)
                    if resp.status_code == 503 and time.monotonic() < deadline:  # no worker yet, say
                        await asyncio.sleep(1.0)
                        continue
                    await send({"type": "http.response.body", "body": err.sse().encode() + _DONE + b"\n\n"})
                    return
                async for data in resp.aiter_raw():
                    out = stream.feed(data)
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                if stream.done:
                    await send({"type": "http.response.body", "body": b""})
                    return
                why: Exception = ConnectionError("the router ended the stream early")
            except httpx.TransportError as e:
                why = e
            finally:
                await resp.aclose()
            if stream is not None and stream.done:  # it broke after the end reached the client
                await send({"type": "http.response.body", "body": b""})
                return
            deadline = time.monotonic() + self.retry_window_s
            cut = stream is not None and path not in RESUMABLE_PATHS  # begun, and cannot go on elsewhere
            if cut or self.draining or not await self._wait_again(deadline, why, resume=stream is not None):
                return await self._give_up(send, stream, why)

    async def _wait_again(self, deadline: float, why: Exception, resume: bool = False) -> bool:
        if time.monotonic() >= deadline:
            return False
        self.counters["resumed" if resume else "retried"] += 1
        log.warning(
            "the router connection broke (%s: %s); %s",
            type(why).__name__,
            why,
            "resuming the stream" if resume else "sending the request again",
        )
        await asyncio.sleep(0.1)
        return True

    async def _give_up(self, send, stream: _Stream | None, why: Exception) -> None:
        self.counters["failed"] += 1
        err = APIError(
            503,
            f"the router did not come back to finish this request ({type(why).__name__}); retry",
            headers={"Retry-After": "2"},
        )
        if stream is None:
            return await _answer(send, err)
        if stream.responses:  # OpenAI's typed error event, numbered after what the client has
            e = err.body()["error"]
            fields = {"code": e.get("code") or e.get("type"), "message": e["message"], "param": None}
            event = json.dumps({"type": "error", "sequence_number": stream.events, **fields})
            return await send({"type": "http.response.body", "body": f"event: error\ndata: {event}\n\n".encode()})
        await send({"type": "http.response.body", "body": err.sse().encode() + _DONE + b"\n\n"})


def _router_error(status: int, content: bytes) -> APIError:
    try:
        e = json.loads(content)["error"]
        return APIError(status, e["message"], param=e.get("param"), code=e.get("code"))
    except (ValueError, KeyError, TypeError):
        return APIError(status, f"the router answered {status}")


async def _read_body(receive, limit: int) -> bytes:
    parts, size, more = [], 0, True
    while more:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _ClientGone
        part = msg.get("body", b"")
        size += len(part)
        if size > limit:
            raise _TooLarge(f"the request body is over the limit of {limit} bytes")
        parts.append(part)
        more = msg.get("more_body", False)
    return b"".join(parts)


async def _start(send, status: int, headers: httpx.Headers, length: int | None) -> None:
    out = [(k, v) for k, v in headers.raw if k.lower() not in _DROPPED]
    if length is not None:
        out.append((b"content-length", str(length).encode()))
    await send({"type": "http.response.start", "status": status, "headers": out})


async def _answer(send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), str(v).encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
