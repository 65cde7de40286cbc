"""Prompt logprobs (SamplingParams.prompt_logprobs) and vLLM's prompt dicts, on a tiny model."""

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.sampling_params import InvalidRequest

TEXT = "the quick brown fox jumps over the lazy dog, " * 3
PLP = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)


def reference(model_dir, ids):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].log_softmax(-1)


def check(out, lps_ref, k, tokenizer=None):
    """vLLM's form: per prompt token {token id: Logprob(logprob, rank, decoded_token)}."""
    ids, plp = out.prompt_token_ids, out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        entry, ref = plp[p], lps_ref[p - 1]
        own = entry[ids[p]]
        assert own.logprob == pytest.approx(ref[ids[p]].item(), abs=1e-4)
        assert own.rank == int((ref >= ref[ids[p]]).sum())  # its rank in the whole vocabulary
        if tokenizer is not None:
            assert own.decoded_token == tokenizer.decode([ids[p]], skip_special_tokens=False)
        top = ref.topk(k).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= k + 1
        assert [entry[t].rank for t in top] == list(range(1, k + 1))


def test_prompt_logprobs_match_transformers_over_chunks_and_cache_hits(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks=128, max_num_batched_tokens=16)
    ids = llm.tokenizer.encode(TEXT)
    assert len(ids) > 3 * 16  # computed over several chunks
    ref = reference(tiny_model_dir, ids)
    first = llm.generate(TEXT, PLP)[0]
    check(first, ref, 3, llm.tokenizer)
    # the prompt is in the prefix cache now: its logprobs are computed again all the same
    hits = llm.engine.block_manager.stats.hits_tokens
    again = llm.generate(TEXT, PLP)[0]
    check(again, ref, 3)
    assert llm.engine.block_manager.stats.hits_tokens == hits
    # and a request without prompt logprobs still reuses the cache
    llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=2))
    assert llm.engine.block_manager.stats.hits_tokens > hits
    assert first.outputs[0].token_ids == again.outputs[0].token_ids
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_prompt_logprobs_survive_preemption_once_each(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks=40, max_num_batched_tokens=64)
    prompts = [TEXT[:80], "a much longer prompt that spans several kv blocks of four tokens", TEXT[::-1][:80]]
    params = SamplingParams(temperature=0, max_tokens=40, prompt_logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        check(out, reference(tiny_model_dir, out.prompt_token_ids), 0)


def test_streamed_outputs_carry_prompt_logprobs_first_and_last(tiny_llm):
    eng = tiny_llm.engine
    eng.logprob_objects = False  # what the servers stream from: {token id: float}
    eng.add_request("r", "hello there", SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1, ignore_eos=True))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[0].prompt_logprobs is not None and outs[-1].prompt_logprobs == outs[0].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outs[1:-1])
    eng.logprob_objects = True
    plain = tiny_llm.generate("hello there", SamplingParams(max_tokens=2))[0]
    assert plain.prompt_logprobs is None


@pytest.mark.parametrize("bad", [-1, 10_000])
def test_prompt_logprobs_are_bounded(bad):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(prompt_logprobs=bad)
    assert e.value.param == "prompt_logprobs"


def test_generate_takes_vllm_prompt_dicts(tiny_llm):
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = tiny_llm.tokenizer.encode("hello world")
    want = tiny_llm.generate("hello world", sp)[0].outputs[0].token_ids
    got = tiny_llm.generate([{"prompt": "hello world"}, {"prompt_token_ids": ids}], sp)
    assert [o.outputs[0].token_ids for o in got] == [want, want]
    assert tiny_llm.generate({"prompt": "hello world"}, sp)[0].outputs[0].token_ids == want
    # numpy arrays and tensors of ids, and numpy integers, as vLLM users pass them
    np = pytest.importorskip("numpy")
    for form in (np.array(ids), torch.tensor(ids), [np.int64(t) for t in ids], {"prompt_token_ids": np.array(ids)}):
        assert tiny_llm.generate(form, sp)[0].outputs[0].token_ids == want
    assert len(tiny_llm.generate(np.array([ids, ids]), sp)) == 2
    for bad in ({"text": "x"}, {"prompt": 3}, {"prompt": "a", "prompt_token_ids": [1]}, 4.5, [[1, "a"]]):
        with pytest.raises(ValueError, match="prompt"):
            tiny_llm.generate([bad], sp)


def test_a_long_prompt_with_logprobs_is_computed_in_bounded_chunks(tmp_path):
    from pdserve.engine.scheduler import PROMPT_LOGPROBS_CHUNK
    from tests.tiny import write_tiny_model

    d = write_tiny_model(str(tmp_path / "m"), max_pos=2048)
    llm = LLM(d, dtype="float32", block_size=16, num_gpu_blocks=128, max_num_batched_tokens=2048)
    ids = [(7 * i) % 200 + 1 for i in range(PROMPT_LOGPROBS_CHUNK + 200)]
    eng = llm.engine
    eng.add_request("a", ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
    eng.add_request("b", ids[::-1], SamplingParams(max_tokens=1))
    first = eng.step()
    # its logits are kept for every position: at most a chunk of them a step; the other
    # prompt is not held back by it (whole in this step, its one token out)
    assert eng.seqs["a"].num_computed_tokens == PROMPT_LOGPROBS_CHUNK
    assert [o.request_id for o in first if o.finished] == ["b"]
    while eng.has_unfinished_requests():
        outs = eng.step()
    done = {o.request_id: o for o in outs}
    assert len(done["a"].prompt_logprobs) == len(ids)
