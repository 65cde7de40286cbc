"""End to end on the embedded SmolLM2 GGUF: the official client gets the offline engine's greedy answer."""

import pytest

from pdserve import LLM, SamplingParams
from tests.server.serverproc import ServerProcess

pytestmark = pytest.mark.integration

openai = pytest.importorskip("openai")

ENGINE = dict(num_gpu_blocks=128, max_num_seqs=4)  # a small KV pool loads fast
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_real_model_chat_matches_offline(real_model_path):
    flags = [x for k, v in ENGINE.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    with ServerProcess("--model", real_model_path, *flags, wait_ready=False) as srv:
        # load the offline reference while the server loads its own copy
        ref = LLM(real_model_path, **ENGINE).chat(QUESTION, SamplingParams(temperature=0, max_tokens=24))[0]
        srv.wait_health(200, 180)
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=24)
        stream = client.chat.completions.create(
            model=model, messages=QUESTION, temperature=0, max_tokens=24, stream=True
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert model == "SmolLM2-135M-Instruct.Q4_1"
    assert r.choices[0].message.content == streamed == ref.outputs[0].text
    assert "Paris" in streamed
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
