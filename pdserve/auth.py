"""The cluster secret: who may join a deployment, call its internal routes, or move its KV.

One secret per deployment (32 random bytes, written as hex). It never crosses
the wire:

- KV connections (TCP push, pull, shared-memory notices, NIXL's metadata
  exchange) open with a mutual challenge-response over fixed-size binary
  messages, before any frame is parsed (`kv_accept` / `kv_connect`).
- Internal HTTP calls (worker registration and heartbeats, the router's calls
  to workers, admin routes) carry an HMAC of the method, path, a timestamp, a
  nonce and the body's digest (`sign_request`, `InternalAuth`); the receiver
  refuses stale timestamps and replayed nonces.

Where the secret comes from, first match wins: `--cluster-token-file`, the
environment variable `PDSERVE_CLUSTER_TOKEN`, or the per-user file
`~/.pdserve/cluster-token` (made, mode 0600, by the first process that needs
it), so a router and workers started by hand on one host agree without setup,
and another host joins only when given a copy of the file.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections import OrderedDict
from pathlib import Path

import httpx

log = logging.getLogger("pdserve.auth")

TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
TOKEN_FILE_ENV = "PDSERVE_CLUSTER_TOKEN_FILE"
DEFAULT_TOKEN_FILE = Path("~/.pdserve/cluster-token")
MIN_SECRET_BYTES = 16


class AuthError(ConnectionError):
    """A peer did not prove it holds the cluster secret."""


# ---------------------------------------------------------------- the secret


def new_token() -> str:
    """A fresh cluster token: 32 random bytes as hex."""
    return secrets.token_hex(32)


def parse_token(text: str) -> bytes:
    token = text.strip()
    if len(token.encode()) < MIN_SECRET_BYTES:
        raise ValueError(f"the cluster token must be at least {MIN_SECRET_BYTES} characters")
    return token.encode()


def load_cluster_secret(token_file: str | None = None, create_default: bool = True) -> bytes:
    """The deployment's secret (see the module docstring for where it comes from)."""
    token_file = token_file or os.environ.get(TOKEN_FILE_ENV)
    if token_file:
        path = Path(token_file).expanduser()
        try:
            text, mode = path.read_text(), path.stat().st_mode
        except OSError as e:
            raise ValueError(f"cannot read the cluster token file {token_file}: {e.strerror}") from None
        if mode & 0o077:
            log.warning("the cluster token file %s is readable by others (mode %o): chmod 600 it", path, mode & 0o777)
        return parse_token(text)
    if os.environ.get(TOKEN_ENV):
        return parse_token(os.environ[TOKEN_ENV])
    path = DEFAULT_TOKEN_FILE.expanduser()
    if not path.exists() and create_default:
        _create_token_file(path)
    try:
        return parse_token(path.read_text())
    except OSError as e:
        raise ValueError(
            f"no cluster token: pass --cluster-token-file, set {TOKEN_ENV}, or create {path} ({e.strerror})"
        ) from None


def _create_token_file(path: Path) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, (new_token() + "\n").encode())
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic and never replaces: two processes racing agree on one token
        log.info("created the cluster token file %s", path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


# ---------------------------------------------------------------- KV connections

_MAGIC = b"PDKV-AUTH-v1"
_NONCE = 32
_MAC = 32
HANDSHAKE_TIMEOUT_S = 5.0


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"\0".join(parts), hashlib.sha256).digest()


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise AuthError("peer closed the connection during authentication")
        buf += chunk
    return bytes(buf)


