"""bf16 mode (the `dtype="auto"` choice on CPUs with AVX512-BF16/AMX) is not token-identical
to float32; its greedy tokens must agree with transformers in bf16 on >= 97% of the steps of
the parity prompts (teacher-forced: transformers names its own greedy token given pdserve's
history). Not timed. Float32 stays exact: tests/engine/test_parity_hf.py."""

import pytest
import torch

from pdserve import LLM
from pdserve.testing.agreement import engine_outputs, load_reference, measure, parity_prompts

pytestmark = pytest.mark.integration

pytest.importorskip("transformers")
TOKENS = 24


@pytest.fixture(scope="module")
def bf16_llm():
    return LLM(dtype="bfloat16", block_size=16, max_num_batched_tokens=2048)


def test_bf16_mode_runs_bf16_end_to_end(bf16_llm):
    runner = bf16_llm.engine.runner
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    assert runner.model.layers[0].gate_up_proj.weight.dtype == torch.bfloat16
    assert runner.model.cos_table.dtype == torch.float32  # rounded per use, as transformers does


def test_bf16_top1_agreement_with_transformers_bf16(bf16_llm, real_model_path):
    prompts = parity_prompts(bf16_llm.tokenizer)
    outs = engine_outputs(bf16_llm, prompts, TOKENS)
    res = measure(load_reference(real_model_path, torch.bfloat16), prompts, outs)
    summary = res.summary()
    assert res.steps == TOKENS * len(prompts)
    assert res.top1 >= 0.97, summary
