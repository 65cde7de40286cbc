"""A signed internal request is made out to one receiver (host:port) and is checked against the
socket it arrives on, so a captured request cannot be replayed to another process of the
deployment (each keeps its own nonces); and its header is checked before its body is read.

Real servers in child processes (`python -m tests.test_auth_receiver KIND HOST`), real sockets."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from pdserve import auth
from pdserve.ports import die_with_parent

SECRET = b"0123456789abcdef-receiver-test"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- the child processes


def _echo_app():
    """Internal routes behind auth.InternalAuth, as on a router or a worker; /calls (public)
    counts the requests that reached a handler."""
    app = FastAPI()
    calls = []

    async def echo(request: Request):
        body = await request.body()
        calls.append(len(body))
        return {"length": len(body), "sha256": hashlib.sha256(body).hexdigest()}

    async def state():
        calls.append(0)
        return {"ok": True}

    app.add_api_route("/internal/echo", echo, methods=["POST"])
    app.add_api_route("/internal/state", state, methods=["GET"])
    app.add_api_route("/calls", lambda: {"calls": len(calls)}, methods=["GET"])
    app.add_api_route("/health", lambda: {"ok": True}, methods=["GET"])
    app.add_api_route("/metrics", lambda: PlainTextResponse("# router\n"), methods=["GET"])
    app.add_middleware(auth.InternalAuth, verifier=auth.Verifier(SECRET))
    return app


def _serve(kind: str, host: str, router_url: str | None = None, aliases: str = "") -> None:
    import uvicorn

    if kind == "front":
        from pdserve.server.front import Front

        app = Front(router_url, SECRET, retry_window_s=2.0, aliases=[a for a in aliases.split(",") if a])
    else:
        app = _echo_app()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1)
    uvicorn.Server(config).run(sockets=[sock])


class Child:
    """`python -m tests.test_auth_receiver KIND HOST [ROUTER_URL]`: a server on a port of its choosing."""

    def __init__(self, kind: str, host: str = "127.0.0.1", router_url: str = "", aliases: str = ""):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.test_auth_receiver", kind, host, router_url, aliases],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=die_with_parent,
        )
        self.port = int(self.proc.stdout.readline() or 0)
        if not self.port:
            self.proc.kill()
            raise RuntimeError(f"the {kind} server did not start: {self.proc.stderr.read().decode()[-2000:]}")
        self.host = "127.0.0.1" if host == "0.0.0.0" else host
        self.url = f"http://[{self.host}]:{self.port}" if ":" in self.host else f"http://{self.host}:{self.port}"
        self.log = bytearray()
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1, trust_env=False).status_code < 500:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"the {kind} server did not answer: {self.log.decode()[-2000:]}")
            time.sleep(0.05)

    def _drain(self):
        for line in self.proc.stderr:
            self.log += line

    def calls(self) -> int:
        return httpx.get(self.url + "/calls", timeout=5, trust_env=False).json()["calls"]

    def rss_mib(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) >> 10

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------- helpers


def signed_headers(method: str, url: str, body: bytes = b"", target: str | None = None, secret=SECRET) -> dict:
    u = httpx.URL(url)
    header = auth.sign_request(secret, method, u.raw_path.decode(), body, target or auth.target_of(u))
    return {auth.AUTH_HEADER: header, "content-type": "application/json"}


def raw_exchange(port: int, head: str, body: bytes = b"", host: str = "127.0.0.1", timeout_s: float = 5.0) -> bytes:
    """Send a request head (and `body`), then read whatever answer comes within `timeout_s`."""
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.sendall(head.encode() + body)
        out = b""
        try:
            while b"\r\n\r\n" not in out or not out.rstrip().endswith(b"}"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        except TimeoutError:
            pass
        return out


def big_post_head(path: str, port: int, length: int, header: str | None) -> str:
    extra = f"{auth.AUTH_HEADER}: {header}\r\n" if header else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n{extra}\r\n"
    )


@pytest.fixture(scope="module")
def two():
    a, b = Child("echo"), Child("echo")
    yield a, b
    a.stop(), b.stop()


# ---------------------------------------------------------------- the tests


def test_target_of_names_the_receiver_canonically():
    assert auth.target_of("http://127.0.0.1:8000/internal/x") == "127.0.0.1:8000"
    assert auth.target_of("http://10.0.0.7/internal/x") == "10.0.0.7:80"  # the default port, explicit
    assert auth.target_of("https://Router.Example/internal/x") == "router.example:443"
    assert auth.target_of("http://[::1]:9000/") == "[::1]:9000"
    assert auth.target_of("http://[0:0::1]:9000/") == "[::1]:9000"
    assert auth.target_of("http://[fe80::1%25eth0]:9000/") == "[fe80::1]:9000"  # a zone id is the sender's own
    assert auth.target_of("http://[::ffff:10.0.0.7]:9000/") == "10.0.0.7:9000"
    with pytest.raises(ValueError):
        auth.sign_request(SECRET, "GET", "/p", b"", "no-port")


def test_a_signed_request_is_refused_by_every_other_receiver(two):
    a, b = two
    before = (a.calls(), b.calls())
    for method, path, body in (("GET", "/internal/state", b""), ("POST", "/internal/echo", b'{"request_id":"r"}')):
        h = signed_headers(method, a.url + path, body)
        assert httpx.request(method, a.url + path, content=body, headers=h).status_code == 200
        r = httpx.request(method, a.url + path, content=body, headers=h)
        assert r.status_code == 401 and "replayed" in r.json()["error"]["message"]
        # the same header to the other process, with and without the Host header it was made out to
        for extra in ({}, {"host": f"127.0.0.1:{a.port}"}):
            r = httpx.request(method, b.url + path, content=body, headers={**h, **extra})
            assert r.status_code == 401, (method, extra, r.text)
            assert r.json()["error"]["message"] == (
                f"signed for another receiver (127.0.0.1:{a.port}; this is 127.0.0.1:{b.port})"
            )
    assert (a.calls(), b.calls()) == (before[0] + 2, before[1])  # no replay reached a handler
    # what the code base's callers use signs for whichever receiver each request goes to
    with httpx.Client(auth=auth.http_auth(SECRET), trust_env=False) as c:
        for w in (a, b):
            assert c.post(w.url + "/internal/echo", json={"x": 1}).status_code == 200
            assert c.get(w.url + "/internal/state?x=1").status_code == 200


def test_an_ip_literal_binds_the_address_and_a_name_the_port():
    """A server on 0.0.0.0 sees each connection's own local address: a request signed for
    127.0.0.2 is refused on 127.0.0.1 (another namespace's process, say), a name is accepted on the port."""
    s = Child("echo", "0.0.0.0")
    try:
        with httpx.Client(auth=auth.http_auth(SECRET), trust_env=False) as c:
            for host in ("127.0.0.1", "127.0.0.2", "localhost"):
                assert c.get(f"http://{host}:{s.port}/internal/state").status_code == 200, host
        h = signed_headers("GET", f"http://127.0.0.2:{s.port}/internal/state")
        r = httpx.get(f"http://127.0.0.1:{s.port}/internal/state", headers=h)
        assert r.status_code == 401
        assert r.json()["error"]["message"] == (
            f"signed for another receiver (127.0.0.2:{s.port}; this is 127.0.0.1:{s.port})"
        )
        h = signed_headers("GET", f"http://127.0.0.1:{s.port + 1}/internal/state")  # another port, same host
        assert httpx.get(f"http://127.0.0.1:{s.port}/internal/state", headers=h).status_code == 401
        h = signed_headers("GET", f"http://some-host.example:{s.port}/internal/state")
        assert httpx.get(f"http://127.0.0.1:{s.port}/internal/state", headers=h).status_code == 200
    finally:
        s.stop()


def test_ipv6_receivers_check_the_bracketed_address():
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")
    s = Child("echo", "::1")
    try:
        with httpx.Client(auth=auth.http_auth(SECRET), trust_env=False) as c:
            assert c.post(s.url + "/internal/echo", json={"x": 1}).status_code == 200
        h = signed_headers("GET", s.url + "/internal/state", target=f"[::2]:{s.port}")
        r = httpx.get(s.url + "/internal/state", headers=h)
        assert r.status_code == 401 and "another receiver" in r.json()["error"]["message"]
    finally:
        s.stop()


def test_the_first_header_format_is_refused(two):
    """No downgrade: a header without a receiver, as pdserve signed them before, is refused."""
    a, _ = two
    ts, nonce = f"{time.time():.3f}", "ab" * 16
    digest = hashlib.sha256(b"").hexdigest()
    mac = auth._mac(SECRET, b"GET", b"/internal/state", ts.encode(), nonce.encode(), digest.encode()).hex()
    r = httpx.get(a.url + "/internal/state", headers={auth.AUTH_HEADER: f"{ts}:{nonce}:{mac}"})
    assert r.status_code == 401 and "older pdserve" in r.json()["error"]["message"]


def test_a_request_is_refused_on_its_header_before_its_body_is_read(two):
    """The 401 comes while the client has sent the head alone of a 60 MiB request; the
    server waits for no body, reads none, and no handler runs."""
    a, _ = two
    before = a.calls()
    good = signed_headers("POST", a.url + "/internal/echo", b"x" * 10)[auth.AUTH_HEADER]
    stale = auth.sign_request(SECRET, "POST", "/internal/echo", b"", f"127.0.0.1:{a.port}", now=time.time() - 3600)
    for header, why in (
        (None, "missing"),
        ("garbage", "malformed"),
        (good[:-40] + "0" * 40, "malformed"),  # the target spoiled
        (good.replace(good.split(":")[5], "0" * 64), "bad signature"),
        (stale, "stale"),
    ):
        t0 = time.monotonic()
        out = raw_exchange(a.port, big_post_head("/internal/echo", a.port, 60 << 20, header))
        assert out.startswith(b"HTTP/1.1 401"), (why, out[:200])
        assert why.encode() in out and time.monotonic() - t0 < 4
    # a signed header promises the length: a longer body is refused once it passes it
    out = raw_exchange(a.port, big_post_head("/internal/echo", a.port, 20, good), b"y" * 20)
    assert out.startswith(b"HTTP/1.1 401") and b"longer than the 10 bytes signed" in out
    assert a.calls() == before


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] else None, *sys.argv[4:5])
