"""Send requests to an OpenAI-compatible endpoint, streamed, and time every chunk.

Timing follows `vllm bench serve`: the clock starts just before a request is
sent (after any wait for a concurrency slot), TTFT is the first chunk that
carries output, each later output chunk adds one inter-token latency (ITL),
and the end-to-end latency stops at the last output chunk. Chunks that carry
no output (a chat stream's opening role chunk, the closing usage chunk) are
not tokens and are not timed. The per-chunk work is one JSON parse and one
clock read.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from pdserve.bench.datasets import Request

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


class BenchError(RuntimeError):
    """The benchmark cannot run at all (unreachable endpoint, unknown model, bad flags)."""


@dataclass
class RequestOutput:
    """What one request measured; times in seconds. Failed requests keep what they got."""

    prompt_len: int = 0
    output_tokens: int = 0  # the server's usage.completion_tokens, else the number of output chunks
    success: bool = False
    error: str = ""
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    start_s: float = 0.0  # when it was sent, from the benchmark start
    tag: str = "default"
    usage_reported: bool = False
    sent: bool = True  # False: its slot came after run_benchmark's send_until_s, so it was never sent


class StreamParser:
    """Turns SSE lines and their arrival times into a `RequestOutput` (no I/O: testable with made-up clocks)."""

    def __init__(self, out: RequestOutput, start: float, chat: bool):
        self.out = out
        self.start = start
        self.last = start
        self.chunks = 0
        self.chat = chat
        self.done = False

    def feed(self, line: str, now: float) -> None:
        if not line.startswith("data:"):
            return  # blank separators, comments, "event:" lines
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        obj = json.loads(data)
        if "error" in obj:
            err = obj["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise _StreamError(f"error event mid-stream: {msg}")
        choices = obj.get("choices")
        if choices and self._has_output(choices[0]):
            if self.chunks == 0:
                self.out.ttft_s = now - self.start
            else:
                self.out.itl_s.append(now - self.last)
            self.last = now
            self.chunks += 1
        usage = obj.get("usage")
        if usage:
            self.out.usage_reported = True
            self.out.output_tokens = usage.get("completion_tokens") or 0
            self.out.prompt_len = usage.get("prompt_tokens") or self.out.prompt_len

    def _has_output(self, choice: dict) -> bool:
        if choice.get("finish_reason") is not None:
            return True
        if self.chat:
            delta = choice.get("delta") or {}
            return bool(delta.get("content") or delta.get("reasoning_content"))
        return bool(choice.get("text"))

    def finish(self) -> None:
        if self.chunks == 0:
            raise _StreamError("the stream ended without any output")
        self.out.latency_s = self.last - self.start
        if not self.out.usage_reported:
            self.out.output_tokens = self.chunks
        self.out.success = True


class _StreamError(Exception):
    pass


def request_body(
    req: Request, model: str, endpoint: str, *, ignore_eos: bool, temperature: float, extra: dict | None = None
) -> bytes:
    body = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == CHAT:
        prompt = req.prompt if isinstance(req.prompt, str) else None
        if prompt is None:
            raise BenchError(f"{CHAT} takes text prompts; this workload was built as token ids")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = req.prompt
    if ignore_eos:
        body["ignore_eos"] = True  # a vLLM extension that pdserve, vLLM and llama.cpp accept
    body.update(extra or {})
    return json.dumps(body, separators=(",", ":")).encode()


async def send(client: httpx.AsyncClient, url: str, body: bytes, out: RequestOutput, t0: float, chat: bool) -> None:
    """One streamed request; never raises for a server or network fault: it lands in `out.error`."""
    start = time.perf_counter()
    out.start_s = start - t0
    parser = StreamParser(out, start, chat)
    try:
        async with client.stream("POST", url, content=body) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {_error_message(await resp.aread())}"
                return
            async for line in resp.aiter_lines():
                parser.feed(line, time.perf_counter())
                if parser.done:
                    break
        parser.finish()
    except _StreamError as e:
        out.error = str(e)
    except ValueError as e:  # a data line that is not JSON
        out.error = f"malformed stream: {e}"
    except httpx.HTTPError as e:
        out.error = describe_http_error(e, url)
    except (AttributeError, TypeError, KeyError, IndexError) as e:
        # a chunk of the wrong shape ("choices": "x"): one bad response must not end the run
        out.error = f"unexpected response shape: {type(e).__name__}: {e}"


def _error_message(raw: bytes) -> str:
    try:
        err = json.loads(raw).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        if msg:
            return str(msg)
    except (ValueError, AttributeError):
        pass
    return raw.decode(errors="replace").strip()[:300] or "(empty body)"


def describe_http_error(e: httpx.HTTPError, url: str) -> str:
    if isinstance(e, httpx.ConnectError):
        return f"cannot connect to {url}: {e or 'connection refused'}"
    if isinstance(e, httpx.TimeoutException):
        return f"timed out ({type(e).__name__}) on {url}"
    detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if isinstance(e, httpx.RemoteProtocolError):
        return f"the server closed the connection before the response ended ({detail})"
    if isinstance(e, httpx.NetworkError):  # a reset or a broken pipe
        return f"the connection to the server broke ({detail})"
    return detail


def make_client(api_key: str | None, timeout_s: float) -> httpx.AsyncClient:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    # no connection cap: a queue for a connection would be counted as server latency;
    # trust_env off: a proxy from the environment must not sit between client and server
    return httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(timeout_s, connect=10.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,
    )


def served_models(base_url: str, api_key: str | None) -> list[str]:
    """The model ids `GET /v1/models` lists; a `BenchError` that says why if the endpoint is not usable."""
    url = base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url, headers=headers, timeout=10.0, trust_env=False)
    except httpx.HTTPError as e:
        raise BenchError(describe_http_error(e, url)) from None
    if r.status_code == 401:
        raise BenchError(f"{url}: the server wants an API key (--api-key or OPENAI_API_KEY)")
    if r.status_code != 200:
        raise BenchError(f"{url}: HTTP {r.status_code}: {_error_message(r.content)}")
    try:
        return [m["id"] for m in r.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"{url}: not an OpenAI model list: {r.text[:200]}") from None
