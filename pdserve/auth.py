"""The cluster secret: who may join a deployment, call its internal routes, or move its KV.

One secret per deployment (32 random bytes, written as hex). It never crosses
the wire:

- KV connections (TCP push, pull, shared-memory notices, NIXL's metadata
  exchange) open with a mutual challenge-response over fixed-size binary
  messages, before any frame is parsed (`kv_accept` / `kv_connect`).
- Internal HTTP calls (worker registration and heartbeats, the router's calls
  to workers, admin routes) carry an HMAC of the method, path, the receiver
  (host:port), a timestamp, a nonce and the body's length and digest
  (`sign_request`, `InternalAuth`); the receiver refuses signatures for another
  receiver, stale timestamps and replayed nonces, before it reads the body.

Where the secret comes from, first match wins: `--cluster-token-file`, the
environment variable `PDSERVE_CLUSTER_TOKEN`, or the per-user file
`~/.pdserve/cluster-token` (made, mode 0600, by the first process that needs
it), so a router and workers started by hand on one host agree without setup,
and another host joins only when given a copy of the file.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
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
        if create_default and path == DEFAULT_TOKEN_FILE.expanduser() and not path.exists():
            _create_token_file(path)  # the per-user file, named: made on first use, as when it is not named
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
#
# The header, `X-PDServe-Auth: v2:<ts>:<nonce>:<length>:<sha256 of the body>:<mac>:<target>`,
# where `target` is the receiver as the sender dialled it ("host:port", IPv6 in brackets) and
# the MAC covers the method, the path (with the query), the target, the timestamp, the nonce
# and the body's length and digest.
#
# - The MAC does not need the body: a receiver checks the header first (`Verifier.check_head`)
#   and refuses an unsigned, forged, stale or replayed request before reading a byte of its
#   body; then it reads at most the signed length and checks the digest (`check_body`).
# - The target binds a signature to one receiver: each process keeps its own nonces, so
#   without it a request captured on its way to one worker could be replayed once to every
#   other process of the deployment. The receiver checks the target against the socket the
#   request came in on (ASGI scope["server"]: uvicorn gives the connection's local address,
#   also when it listens on 0.0.0.0), never against the Host header, which whoever replays
#   chooses. See `_receiver_mismatch`.
# - Headers of the first format ("ts:nonce:mac", no receiver) are refused: no downgrade.

AUTH_HEADER = "x-pdserve-auth"
WIRE_VERSION = "v2"
MAX_SKEW_S = 300.0  # clocks of hosts in one deployment may differ this much
MAX_SIGNED_BODY_BYTES = 64 << 20
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
_HEX = re.compile(r"[0-9a-f]+")
_TARGET = re.compile(r"(?:\[(?P<ip6>[0-9a-f:.]+)\]|(?P<host>[a-z0-9_.-]+)):(?P<port>[0-9]{1,5})")


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`host` as an IP address (an IPv4-mapped IPv6 one as the IPv4 it maps, a zone id
    dropped: it names an interface of one host only), or None for a host name."""
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def target_of(url: httpx.URL | str) -> str:
    """The receiver a request to `url` is signed for: "host:port", the port explicit (80 for
    http when the URL names none), an IPv6 literal in brackets, a host name in lower case."""
    url = httpx.URL(url)
    raw = url.raw_host.decode("ascii")
    port = url.port or _DEFAULT_PORTS.get(url.scheme)
    if port is None:
        raise ValueError(f"cannot sign a request to {url}: no port and no default port for {url.scheme!r}")
    ip = _ip(raw)
    if ip is None:
        host = raw.lower()
    else:
        host = f"[{ip.compressed}]" if ip.version == 6 else ip.compressed
    return f"{host}:{port}"


def _head_mac(
    secret: bytes, method: str, path: str, target: str, ts: str, nonce: str, length: int, digest: str
) -> bytes:
    fields = (WIRE_VERSION, method.upper(), target, ts, nonce, str(length), digest)
    return _mac(secret, *(f.encode() for f in fields), path.encode())  # the path, free-form, last


