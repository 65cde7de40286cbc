"""The cluster secret: KV handshakes, signed internal requests, where the token comes from."""

import os
import socket
import stat
import threading

import httpx
import pytest
from fastapi import FastAPI

from pdserve import auth

SECRET = b"0123456789abcdef-test-secret"


def _handshake(server_secret: bytes, client_secret: bytes):
    a, b = socket.socketpair()
    errors = {}

    def accept():
        try:
            auth.kv_accept(a, server_secret, timeout_s=2)
        except auth.AuthError as e:
            errors["server"] = e
        finally:
            a.close()  # a refused peer is cut off

    t = threading.Thread(target=accept)
    t.start()
    try:
        auth.kv_connect(b, client_secret, timeout_s=2)
    except auth.AuthError as e:
        errors["client"] = e
    t.join()
    b.close()
    return errors


def test_kv_handshake_accepts_the_same_secret_only():
    assert _handshake(SECRET, SECRET) == {}
    errors = _handshake(SECRET, b"another-secret-of-16+")
    assert "server" in errors and "client" in errors


def test_kv_accept_refuses_a_peer_that_sends_frames_without_handshaking():
    a, b = socket.socketpair()
    b.sendall(b'\x00\x00\x00\x10{"op":"layer"}  ' + b"\0" * 64)
    with pytest.raises(auth.AuthError):
        auth.kv_accept(a, SECRET, timeout_s=1)
    a.close(), b.close()


def test_kv_accept_gives_up_on_a_silent_peer():
    a, b = socket.socketpair()
    with pytest.raises(auth.AuthError, match="in time"):
        auth.kv_accept(a, SECRET, timeout_s=0.2)
    a.close(), b.close()


def test_signed_requests_verify_once_and_only_unchanged():
    v = auth.Verifier(SECRET)
    here = ("127.0.0.1", 8001)  # the server's end of the connection (ASGI scope["server"])
    t = "127.0.0.1:8001"
    h = auth.sign_request(SECRET, "POST", "/internal/reserve", b'{"a":1}', t)
    assert v.check(h, "POST", "/internal/reserve", b'{"a":1}', here) is None
    assert "replayed" in v.check(h, "POST", "/internal/reserve", b'{"a":1}', here)
    h = auth.sign_request(SECRET, "POST", "/internal/reserve", b'{"a":1}', t)
    assert "does not match" in v.check(h, "POST", "/internal/reserve", b'{"a":2}', here)
    assert "signature" in v.check(h, "POST", "/internal/abort", b'{"a":1}', here)
    assert "signature" in v.check(auth.sign_request(b"x" * 20, "GET", "/p", b"", t), "GET", "/p", b"", here)
    assert "stale" in v.check(auth.sign_request(SECRET, "GET", "/p", b"", t, now=1.0), "GET", "/p", b"", here)
    assert "missing" in v.check(None, "GET", "/p", b"", here)
    assert "malformed" in v.check("garbage", "GET", "/p", b"", here)


def _app(verifier):
    app = FastAPI()
    seen = []

    async def echo(payload: dict):
        seen.append(payload)
        return payload

    app.add_api_route("/internal/echo", echo, methods=["POST"])
    app.add_api_route("/health", lambda: {"ok": True}, methods=["GET"])
    app.add_middleware(auth.InternalAuth, verifier=verifier)
    return app, seen


def test_middleware_guards_internal_routes_and_hands_the_body_on():
    verifier = auth.Verifier(SECRET)
    app, seen = _app(verifier)
    transport = httpx.ASGITransport(app=app)

    async def run():
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://t") as anon,
            httpx.AsyncClient(transport=transport, base_url="http://t", auth=auth.http_auth(SECRET)) as ok,
            httpx.AsyncClient(
                transport=transport, base_url="http://t", auth=auth.http_auth(b"wrong-secret-wrong-secret")
            ) as wrong,
        ):
            r = await anon.post("/internal/echo", json={"x": 1})
            assert r.status_code == 401 and r.json()["error"]["code"] == "cluster_auth"
            assert (await wrong.post("/internal/echo", json={"x": 2})).status_code == 401
            assert (await anon.get("/health")).status_code == 200  # only internal routes are guarded
            r = await ok.post("/internal/echo", json={"x": 3})
            assert r.status_code == 200 and r.json() == {"x": 3}

    import asyncio

    asyncio.run(run())
    assert seen == [{"x": 3}]  # nothing unauthenticated reached the handler
    assert verifier.refused == 2


def test_token_from_file_env_or_a_private_default(tmp_path, monkeypatch, caplog):
    f = tmp_path / "token"
    f.write_text("file-token-0123456789\n")
    monkeypatch.setenv(auth.TOKEN_ENV, "env-token-0123456789")
    f.chmod(0o600)
    assert auth.load_cluster_secret(str(f)) == b"file-token-0123456789"
    assert "readable by others" not in caplog.text
    f.chmod(0o644)  # still read, with a warning
    assert auth.load_cluster_secret(str(f)) == b"file-token-0123456789"
    assert "readable by others (mode 644)" in caplog.text
    assert auth.load_cluster_secret() == b"env-token-0123456789"
    monkeypatch.delenv(auth.TOKEN_ENV)
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    monkeypatch.setattr(auth, "DEFAULT_TOKEN_FILE", tmp_path / "home" / "cluster-token")
    first = auth.load_cluster_secret()
    assert auth.load_cluster_secret() == first and len(first) == 64
    assert stat.S_IMODE(os.stat(tmp_path / "home" / "cluster-token").st_mode) == 0o600
    with pytest.raises(ValueError, match="at least"):
        auth.parse_token("short")
    with pytest.raises(ValueError, match="cannot read"):
        auth.load_cluster_secret(str(tmp_path / "missing"))
    # the per-user file named on the command line (`--cluster-token-file ~/.pdserve/cluster-token`)
    # is made on first use too; any other missing file stays an error
    monkeypatch.setattr(auth, "DEFAULT_TOKEN_FILE", tmp_path / "home2" / "cluster-token")
    named = auth.load_cluster_secret(str(tmp_path / "home2" / "cluster-token"))
    assert len(named) == 64 and auth.load_cluster_secret() == named


def test_a_process_accepts_signatures_for_its_aliases_only():
    """Behind a port mapping or a Service (80 -> 8000) the signed receiver is not the socket's;
    `--internal-aliases` names it. Other receivers stay refused."""
    secret = b"s" * 32
    body = b"{}"
    header = auth.sign_request(secret, "POST", "/internal/heartbeat", body, target="pdserve-router:80")
    server = ("10.0.0.5", 8000)
    assert "another receiver" in auth.Verifier(secret).check(header, "POST", "/internal/heartbeat", body, server)
    aliased = auth.Verifier(secret, aliases=["pdserve-router:80", "http://10.1.2.3:9000"])
    assert aliased.check(header, "POST", "/internal/heartbeat", body, server) is None
    other = auth.sign_request(secret, "POST", "/internal/heartbeat", body, target="pdserve-router:81")
    assert "another receiver" in aliased.check(other, "POST", "/internal/heartbeat", body, server)
