"""LoRA adapters (engine/lora.py): PEFT's adapters, applied per row, token for token as PEFT
computes them, batched with other adapters and with none, each in its own prefix cache."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from pdserve import LLM, LoRARequest, SamplingParams
from pdserve.config import ConfigError
from pdserve.engine.lora import LoRAError, parse_modules
from pdserve.engine.sampling_params import InvalidRequest
from tests.tiny import peft_model, write_tiny_lora, write_tiny_model

pytest.importorskip("peft")

PROMPTS = [[5, 9, 13, 40, 41, 42, 43, 44, 200, 7], [100, 101, 102], list(range(30, 51))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(str(tmp_path_factory.mktemp("lora-base")), seed=5)


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    return {
        "all": write_tiny_lora(model, str(d / "all"), seed=1),
        # attention only, rsLoRA scaling, another rank
        "attn": write_tiny_lora(
            model, str(d / "attn"), r=4, alpha=8, targets=("q_proj", "v_proj"), seed=2, use_rslora=True
        ),
    }


def _llm(model, **kw):
    args = dict(dtype="float32", block_size=4, num_gpu_blocks=128, max_num_batched_tokens=64, enable_lora=True)
    return LLM(model, **{**args, **kw})


def _reference(model, adapter, prompts, max_new_tokens=10):
    ref = peft_model(model, adapter) if adapter else None
    if ref is None:
        import transformers

        ref = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        r = ref.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out.append(r[0, ids.shape[1] :].tolist())
    return out


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_output_matches_peft_token_for_token(model, adapters):
    llm = _llm(model, max_loras=2)
    base = _tokens(llm.generate(PROMPTS, GREEDY))
    assert base == _reference(model, None, PROMPTS)
    for i, (name, path) in enumerate(adapters.items()):
        got = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest(name, i + 1, path)))
        assert got == _reference(model, path, PROMPTS), name
        assert got != base  # the adapter changes the output: the test can tell
    assert set(llm.engine.list_loras()) == {"all", "attn"}


def test_mixed_batches_equal_each_adapter_alone_and_leak_nothing(model, adapters):
    """Rows of two adapters and of none in the same steps (prefills and decodes)."""
    llm = _llm(model, max_loras=2, max_num_seqs=8)
    reqs = [None, LoRARequest("all", 1, adapters["all"]), LoRARequest("attn", 2, adapters["attn"])]
    alone = {}
    for r in reqs:
        alone[r] = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=r))
    prompts = [p for p in PROMPTS for _ in reqs]
    mixed = _tokens(llm.generate(prompts, GREEDY, lora_request=[r for _ in PROMPTS for r in reqs]))
    for k, r in enumerate(reqs):
        assert mixed[k :: len(reqs)] == alone[r]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()


def test_each_adapter_has_its_own_prefix_cache(model, adapters):
    llm = _llm(model)
    lora = LoRARequest("all", 1, adapters["all"])
    prompt = [list(range(20, 57))]  # 9 full blocks of 4
    first = llm.generate(prompt, GREEDY, lora_request=lora)[0]
    assert first.num_cached_tokens == 0
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens == 0  # the base model's KV is other KV
    again = llm.generate(prompt, GREEDY, lora_request=lora)[0]
    assert again.num_cached_tokens == 36 and again.outputs[0].token_ids == first.outputs[0].token_ids
    # the same name with other weights is another adapter: its own cache, its own output
    other = llm.generate(prompt, GREEDY, lora_request=LoRARequest("all", 1, adapters["attn"]))[0]
    assert other.num_cached_tokens == 0 and other.outputs[0].token_ids != first.outputs[0].token_ids


def test_max_loras_bounds_the_adapters_of_a_step(model, adapters):
    llm = _llm(model, max_loras=1, max_cpu_loras=2, max_num_seqs=8)
    keys = [llm.engine.add_lora(LoRARequest(n, i, p)) for i, (n, p) in enumerate(adapters.items())]
    seen = []
    llm.engine.add_step_observer(
        lambda rec: seen.append({s.seq.params.lora_adapter for s in llm.engine.last_schedule.scheduled} - {None})
    )
    prompts = PROMPTS * 2
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, lora_adapter=keys[i % 2]) for i in range(6)
    ]
    outs = llm.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert seen and max(len(s) for s in seen) == 1 and set().union(*seen) == set(keys)


def test_requests_for_adapters_a_worker_lacks_are_refused(model, adapters, tiny_model_dir):
    llm = _llm(model)
    with pytest.raises(InvalidRequest, match="not loaded"):
        llm.generate(PROMPTS[:1], SamplingParams(lora_adapter="all@0123456789abcdef"))
    plain = LLM(model, dtype="float32", block_size=4, num_gpu_blocks=64)
    with pytest.raises(InvalidRequest, match="without --enable-lora"):
        plain.generate(PROMPTS[:1], SamplingParams(lora_adapter="all@0123456789abcdef"))
    with pytest.raises(InvalidRequest, match="serves no LoRA"):
        plain.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("all", 1, adapters["all"]))


def _copy(src, dst, edit_config=None):
    shutil.copytree(src, dst)
    if edit_config:
        p = os.path.join(dst, "adapter_config.json")
        with open(p) as f:
            cfg = json.load(f)
        edit_config(cfg)
        with open(p, "w") as f:
            json.dump(cfg, f)
    return dst


def test_bad_adapters_are_refused_with_the_reason(model, adapters, tmp_path):
    llm = _llm(model, max_lora_rank=8)

    def load(path, name="x"):
        return llm.engine.add_lora(LoRARequest(name, 9, str(path)))

    with pytest.raises(LoRAError, match="rank 16, over --max-lora-rank 8"):
        load(_copy(adapters["all"], tmp_path / "r", lambda c: c.update(r=16)))
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        load(tmp_path)
    with pytest.raises(LoRAError, match="DoRA"):
        load(_copy(adapters["all"], tmp_path / "dora", lambda c: c.update(use_dora=True)))
    pickled = _copy(adapters["all"], tmp_path / "bin")
    os.rename(os.path.join(pickled, "adapter_model.safetensors"), os.path.join(pickled, "adapter_model.bin"))
    with pytest.raises(LoRAError, match="pickle"):
        load(pickled)
    other = write_tiny_model(str(tmp_path / "wide"), hidden=96, heads=4, kv_heads=2, seed=2)
    with pytest.raises(LoRAError, match="another model"):
        load(write_tiny_lora(other, str(tmp_path / "wide-lora")))
    with pytest.raises(LoRAError, match="not a LoRA A/B matrix"):
        load(write_tiny_lora(model, str(tmp_path / "head"), targets=("q_proj", "lm_head")))
    for bad in ("a b", "a@b", "a=b", "x" * 129):
        with pytest.raises(LoRAError, match="without spaces"):
            load(adapters["all"], name=bad)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and llm.engine.list_loras() == {}


def test_lora_modules_flag_forms_and_limits(model, adapters):
    assert parse_modules(["a=/x", '{"name": "b", "path": "/y"}']) == [("a", "/x"), ("b", "/y")]
    for bad in (["a"], ["a=/x", "a=/y"], ['{"name": "b"}'], ["=x"]):
        with pytest.raises(LoRAError):
            parse_modules(bad)
    with pytest.raises(ConfigError, match="needs --enable-lora"):
        LLM(model, lora_modules=["a=/x"])
    llm = _llm(model, lora_modules=[f"sql={adapters['all']}"], max_cpu_loras=1)
    assert list(llm.engine.list_loras()) == ["sql"]
    with pytest.raises(LoRAError, match="--max-cpu-loras 1"):  # the start-up adapter stays
        llm.engine.add_lora(LoRARequest("other", 2, adapters["attn"]))


def test_loading_past_max_cpu_loras_unloads_the_oldest_unused(model, adapters):
    llm = _llm(model, max_cpu_loras=1)
    a = llm.engine.add_lora(LoRARequest("a", 1, adapters["all"]))
    b = llm.engine.add_lora(LoRARequest("b", 2, adapters["attn"]))
    assert llm.engine.list_loras() == {"b": b}
    llm.engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=2, lora_adapter=b))
    with pytest.raises(LoRAError, match="in use"):  # b serves a request
        llm.engine.add_lora(LoRARequest("a", 1, adapters["all"]))
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.engine.add_lora(LoRARequest("a", 1, adapters["all"])) == a


def test_bf16_agreement_with_peft(model, adapters):
    """bf16 keeps the adapter's effect: most greedy tokens as PEFT's fp32 ones."""
    llm = _llm(model, dtype="bfloat16")
    got = _tokens(llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("all", 1, adapters["all"])))
    ref = _reference(model, adapters["all"], PROMPTS)
    same = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r))
    assert same >= 0.6 * sum(map(len, ref)), (got, ref)


def test_a_call_naming_more_adapters_than_a_worker_holds_is_refused_clearly(model, adapters):
    llm = _llm(model)  # max_loras 1: max_cpu_loras 1
    reqs = [LoRARequest("all", 1, adapters["all"]), LoRARequest("attn", 2, adapters["attn"])]
    with pytest.raises(LoRAError, match="named by the same call"):
        llm.generate(PROMPTS[:2], GREEDY, lora_request=reqs)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()


def test_a_request_for_another_adapter_is_not_starved_by_a_busy_one(model, adapters):
    """max_loras 1: while adapter a runs, b waits; requests for a that come after b wait
    behind it (a's slot drains), requests for the base model pass."""
    llm = _llm(model, max_loras=1, max_cpu_loras=2, max_num_seqs=8)
    eng = llm.engine
    a, b = (eng.add_lora(LoRARequest(n, i, p)) for i, (n, p) in enumerate(adapters.items()))
    params = {k: SamplingParams(max_tokens=6, ignore_eos=True, lora_adapter=k) for k in (a, b, None)}
    eng.add_request("a0", PROMPTS[1], params[a])
    eng.step()
    eng.add_request("b0", PROMPTS[1], params[b])
    started = {}
    for step in range(60):
        eng.add_request(f"a{step + 1}", PROMPTS[1], params[a])  # a stream of requests for a
        eng.add_request(f"base{step}", PROMPTS[1], params[None])
        eng.step()
        for s in eng.scheduler.running:
            started.setdefault(s.seq_id, step)
        if "b0" in started:
            break
    assert "b0" in started, "the request for b never started"
    assert all(started.get(f"a{i}", 99) > started["b0"] for i in range(2, 60) if f"a{i}" in started)
    assert "base1" in started and started["base1"] <= started["b0"]  # the base model was not held up
    while eng.has_unfinished_requests():
        eng.step()


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda c, t: c.update(lora_alpha=1e308), "scales its product"),
        (lambda c, t: t.update({k: v.to(torch.int8) for k, v in t.items()}), "float16, bfloat16 or float32"),
        (lambda c, t: t.update({k: v.double() for k, v in t.items()}), "float16, bfloat16 or float32"),
        (lambda c, t: t.update({k: v * float("inf") for k, v in t.items()}), "not finite"),
        (lambda c, t: t.update({k: v * 1e30 for k, v in t.items()}), "not a trained adapter"),
    ],
    ids=["alpha", "int8", "float64", "inf", "huge"],
)
def test_adapters_with_values_no_training_gives_are_refused(model, adapters, tmp_path, edit, match):
    from safetensors.torch import load_file, save_file

    d = _copy(adapters["all"], tmp_path / "bad")
    with open(d / "adapter_config.json") as f:
        cfg = json.load(f)
    tensors = load_file(str(d / "adapter_model.safetensors"))
    edit(cfg, tensors)
    with open(d / "adapter_config.json", "w") as f:
        json.dump(cfg, f)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    llm = _llm(model)
    with pytest.raises(LoRAError, match=match):
        llm.engine.add_lora(LoRARequest("bad", 1, str(d)))
    assert llm.engine.list_loras() == {}


def test_generate_command_picks_an_adapter_of_its_lora_modules(model, adapters):
    """`pdserve generate --lora-name NAME`: the prompts run with that adapter (the same text the
    offline API gives with it); a name not among --lora-modules is refused with exit 2."""
    import subprocess
    import sys

    def generate(*extra):
        cmd = [sys.executable, "-m", "pdserve.cli", "generate", "--model", model, "--dtype", "float32"]
        cmd += ["--enable-lora", "--lora-modules", f"all={adapters['all']}", f"attn={adapters['attn']}"]
        cmd += ["--prompt", "hello world", "--max-tokens", "8", "--json", *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    llm = _llm(model)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    want = llm.generate(["hello world"], params, lora_request=LoRARequest("attn", 2, adapters["attn"]))
    base = llm.generate(["hello world"], params)
    llm.close()
    assert want[0].outputs[0].text != base[0].outputs[0].text
    r = generate("--lora-name", "attn")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["text"] == want[0].outputs[0].text and "'attn'" in r.stderr
    r = generate("--lora-name", "nope")
    assert r.returncode == 2 and "not one of the --lora-modules (given: all, attn)" in r.stderr
