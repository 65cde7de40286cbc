"""A free TCP port, for the servers that pick their own (tests, benchmarks, a worker's KV
listener, a Mooncake master)."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now on `host` (another process may take it before the caller binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