def sign_request(secret: bytes, method: str, path: str, body: bytes, target: str, now: float | None = None) -> str:
    """The value of the `X-PDServe-Auth` header for one request to `target` (`target_of(url)`)."""
    if not _TARGET.fullmatch(target):
        raise ValueError(f"not a receiver to sign for: {target!r} (want host:port, see target_of)")
    ts = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(16)
    digest = hashlib.sha256(body).hexdigest()
    mac = _head_mac(secret, method, path, target, ts, nonce, len(body), digest)
    return f"{WIRE_VERSION}:{ts}:{nonce}:{len(body)}:{digest}:{mac.hex()}:{target}"


def _receiver_mismatch(target: str, server, scheme: str) -> str | None:
    """None when a signature for `target` may be accepted by the server whose end of the
    connection is `server` (ASGI scope["server"]: (host, port)), else why not.

    The port must be the connection's local port. An IP literal must also be its local
    address (IPv4-mapped IPv6 counts as the IPv4 it maps, zone ids are ignored). A host name
    ("localhost", a DNS name) cannot be checked against the socket and is accepted on the
    port alone; so is an unspecified address (0.0.0.0, ::), which reaches this host on
    whatever interface. Processes that share a port on one host but not a network namespace
    are told apart by their addresses only when senders dial IP literals, as pdserve's
    workers advertise them. A receiver behind NAT or a port mapping (reached at an address
    or port that is not its socket's) refuses signed calls: advertise a name, and the port
    it listens on."""
    m = _TARGET.fullmatch(target)
    if m is None:
        return f"malformed receiver {target!r} in the {AUTH_HEADER} header"
    if not server:
        return "this server cannot tell its own address to check the signed receiver against"
    local_host, local_port = str(server[0]), server[1]
    if local_port is None:  # httpx's ASGITransport: the URL's host and port, None when the scheme's default
        if local_host.startswith("/"):
            return "this server listens on a Unix socket: no address to check the signed receiver against"
        local_port = _DEFAULT_PORTS.get(scheme)
    here = f"{local_host}:{local_port}"
    if int(m["port"]) != local_port:
        return f"signed for another receiver ({target}; this is {here})"
    ip = _ip(m["ip6"] or m["host"])
    if ip is None or ip.is_unspecified:
        return None
    if ip != _ip(local_host):
        return f"signed for another receiver ({target}; this is {here})"
    return None


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


@dataclass(frozen=True)
class SignedHead:
    """What an authentic header promises about the body that follows it."""

    length: int
    digest: str


class Verifier:
    """Checks `X-PDServe-Auth` headers against the secret."""

    def __init__(self, secret: bytes, max_skew_s: float = MAX_SKEW_S, aliases=()):
        self.secret = secret
        self.max_skew_s = max_skew_s
        # receivers' names this process also answers to (`--internal-aliases`): a port mapping
        # or a Service in front of it, which its socket cannot tell
        self.aliases = {target_of(a if "://" in a else f"http://{a}") for a in aliases or ()}
        self._nonces = _Nonces(max_skew_s)
        self.refused = 0  # requests refused by InternalAuth (a /metrics counter)

    def check_head(
        self,
        header: str | None,
        method: str,
        path: str,
        server,
        scheme: str = "http",
        now: float | None = None,
    ) -> tuple[str | None, SignedHead | None]:
        """(None, what the body must be) when the header is authentic, fresh, unused and signed
        for this receiver (`server`: ASGI scope["server"]), else (why not, None). Needs no body;
        spends the nonce."""
        if not header:
            return f"missing {AUTH_HEADER} header (internal routes need the cluster token)", None
        parts = header.split(":", 6)
        if parts[0] != WIRE_VERSION:
            if len(header.split(":")) == 3:
                return f"{AUTH_HEADER} header of an older pdserve (no receiver signed): upgrade the sender", None
            return f"malformed {AUTH_HEADER} header", None
        try:
            _, ts_s, nonce, length_s, digest, mac_hex, target = parts
            ts, length, mac = float(ts_s), int(length_s), bytes.fromhex(mac_hex)
            if (
                len(nonce) != 32
                or len(digest) != 64
                or not _HEX.fullmatch(nonce + digest)
                or not length_s.isdigit()
                or not _TARGET.fullmatch(target)
            ):
                raise ValueError
        except ValueError:
            return f"malformed {AUTH_HEADER} header", None
        want = _head_mac(self.secret, method, path, target, ts_s, nonce, length, digest)
        if not hmac.compare_digest(mac, want):
            return "bad signature (wrong cluster token?)", None
        now = time.time() if now is None else now
        if abs(now - ts) > self.max_skew_s:
            return f"stale signature ({now - ts:+.0f} s; are the hosts' clocks in sync?)", None
        why = None if target in self.aliases else _receiver_mismatch(target, server, scheme)
        if why is not None:
            return why, None
        if not self._nonces.fresh(nonce, ts, now):
            return "replayed request", None
        return None, SignedHead(length, digest)

    @staticmethod
    def check_body(head: SignedHead, body: bytes) -> str | None:
        """None when `body` is the one `head` was signed with, else why not."""
        if len(body) != head.length or not hmac.compare_digest(hashlib.sha256(body).hexdigest(), head.digest):
            return "the body does not match its signature"
        return None

    def check(
        self,
        header: str | None,
        method: str,
        path: str,
        body: bytes,
        server,
        scheme: str = "http",
        now: float | None = None,
    ) -> str | None:
        """None when the request is authentic, else why not (`check_head`, then `check_body`)."""
        why, head = self.check_head(header, method, path, server, scheme, now)
        return why if why is not None else self.check_body(head, body)


