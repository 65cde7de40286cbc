"""The collocated `pdserve serve` the server tests talk to: pdserve.testing.serve.Serve, started
at once, with the server's own log level (the tests read its request log lines)."""

from __future__ import annotations

import os

from pdserve.testing.serve import Serve

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ServerProcess(Serve):
    def __init__(
        self,
        *args: str,
        api_key: str | None = None,
        wait_ready: bool = True,
        timeout_s: float = 180,
        env: dict | None = None,
    ):
        super().__init__(
            ["--mode", "collocated", *args],
            startup_timeout_s=timeout_s,
            env=env,
            log_level=None,
            api_key=api_key,
            wait=wait_ready,
            stop_timeout_s=20,
        )
        self.start()
