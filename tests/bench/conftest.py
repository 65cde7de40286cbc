"""A real `pdserve serve` on the tiny model, on a free loopback port, always stopped."""

import os
import signal
import subprocess
import sys
import tempfile

import pytest

from pdserve.ports import free_port, health_is, wait_until

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_FLAGS = [
    "--dtype",
    "float32",
    "--threads",
    "1",
    "--block-size",
    "4",
    "--num-gpu-blocks",
    "1024",
    "--max-num-seqs",
    "32",
    "--max-num-batched-tokens",
    "256",
]


class Server:
    def __init__(self, model_dir: str, *extra: str, mode: str = "collocated", timeout_s: float = 120):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile()
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "serve",
            "--mode",
            mode,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--model",
            model_dir,
            "--served-model-name",
            "tiny",
            *TINY_FLAGS,
            *extra,
        ]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        wait_until(lambda: health_is(self.url), [self.proc], timeout_s, "the server", self.log, interval_s=0.1)

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 20) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def bench_server(tiny_model_dir):
    """Shared by the tests of this folder; each test leaves it idle."""
    server = Server(tiny_model_dir)
    try:
        yield server
    finally:
        server.stop()
