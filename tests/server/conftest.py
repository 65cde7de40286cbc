import contextlib

import pytest

from tests.server.serverproc import ServerProcess

API_KEY = "test-key"
# One engine shape for the tiny server and its offline reference, so greedy text can be compared.
TINY_ENGINE = dict(dtype="float32", block_size=16, num_gpu_blocks=2048, max_num_seqs=32, max_num_batched_tokens=256)
CONTEXT = 2048  # long enough that 20 streams are still running when a test cuts them


def engine_flags(**kw) -> list[str]:
    return [x for k, v in kw.items() for x in (f"--{k.replace('_', '-')}", str(v))]


@pytest.fixture(scope="session")
def server_model_dir(tmp_path_factory):
    from tests.tiny import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-server")), max_pos=CONTEXT)


@pytest.fixture(scope="session")
def tiny_server(server_model_dir):
    """The shared tiny-model server (API key on); tests must leave it idle."""
    with ServerProcess(
        "--model",
        server_model_dir,
        "--threads",
        "1",
        "--max-request-body-bytes",
        "65536",
        "--served-model-name",
        "tiny",
        *engine_flags(**TINY_ENGINE),
        api_key=API_KEY,
    ) as server:
        yield server


@pytest.fixture(scope="session")
def tiny_offline(server_model_dir):
    from pdserve import LLM

    return LLM(server_model_dir, **TINY_ENGINE)


@pytest.fixture
def client(tiny_server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def model_id(client):
    return client.models.list().data[0].id


@contextlib.contextmanager
def tiny_openai(model_dir: str, *flags: str):
    """A server of the tiny model started with `flags` (no API key), and an openai client of it."""
    openai = pytest.importorskip("openai")
    with (
        ServerProcess(
            "--model", model_dir, "--threads", "1", "--served-model-name", "tiny", *flags, *engine_flags(**TINY_ENGINE)
        ) as server,
        openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as client,
    ):
        yield client
