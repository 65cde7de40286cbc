"""Errors in OpenAI's JSON shape, shared by the worker's API server and the router.

Every failure a client can cause is an `APIError` with a 4xx status; anything
else that escapes a handler is logged and answered as a 500 in the same shape,
so a client never sees a bare traceback or FastAPI's `{"detail": ...}`.
"""

from __future__ import annotations

import json
import logging

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

log = logging.getLogger("pdserve.server")

# status -> OpenAI error type (the `type` field clients switch on)
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered to the client as `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "internal_server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def sse(self) -> str:
        """The error as one server-sent event, for failures after a stream has begun."""
        return f"data: {json.dumps(self.body())}\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def install_handlers(app) -> None:
    """Route every error path of a FastAPI app through `APIError.body()`."""

    def respond(err: APIError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return respond(exc)

    @app.exception_handler(HTTPException)
    async def _http_error(request, exc: HTTPException):
        # unknown routes (404) and wrong methods (405) come from the router itself
        msg = {
            404: f"no route {request.method} {request.url.path}",
            405: f"method {request.method} is not allowed on {request.url.path}",
        }.get(exc.status_code, str(exc.detail))
        return respond(APIError(exc.status_code, msg, code=None, headers=dict(exc.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        return respond(from_validation_errors(exc.errors()))

    @app.exception_handler(Exception)
    async def _unexpected(request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return respond(APIError(500, "internal server error; see the server log"))


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def from_validation_errors(errors: list[dict]) -> APIError:
    """A pydantic error list as one 400 naming the first offending parameter."""
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    # Bodies FastAPI parses itself (the internal routes' models) fail as a whole with
    # loc ("body", ...): say so as protocol.parse_body does for the public API.
    if first.get("type") == "json_invalid":
        why = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        return bad_request(f"the request body is not valid JSON: {why}", code="invalid_json")
    if tuple(first.get("loc", ())) == ("body",):
        if isinstance(first.get("input"), bytes):  # FastAPI reads JSON only under a JSON content type
            return bad_request(
                "the request body must be JSON sent as content-type: application/json", code="invalid_json"
            )
        return bad_request("the request body must be a JSON object", code="invalid_json")
    loc = []
    for part in first.get("loc", ()):
        # union members show up as type tags ("list[int]", "str"): the field path ends there
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part):
            break
        if part != "body":
            loc.append(str(part))
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    return bad_request(f"{param}: {msg}" if param else msg, param=param)