def http_auth(secret: bytes):
    """An `httpx.Auth` that signs every request with the secret, for the receiver it is sent to."""

    class _Signer(httpx.Auth):
        requires_request_body = True

        def auth_flow(self, request):
            request.headers[AUTH_HEADER] = sign_request(
                secret, request.method, request.url.raw_path.decode(), request.content, target_of(request.url)
            )
            yield request

    return _Signer()


def _signed_path(scope) -> str:
    query = scope.get("query_string", b"")
    raw_path = scope.get("raw_path") or scope["path"].encode()
    return raw_path.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")


async def read_signed(
    verifier: Verifier, scope, receive, send, max_body_bytes: int = MAX_SIGNED_BODY_BYTES, who: str = ""
) -> bytes | None:
    """The body of a signed request, or None when it was refused (the answer sent: 401 or 413,
    the refusal logged and counted) or the client went away.

    The header is checked before any of the body is read, and no more than the signed length
    is ever read: an unauthenticated caller makes the server hold nothing."""
    header = dict(scope["headers"]).get(AUTH_HEADER.encode())
    why, head = verifier.check_head(
        header.decode("latin-1") if header else None,
        scope["method"],
        _signed_path(scope),
        scope.get("server"),
        scope.get("scheme", "http"),
    )
    status = 401
    if head is not None and head.length > max_body_bytes:
        why, status = f"internal request body too large ({head.length} > {max_body_bytes} bytes)", 413
    if why is None:
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > head.length:
                why = f"the body is longer than the {head.length} bytes signed"
                break
            chunks.append(chunk)
            more = msg.get("more_body", False)
        else:
            body = b"".join(chunks)
            why = verifier.check_body(head, body)
            if why is None:
                return body
    verifier.refused += 1
    peer = scope.get("client") or ("?", 0)
    log.warning(
        "%srefused unauthenticated %s %s from %s:%s: %s",
        who,
        scope["method"],
        scope["path"],
        peer[0],
        peer[1],
        why,
    )
    await _refuse(send, status, why)
    return None


class InternalAuth:
    """ASGI middleware: requests under `prefixes` must be signed with the cluster secret, for
    this server.

    The header is checked first, then the body (at most its signed length) against its
    digest; then it is handed on unchanged. Refusals are 401 (413 for a body over
    `max_body_bytes`) in OpenAI's error shape, logged with the peer's address, and reach no
    handler."""

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
        body = await read_signed(self.verifier, scope, receive, send, self.max_body_bytes)
        if body is None:
            return
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _refuse(send, status: int, message: str) -> None:
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
