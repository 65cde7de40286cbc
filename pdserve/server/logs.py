"""Structured logs: one line per event, `key=value` (logfmt) or JSON.

Call sites pass their fields as `extra={"fields": {...}}` so that request ids,
token counts and timings stay machine-readable instead of being formatted
into the message.
"""

from __future__ import annotations

import json
import logging
import time


class _Formatter(logging.Formatter):
    def __init__(self, as_json: bool):
        super().__init__()
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields.update({k: v for k, v in getattr(record, "fields", {}).items() if v is not None})
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        if self.as_json:
            return json.dumps(fields, default=str)
        return " ".join(f"{k}={_logfmt(v)}" for k, v in fields.items())


def _logfmt(v) -> str:
    s = str(v)
    if s and not any(c in s for c in ' "=\n'):
        return s
    return json.dumps(s)


def configure(level: str = "info", fmt: str = "text") -> None:
    """Send pdserve's and uvicorn's logs to stderr in one format."""
    handler = logging.StreamHandler()
    handler.setFormatter(_Formatter(fmt == "json"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    # one line per request comes from our own handlers, with the request id; uvicorn's would repeat it
    logging.getLogger("uvicorn.access").disabled = True
