"""The OpenAI-compatible API (SPEC part 2).

What the router reuses: `protocol` (request models and their SamplingParams),
`errors` (APIError and OpenAI's error shape), `format` and `streaming`
(response shapes, SSE, abort on disconnect), `metrics` (vLLM-meaning
Prometheus metrics) and `admission` (pure admit / Retry-After functions).
`async_engine` and `app` are the collocated worker: one engine in its own
thread behind FastAPI.
"""
