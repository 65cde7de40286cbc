"""`pdserve internal PATH`: read (or post to) a deployment's /internal route, for operators.

Every /internal route needs a request signed with the cluster secret (pdserve/auth.py), so a
plain `curl` gets 401. This command signs the call the way the router and workers sign
theirs, with the secret found where `pdserve scale` finds it (--cluster-token-file, then
$PDSERVE_CLUSTER_TOKEN, then ~/.pdserve/cluster-token), and prints the JSON answer:

    pdserve internal workers                      # GET /internal/workers of the router on :8000
    pdserve internal conductor --url http://10.0.0.1:8000
    pdserve internal admin/scale --data '{"decode": "+1"}'   # POST with a JSON body
"""

from __future__ import annotations

import json
import sys

DEFAULT_URL = "http://127.0.0.1:8000"


def add_arguments(p) -> None:
    from pdserve.router.cli import add_cluster_token_argument

    p.add_argument(
        "path", help="the route under /internal/, e.g. workers, conductor, admin/pools (/internal/workers works too)"
    )
    p.add_argument(
        "--url",
        default=DEFAULT_URL,
        help="the router, `pdserve serve`'s front, or a worker's control API (default: %(default)s)",
    )
    p.add_argument("--data", default=None, metavar="JSON", help="POST this JSON body (without it: GET)")
    add_cluster_token_argument(p)


def internal_path(path: str) -> str:
    """`workers`, `/workers`, `internal/workers` and `/internal/workers` are all /internal/workers."""
    path = path.lstrip("/")
    return "/" + (path if path.startswith("internal/") else "internal/" + path)


def _error_message(r) -> str:
    """The server's own words: OpenAI's {"error": {"message"}}, FastAPI's {"detail"}, else the text."""
    try:
        body = r.json()
    except ValueError:
        return r.text.strip() or r.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if err:
            return str(err)
        if body.get("detail"):
            return json.dumps(body["detail"]) if not isinstance(body["detail"], str) else body["detail"]
    return json.dumps(body)


def run(args) -> int:
    import httpx

    from pdserve import auth

    def fail(msg: str, code: int = 1) -> int:
        print(f"pdserve internal: {msg}", file=sys.stderr)
        return code

    path = internal_path(args.path)
    body = None
    if args.data is not None:
        try:
            body = json.loads(args.data)
        except ValueError as e:
            return fail(f"--data is not JSON: {e}", 2)
    try:
        secret = auth.load_cluster_secret(args.cluster_token_file, create_default=False)
    except ValueError as e:
        return fail(str(e), 2)
    url = args.url.rstrip("/") + path
    method = "GET" if body is None else "POST"
    try:
        with httpx.Client(auth=auth.http_auth(secret), timeout=30, trust_env=False) as client:
            r = client.get(url) if body is None else client.post(url, json=body)
    except (httpx.HTTPError, ValueError) as e:
        return fail(f"cannot reach {url}: {e}")
    if r.status_code >= 400:
        fail(f"{method} {path}: {r.status_code}: {_error_message(r)}")
        if r.status_code == 401:
            fail(
                "the server refused this cluster secret. `pdserve serve` makes a fresh secret per "
                "deployment unless it is given one: start it with --cluster-token-file FILE (or "
                f"${auth.TOKEN_ENV}) and pass the same to this command."
            )
        return 1
    try:
        print(json.dumps(r.json(), indent=2))
    except ValueError:
        print(r.text)
    return 0
