"""The front and internal routes (pdserve/server/front.py): it checks a caller's signature
before it reads the body, so an unauthenticated caller makes it buffer nothing, and signs
what it passes on again for the router (which refuses a signature made out to the front).

A real front (uvicorn over `Front`) and a stand-in router (auth.InternalAuth over echo
routes), each in a child process of its own."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pdserve import auth
from tests.test_auth_receiver import SECRET, Child, big_post_head, raw_exchange, signed_headers


@pytest.fixture(scope="module")
def deployment():
    router = Child("echo")
    front = Child("front", router_url=router.url)
    yield front, router
    front.stop(), router.stop()


def test_signed_internal_calls_pass_the_front_signed_again_for_the_router(deployment):
    front, router = deployment
    before = router.calls()
    body = b"z" * (3 << 20)  # over the public API's 1 MiB limit: internal bodies may be large
    with httpx.Client(auth=auth.http_auth(SECRET), trust_env=False, timeout=30) as c:
        r = c.post(front.url + "/internal/echo", content=body)
        assert r.status_code == 200 and r.json()["length"] == len(body), r.text
        assert c.get(front.url + "/internal/state?verbose=1").status_code == 200
    assert router.calls() == before + 2
    # a header made out to the router is no good at the front, nor one made out to the front at the router
    h = signed_headers("GET", router.url + "/internal/state")
    r = httpx.get(front.url + "/internal/state", headers=h)
    assert r.status_code == 401 and "another receiver" in r.json()["error"]["message"]
    h = signed_headers("GET", front.url + "/internal/state")
    assert httpx.get(router.url + "/internal/state", headers=h).status_code == 401
    assert router.calls() == before + 2


def test_the_front_refuses_an_unsigned_internal_request_before_reading_its_body(deployment):
    """The head alone of a 60 MiB request gets its 401 from the front at once: it waits
    for no body and passes nothing to the router."""
    front, router = deployment
    before, refused = router.calls(), _front_refused(front)
    stale = auth.sign_request(SECRET, "POST", "/internal/heartbeat", b"", f"127.0.0.1:{front.port}", now=1.0)
    for header, why in ((None, "missing"), ("1.0:ab:cd", "older pdserve"), ("v2:x", "malformed"), (stale, "stale")):
        t0 = time.monotonic()
        out = raw_exchange(front.port, big_post_head("/internal/heartbeat", front.port, 60 << 20, header))
        assert out.startswith(b"HTTP/1.1 401"), (why, out[:300])
        assert why.encode() in out and b"cluster_auth" in out and time.monotonic() - t0 < 4
    # the log comes through a pipe and a reader thread: it may trail the 401 a little
    deadline = time.monotonic() + 10
    while b"front: refused unauthenticated POST /internal/heartbeat" not in front.log:
        assert time.monotonic() < deadline, front.log.decode()[-2000:]
        time.sleep(0.05)
    assert router.calls() == before
    assert _front_refused(front) == refused + 4


def _front_refused(front) -> float:
    text = httpx.get(front.url + "/metrics", timeout=5).text
    return float(
        next(x for x in text.splitlines() if x.startswith("pdserve:front_internal_auth_refused_total ")).split()[1]
    )


def test_unsigned_large_internal_bodies_do_not_grow_the_front(deployment):
    """Concurrent unsigned 32 MiB posts (the audit's memory DoS, scaled down): the front's
    memory stays put, where it used to buffer every body (and the router again)."""
    front, router = deployment
    rss0, peak, done = front.rss_mib(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], front.rss_mib())
            time.sleep(0.01)

    answers = []

    def post():
        try:
            r = httpx.post(front.url + "/internal/heartbeat", content=b"x" * (32 << 20), timeout=30, trust_env=False)
            answers.append(r.status_code)
        except httpx.TransportError:  # the front may close the connection while the body is still coming
            answers.append("closed")

    sampler = threading.Thread(target=sample)
    sampler.start()
    clients = [threading.Thread(target=post) for _ in range(6)]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    done.set()
    sampler.join()
    assert all(a in (401, "closed") for a in answers), answers
    assert peak[0] - rss0 < 48, f"the front grew from {rss0} to {peak[0]} MiB"


def test_the_front_accepts_signatures_for_its_aliases(deployment):
    """--internal-aliases on `pdserve serve` reach the front: a call signed for the name the
    deployment is reached at (a port mapping, a Service) passes; other names stay refused."""
    _, router = deployment
    front = Child("front", router_url=router.url, aliases="pdserve.example:80")
    try:
        before = router.calls()
        for target, status in (("pdserve.example:80", 200), ("other.example:80", 401)):
            h = signed_headers("GET", front.url + "/internal/state", target=target)
            assert httpx.get(front.url + "/internal/state", headers=h).status_code == status, target
        assert router.calls() == before + 1
    finally:
        front.stop()


def test_serve_gives_its_aliases_to_the_front_not_to_the_router_behind_it_nor_the_workers():
    from pdserve.cli import build_parser
    from pdserve.server.launcher import router_settings, worker_settings

    args = build_parser("serve").parse_args(["serve", "--internal-aliases", "pdserve.example:80"])
    assert args.internal_aliases == ["pdserve.example:80"]
    # the children's settings documents, keyed by flag
    assert router_settings(args, "127.0.0.1", 9000, public=False).get("internal-aliases") is None
    assert router_settings(args, "0.0.0.0", 8000).get("internal-aliases") == ["pdserve.example:80"]  # on Ray
    assert worker_settings(args, "decode", 0, "http://127.0.0.1:9000", threads=1).get("internal-aliases") is None
