"""The OpenAI-compatible front end, and `pdserve serve`.

The pieces the router reuses in front of its workers: `protocol` (request
models and their SamplingParams), `errors` (APIError and OpenAI's error shape),
`format` and `streaming` (response shapes, SSE, abort on disconnect),
`engine_client` (what the front end needs of an engine), `metrics`
(vLLM-meaning Prometheus metrics), `admission` (pure admit / Retry-After
functions), `serving` (uvicorn with a drain on SIGTERM) and `logs`.

`async_engine` runs one LLMEngine in a thread of its own behind asyncio; `app`
puts the OpenAI API in front of it, which is the collocated server. `cli` is
`pdserve serve`: collocated, or disaggregated through `launcher` (a router and
worker processes on this host, supervised) or `ray_launcher` (the same on a
Ray cluster). `calibrate` times a worker's engine for the router's cost
models; it runs as one of async_engine's engine commands.

The worker process itself is pdserve/worker.
"""
