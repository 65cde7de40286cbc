"""`pdserve scale --router URL --prefill +1 --decode -1`: change pool sizes while serving.

Signed with the cluster secret (the router's admin route refuses anyone else).
A pool that shrinks drains the workers it loses; a pool that grows gets new
workers from the supervisor (`pdserve serve`, `pdserve serve --ray`), or from
you, by hand, when workers were started by hand.
"""

from __future__ import annotations

import json
import sys


def add_arguments(p) -> None:
    from pdserve.router.cli import add_cluster_token_argument

    p.add_argument("--router", required=True, help="the router's URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--prefill", default=None, help="new size: 3 (absolute), +1 or -1 (relative)")
    p.add_argument("--decode", default=None, help="new size: 3 (absolute), +1 or -1 (relative)")
    p.add_argument("--status", action="store_true", help="only show the pools (wanted, live, recent changes)")
    add_cluster_token_argument(p)


def run(args) -> int:
    import httpx

    from pdserve import auth
    from pdserve.control_api import ScaleRequest

    try:
        secret = auth.load_cluster_secret(args.cluster_token_file, create_default=False)
    except ValueError as e:
        print(f"pdserve scale: {e}", file=sys.stderr)
        return 2
    base = args.router.rstrip("/")
    with httpx.Client(auth=auth.http_auth(secret), timeout=10, trust_env=False) as client:
        try:
            if args.status or (args.prefill is None and args.decode is None):
                r = client.get(base + "/internal/admin/pools")
            else:
                body = ScaleRequest(prefill=args.prefill, decode=args.decode)
                r = client.post(base + "/internal/admin/scale", json=body.wire())
        except httpx.HTTPError as e:
            print(f"pdserve scale: cannot reach the router at {base}: {e}", file=sys.stderr)
            return 1
    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {"error": r.text}
    if r.status_code != 200:
        print(f"pdserve scale: {r.status_code}: {body.get('error', {}).get('message', body)}", file=sys.stderr)
        if r.status_code == 401:
            print(
                "pdserve scale: the router refused this command's cluster secret. `pdserve serve` makes a "
                "fresh secret per deployment unless it is given one: start it with --cluster-token-file FILE "
                f"(or ${auth.TOKEN_ENV}) and pass the same to this command.",
                file=sys.stderr,
            )
        return 1
    print(json.dumps(body, indent=2))
    if body.get("note"):
        print(body["note"], file=sys.stderr)
    return 0
