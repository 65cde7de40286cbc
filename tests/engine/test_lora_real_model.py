"""LoRA on the embedded model (GGUF weights: the block kernels, and the fused C++ decode layer
its base rows take): token-identical to PEFT over transformers' reading of the same file."""

import os

import pytest
import torch

from pdserve import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.integration
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

PROMPTS = ["What is the capital of France? Answer in one sentence.", "def fibonacci(n):\n    ", "List three colours:"]
MAX_TOKENS = 10


def test_gguf_model_with_an_adapter_matches_peft(real_model_path, tmp_path):
    d, f = os.path.split(real_model_path)
    base = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    model = peft.get_peft_model(base, config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(str(tmp_path / "adapter"))
    model.eval()

    llm = LLM(dtype="float32", block_size=16, enable_lora=True)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    want, base_want = [], []
    with torch.no_grad():
        for p in prompts:
            args = dict(
                input_ids=torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=2,
                eos_token_id=None,
            )
            want.append(model.generate(**args)[0, len(p) :].tolist())
            with model.disable_adapter():
                base_want.append(model.generate(**args)[0, len(p) :].tolist())
    assert want != base_want
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    lora = LoRARequest("test", 1, str(tmp_path / "adapter"))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, lora_request=lora)] == want
    # adapter rows beside base rows (which alone decode in the fused C++ layer)
    outs = llm.generate(prompts * 2, greedy, lora_request=[lora] * 3 + [None] * 3)
    assert [o.outputs[0].token_ids for o in outs] == want + base_want