def kv_accept(sock: socket.socket, secret: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Server side of a KV connection: challenge the peer, check its answer, prove ourselves.

    Fixed-size messages only, under a timeout, so an unauthenticated peer can make us
    parse nothing and hold a thread for at most `timeout_s`."""
    old = sock.gettimeout()
    sock.settimeout(timeout_s)
    try:
        challenge = secrets.token_bytes(_NONCE)
        sock.sendall(_MAGIC + challenge)
        reply = _recv(sock, len(_MAGIC) + _NONCE + _MAC)
        magic, their_nonce, mac = reply[: len(_MAGIC)], reply[len(_MAGIC) : -_MAC], reply[-_MAC:]
        if magic != _MAGIC or not hmac.compare_digest(mac, _mac(secret, b"client", challenge, their_nonce)):
            raise AuthError("KV peer failed authentication (wrong or missing cluster token)")
        sock.sendall(_mac(secret, b"server", their_nonce, challenge))
    except TimeoutError:
        raise AuthError("KV peer did not authenticate in time") from None
    finally:
        sock.settimeout(old)


def kv_connect(sock: socket.socket, secret: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """Client side: answer the server's challenge and check that it holds the secret too."""
    old = sock.gettimeout()
    sock.settimeout(timeout_s)
    try:
        hello = _recv(sock, len(_MAGIC) + _NONCE)
        if hello[: len(_MAGIC)] != _MAGIC:
            raise AuthError("the KV endpoint did not start a pdserve handshake")
        challenge = hello[len(_MAGIC) :]
        nonce = secrets.token_bytes(_NONCE)
        sock.sendall(_MAGIC + nonce + _mac(secret, b"client", challenge, nonce))
        proof = _recv(sock, _MAC)
        if not hmac.compare_digest(proof, _mac(secret, b"server", nonce, challenge)):
            raise AuthError("the KV endpoint does not hold this deployment's cluster token")
    except TimeoutError:
        raise AuthError("the KV endpoint did not complete authentication in time") from None
    finally:
        sock.settimeout(old)


# ---------------------------------------------------------------- internal HTTP

AUTH_HEADER = "x-pdserve-auth"
MAX_SKEW_S = 300.0  # clocks of hosts in one deployment may differ this much
MAX_SIGNED_BODY_BYTES = 64 << 20


def sign_request(secret: bytes, method: str, path: str, body: bytes, now: float | None = None) -> str:
    """The value of the `X-PDServe-Auth` header for one request."""
    ts = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(16)
    digest = hashlib.sha256(body).hexdigest()
    mac = _mac(secret, method.upper().encode(), path.encode(), ts.encode(), nonce.encode(), digest.encode())
    return f"{ts}:{nonce}:{mac.hex()}"


class _Nonces:
    """Nonces seen within the skew window: a captured request cannot be replayed."""

    def __init__(self, window_s: float, max_entries: int = 1 << 20):
        self.window_s, self.max_entries = window_s, max_entries
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def fresh(self, nonce: str, ts: float, now: float) -> bool:
        with self._lock:
            while self._seen and (
                next(iter(self._seen.values())) < now - 2 * self.window_s or len(self._seen) >= self.max_entries
            ):
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return False
            self._seen[nonce] = now
            return True


class Verifier:
    """Checks `X-PDServe-Auth` headers against the secret."""

    def __init__(self, secret: bytes, max_skew_s: float = MAX_SKEW_S):
        self.secret = secret
        self.max_skew_s = max_skew_s
        self._nonces = _Nonces(max_skew_s)
        self.refused = 0  # requests refused by InternalAuth (a /metrics counter)

    def check(self, header: str | None, method: str, path: str, body: bytes, now: float | None = None) -> str | None:
        """None when the request is authentic, else why not."""
        if not header:
            return f"missing {AUTH_HEADER} header (internal routes need the cluster token)"
        try:
            ts_s, nonce, mac_hex = header.split(":")
            ts, mac = float(ts_s), bytes.fromhex(mac_hex)
        except ValueError:
            return f"malformed {AUTH_HEADER} header"
        now = time.time() if now is None else now
        digest = hashlib.sha256(body).hexdigest()
        want = _mac(self.secret, method.upper().encode(), path.encode(), ts_s.encode(), nonce.encode(), digest.encode())
        if not hmac.compare_digest(mac, want):
            return "bad signature (wrong cluster token?)"
        if abs(now - ts) > self.max_skew_s:
            return f"stale signature ({now - ts:+.0f} s; are the hosts' clocks in sync?)"
        if not self._nonces.fresh(nonce, ts, now):
            return "replayed request"
        return None


def http_auth(secret: bytes):
    """An `httpx.Auth` that signs every request with the secret."""

    class _Signer(httpx.Auth):
        requires_request_body = True

        def auth_flow(self, request):
            request.headers[AUTH_HEADER] = sign_request(
                secret, request.method, request.url.raw_path.decode(), request.content
            )
            yield request

    return _Signer()


class InternalAuth:
    """ASGI middleware: requests under `prefixes` must be signed with the cluster secret.

    The body is read (bounded) to check its digest, then handed on unchanged.
    Refusals are 401 in OpenAI's error shape, logged with the peer's address, and
    reach no handler."""

    def __init__(
        self,
        app,
        verifier: Verifier,
        prefixes: tuple[str, ...] = ("/internal/",),
        max_body_bytes: int = MAX_SIGNED_BODY_BYTES,
    ):
        self.app = app
        self.verifier = verifier
        self.prefixes = prefixes
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(self.prefixes):
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return await self._refuse(scope, send, 413, "internal request body too large")
            chunks.append(chunk)
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        header = dict(scope["headers"]).get(AUTH_HEADER.encode())
        query = scope.get("query_string", b"")
        raw_path = scope.get("raw_path") or scope["path"].encode()
        path = raw_path.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
        why = self.verifier.check(header.decode("latin-1") if header else None, scope["method"], path, body)
        if why is not None:
            self.verifier.refused += 1
            peer = scope.get("client") or ("?", 0)
            log.warning(
                "refused unauthenticated %s %s from %s:%s: %s", scope["method"], scope["path"], peer[0], peer[1], why
            )
            return await self._refuse(scope, send, 401, why)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(scope, send, status: int, message: str) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": message,
                    "type": "authentication_error" if status == 401 else "invalid_request_error",
                    "param": None,
                    "code": "cluster_auth" if status == 401 else None,
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})
