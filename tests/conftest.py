import os

import pytest

# Keep tests predictable on the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session")
def real_model_path():
    from pdserve.engine.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tests.tiny import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def tiny_llm(tiny_model_dir):
    """A fresh tiny engine per test: 64 blocks of 4 tokens."""
    from pdserve import LLM

    return LLM(
        tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks=64, max_num_batched_tokens=64, max_num_seqs=8
    )
