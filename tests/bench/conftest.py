"""A real `pdserve serve` on the tiny model, on a free loopback port, always stopped."""

import pytest

from pdserve.testing.serve import Serve

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


class Server(Serve):
    """The tiny model served under the name "tiny", started at once."""

    def __init__(self, model_dir: str, *extra: str, mode: str = "collocated", timeout_s: float = 120):
        args = ["--mode", mode, "--model", model_dir, "--served-model-name", "tiny", *TINY_FLAGS, *extra]
        super().__init__(args, startup_timeout_s=timeout_s, log_level=None, stop_timeout_s=20)
        self.start()


@pytest.fixture(scope="session")
def bench_server(tiny_model_dir):
    """Shared by the tests of this folder; each test leaves it idle."""
    server = Server(tiny_model_dir)
    try:
        yield server
    finally:
        server.stop()
