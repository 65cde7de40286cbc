"""The whole engine on a tiny random-weight model: modes agree, nothing leaks, bad input is named."""

import os

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.loader import ModelLoadError
from pdserve.engine.sampling_params import InvalidRequest
from tests.tiny import TINY_GREEDY as GREEDY
from tests.tiny import TINY_PROMPTS as PROMPTS
from tests.tiny import write_tiny_model


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_idle(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("qkv_bias", [False, True], ids=["llama", "qwen2"])
def test_matches_transformers(tmp_path, qkv_bias):
    transformers = pytest.importorskip("transformers")
    d = write_tiny_model(str(tmp_path / "m"), qkv_bias=qkv_bias, seed=3)
    llm = LLM(d, dtype="float32", block_size=4, num_gpu_blocks=128)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    outs = llm.generate(PROMPTS, GREEDY)
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        r = ref.generate(
            ids,
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            attention_mask=torch.ones_like(ids),
        )
        assert out.outputs[0].token_ids == r[0, ids.shape[1] :].tolist()


def test_batched_equals_sequential_and_no_leak(tiny_llm):
    one = [tiny_llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    assert tokens(tiny_llm.generate(PROMPTS, GREEDY)) == one
    assert_idle(tiny_llm)


def test_preemption_gives_the_same_tokens(tiny_model_dir, tiny_llm):
    ref = tokens(tiny_llm.generate(PROMPTS, GREEDY))
    small = LLM(tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks=40, max_num_batched_tokens=64)
    outs = small.generate(PROMPTS, GREEDY)
    assert small.engine.scheduler.num_preemptions > 0
    assert tokens(outs) == ref
    assert_idle(small)


def test_chunked_prefill_gives_the_same_tokens(tiny_model_dir, tiny_llm):
    ref = tokens(tiny_llm.generate(PROMPTS, GREEDY))
    chunked = LLM(
        tiny_model_dir,
        dtype="float32",
        block_size=4,
        num_gpu_blocks=64,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=5,
    )
    assert tokens(chunked.generate(PROMPTS, GREEDY)) == ref


def test_prefix_cache_reuses_blocks(tiny_llm):
    base = "the same system prompt for everyone, long enough to fill blocks. "
    first = tiny_llm.generate(base + "question one", GREEDY)
    hits = tiny_llm.engine.block_manager.stats.hits_tokens
    second = tiny_llm.generate(base + "question one", GREEDY)
    assert tiny_llm.engine.block_manager.stats.hits_tokens - hits >= 60
    assert tokens(first) == tokens(second)


@pytest.mark.parametrize(
    "prompt, params, param",
    [
        ("", SamplingParams(), "prompt"),
        ([[]], SamplingParams(), "prompt"),  # one prompt of zero token ids
        ("x" * 600, SamplingParams(), "prompt"),  # longer than the 512-token context
        ("hello", SamplingParams(max_tokens=513), "max_tokens"),  # more than the whole context
        ([10**6], SamplingParams(), "prompt"),
    ],
)
def test_bad_requests_are_named_and_leak_nothing(tiny_llm, prompt, params, param):
    with pytest.raises(InvalidRequest) as e:
        tiny_llm.generate(prompt, params)
    assert e.value.param == param
    assert_idle(tiny_llm)
    assert tiny_llm.generate("still fine", GREEDY)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"logprobs": 50}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        # these used to pass and then fail the whole batch's step (int64 tensor, torch.Generator seed)
        ({"top_k": 2**80}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop": ["x"] * 100_000}, "stop"),
        ({"stop": "x" * 500_000}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ],
)
def test_bad_sampling_params(kw, param):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**kw)
    assert e.value.param == param


def test_sampling_params_at_their_bounds():
    p = SamplingParams(
        min_tokens=4,
        max_tokens=4,
        top_k=2**31 - 1,
        seed=2**64 - 1,
        stop=["x" * 1024] * 64,
        stop_token_ids=list(range(64)),
    )
    assert len(p.stop) == 64 and SamplingParams(min_tokens=100, max_tokens=None).min_tokens == 100


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM("/nonexistent/model")


def test_truncated_gguf_is_named(tmp_path, real_model_path):
    bad = tmp_path / "cut.gguf"
    with open(real_model_path, "rb") as src:
        bad.write_bytes(src.read(os.path.getsize(real_model_path) // 2))
    with pytest.raises(ModelLoadError, match="truncated"):
        LLM(str(bad))
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(bad.read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match="cut.gguf|header.gguf"):
        LLM(str(header_only))


def test_abort_frees_blocks(tiny_llm):
    eng = tiny_llm.engine
    for i in range(3):
        eng.add_request(f"r{i}", PROMPTS[1], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.num_free_blocks < eng.block_manager.num_blocks
    for i in range(3):
        assert eng.abort_request(f"r{i}")
    assert_idle(tiny_llm)
    assert not eng.abort_request("r0")  # already gone


def test_abort_of_a_waiting_request(tiny_llm):
    eng = tiny_llm.engine
    eng.add_request("w", "waiting prompt", GREEDY)
    assert eng.abort_request("w")
    assert_idle(tiny_llm)


def test_aborting_many_waiting_requests_leaves_the_rest_running(tiny_llm):
    eng = tiny_llm.engine
    for i in range(2000):
        eng.add_request(f"fan-{i}", [5, 6, 7], GREEDY)
    eng.add_request("keep", "keep me", GREEDY)
    assert eng.stats()["num_waiting"] == 2001
    assert all(eng.abort_request(f"fan-{i}") for i in range(2000))
    assert eng.stats()["num_waiting"] == 1
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert {o.request_id for o in outs} == {"keep"} and outs[-1].finished
    assert_idle(tiny_llm)


def test_stop_string_trims_and_streams_no_stop_text(tiny_llm):
    free = tiny_llm.generate("abc", GREEDY)[0].outputs[0].text
    stop = free[3:5]
    assert stop and stop not in free[:3]
    eng = tiny_llm.engine
    eng.add_request("s", "abc", SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True))
    streamed, final = "", None
    while eng.has_unfinished_requests():
        for o in eng.step():
            streamed += o.new_text
            final = o
    cut = free.index(stop)
    assert final.outputs[0].text == free[:cut] == streamed
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop


def test_max_tokens_past_the_context_ends_at_the_context(tiny_model_dir):
    # as vLLM: served up to the context (512 tokens), finish reason "length", not refused
    llm = LLM(tiny_model_dir, dtype="float32", block_size=16, num_gpu_blocks=40)
    out = llm.generate([[5] * 500], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 512 - 500 and out.finish_reason == "length"
    assert_idle(llm)


def test_logit_bias_forces_and_forbids_tokens(tiny_llm):
    free = tiny_llm.generate("abc", GREEDY)[0].outputs[0].token_ids
    forced = tiny_llm.generate("abc", SamplingParams(temperature=0, max_tokens=5, logit_bias={70: 100}))[0]
    assert forced.outputs[0].token_ids == [70] * 5
    banned = tiny_llm.generate("abc", SamplingParams(temperature=0, max_tokens=12, logit_bias={free[0]: -100}))[0]
    assert banned.outputs[0].token_ids[0] != free[0]
    with pytest.raises(InvalidRequest) as e:
        tiny_llm.generate("abc", SamplingParams(logit_bias={10**6: 1.0}))
    assert e.value.param == "logit_bias"
    assert_idle(tiny_llm)


def test_stop_token_ids_and_eos(tiny_llm):
    free = tiny_llm.generate("abc", GREEDY)[0].outputs[0].token_ids
    out = tiny_llm.generate("abc", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[free[2]]))
    assert out[0].outputs[0].token_ids == free[:3] and out[0].outputs[0].stop_reason == free[2]


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10)
    alone = tokens(tiny_llm.generate("seeded", p))
    batched = tokens(
        tiny_llm.generate(
            ["other", "seeded", "more"], [SamplingParams(temperature=1.0), p, SamplingParams(temperature=0.7)]
        )
    )
    assert alone[0] == batched[1]
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=10)
    assert tokens(tiny_llm.generate("seeded", other_seed)) != alone


def test_logprobs_are_returned_and_consistent(tiny_llm):
    # vLLM's form offline: per token {token id: Logprob(logprob, rank, decoded_token)}
    out = tiny_llm.generate("abc", SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert len(lp) == 3 and tok in lp  # greedy token is the top-1
        assert lp[tok].logprob == max(x.logprob for x in lp.values()) <= 0 and lp[tok].rank == 1
        assert sorted(x.rank for x in lp.values()) == [1, 2, 3]
        assert lp[tok].decoded_token == tiny_llm.tokenizer.decode([tok])
    assert out.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)))
    # sampled tokens outside the top k keep their rank in the whole vocabulary: the same rank the
    # prompt logprobs give them when the text is scored again
    hot = SamplingParams(temperature=5.0, seed=1, max_tokens=12, logprobs=1, ignore_eos=True)
    sampled = tiny_llm.generate("abc", hot)[0]
    out = sampled.outputs[0]
    ranks = [lp[t].rank for t, lp in zip(out.token_ids, out.logprobs)]
    assert max(ranks) > 2  # some were drawn from far down the distribution
    ids = sampled.prompt_token_ids + out.token_ids
    scored = tiny_llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    n = len(sampled.prompt_token_ids)
    assert ranks == [scored[n + i][t].rank for i, t in enumerate(out.token_ids)]
    for t, lp in zip(out.token_ids, out.logprobs):
        assert [x.rank for x in lp.values()] == ([1] if len(lp) == 1 else [lp[t].rank, 1])


def test_penalties_change_repetition(tiny_llm):
    plain = tokens(tiny_llm.generate("aaaa", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)))[0]
    pen = tokens(
        tiny_llm.generate(
            "aaaa",
            SamplingParams(
                temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=2.0, frequency_penalty=2.0
            ),
        )
    )[0]
    assert len(set(pen)) >= len(set(plain)) and pen != plain


def test_n_returns_n_completions(tiny_llm):
    out = tiny_llm.generate("abc", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=5))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_copies_of_a_prompt_are_computed_once(tiny_llm):
    # n > 1 and a batch of one prompt: the copies wait for the first to fill the cache
    prompt = "one prompt for every choice, long enough to fill several blocks"
    ids = tiny_llm.tokenizer.encode(prompt)
    bs = tiny_llm.engine.block_manager.block_size
    tail = len(ids) - (len(ids) - 1) // bs * bs  # what a cache hit leaves to compute
    alone = tokens(tiny_llm.generate(prompt, GREEDY))
    tiny_llm.engine.block_manager.reset_prefix_cache()
    before = tiny_llm.engine.num_prompt_tokens_computed
    outs = tiny_llm.generate([prompt] * 3, GREEDY)
    assert tiny_llm.engine.num_prompt_tokens_computed - before == len(ids) + 2 * tail
    assert tokens(outs) == alone * 3
    tiny_llm.engine.block_manager.reset_prefix_cache()
    before = tiny_llm.engine.num_prompt_tokens_computed
    tiny_llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=4))
    assert tiny_llm.engine.num_prompt_tokens_computed - before == len(ids) + 3 * tail
    assert_idle(tiny_llm)


def test_chat_applies_template(tiny_llm):
    out = tiny_llm.chat([{"role": "user", "content": "hi"}], GREEDY)[0]
    assert tiny_llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False).startswith(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_incremental_detokenizer_never_splits_utf8(tiny_llm):
    from pdserve.engine.tokenizer import IncrementalDetokenizer

    tok = tiny_llm.tokenizer
    text = "héllo wörld 你好 🙂!"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [])
    pieces = [detok.step([i]) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_resume_continues_where_another_worker_stopped(tiny_llm):
    """A request resumed with the tokens a lost worker produced ends exactly as if uninterrupted."""
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = tiny_llm.generate("resume me", p)[0].outputs[0]
    eng = tiny_llm.engine
    ids = tiny_llm.tokenizer.encode("resume me")
    eng.add_request("res", ids, p, resume_token_ids=full.token_ids[:5])
    text = ""
    while eng.has_unfinished_requests():
        for o in eng.step():
            text += o.new_text
            final = o
    assert final.outputs[0].token_ids == full.token_ids
    assert final.outputs[0].text == full.text
    assert_idle(tiny_llm)


def test_resume_continues_the_text_exactly_where_the_stream_stopped(tmp_path):
    """A request replayed on another worker with the tokens so far (its decode worker
    died) must stream exactly the rest of the text, even when the tokens so far end
    inside a UTF-8 character (the sharp tiny model emits such byte tokens)."""
    d = write_tiny_model(str(tmp_path / "sharp"), logit_scale=8.0)
    eng = LLM(d, dtype="float32", block_size=16, num_gpu_blocks=256).engine
    prompt = "tell me a story about the sea and the ships that sail on it " * 4
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eng.add_request("ref", prompt, params)
    streamed, text, n = {}, "", 0  # tokens so far -> the text deltas a client had received by then
    while eng.has_unfinished_requests():
        for o in eng.step():
            text += o.new_text
            n += len(o.new_token_ids)
            streamed[n] = text
    ids = o.outputs[0].token_ids
    held_back = [k for k in range(1, len(ids)) if len(eng.tokenizer.decode(ids[:k])) != len(streamed[k])]
    assert held_back, "the test needs a cut inside a UTF-8 character"
    for k in range(1, len(ids)):
        eng.add_request(f"r{k}", prompt, params, resume_token_ids=ids[:k])
        rest = ""
        while eng.has_unfinished_requests():
            rest += "".join(o.new_text for o in eng.step())
        assert streamed[k] + rest == text, k


def test_step_outputs_carry_only_what_is_new(tiny_llm):
    """While a request runs, each step's output holds its new token, text and logprobs, not the
    whole completion so far: the 40th step's output is no bigger than the 2nd's. The finished
    output holds the whole completion, which the deltas add up to, as the offline API returns it."""
    from pdserve.server.async_engine import choice_output
    from pdserve.worker.decode import output_event

    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    eng = tiny_llm.engine
    eng.logprob_objects = False  # the servers' form: {token id: float}
    eng.add_request("inc", "abc", p)
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    running, final = outs[:-1], outs[-1]
    assert len(running) == 39 and final.finished and not any(o.finished for o in running)
    for o in running:
        c = o.outputs[0]
        assert c.token_ids == o.new_token_ids and len(c.token_ids) == 1
        assert c.text == o.new_text
        assert len(c.logprobs) == 1 and c.token_ids[0] in c.logprobs[0]
        # what the server's streams take from a step's output: the new tokens' logprobs
        assert choice_output(o).new_logprobs == c.logprobs
        assert output_event(choice_output(o))["logprobs"] == [{str(k): v for k, v in e.items()} for e in c.logprobs]
    c = final.outputs[0]
    assert c.token_ids == [t for o in outs for t in o.new_token_ids] and len(c.token_ids) == 40
    assert c.text == "".join(o.new_text for o in outs)
    assert c.logprobs[:-1] == [e for o in running for e in o.outputs[0].logprobs] and len(c.logprobs) == 40
    assert c.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(c.token_ids, c.logprobs)))
    assert running[-1].outputs[0].cumulative_logprob == pytest.approx(
        c.cumulative_logprob - c.logprobs[-1][c.token_ids[-1]]
    )
    last = choice_output(final)  # the front end's view: the last token's part, and the whole
    assert last.new_token_ids == c.token_ids[-1:] and last.new_logprobs == c.logprobs[-1:]
    assert (last.final.text, last.final.token_ids, last.final.finish_reason) == (c.text, c.token_ids, "length")
    eng.logprob_objects = True
    offline = tiny_llm.generate("abc", p)[0].outputs[0]
    assert (offline.token_ids, offline.text) == (c.token_ids, c.text)
    assert [{t: x.logprob for t, x in e.items()} for e in offline.logprobs] == c.logprobs
    assert offline.finish_reason == c.finish_reason == "length"


def test_offline_chat_takes_vllms_arguments(tiny_llm):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    # vLLM's order: messages, sampling_params, use_tqdm; the rest by keyword
    out = tiny_llm.chat(msgs, GREEDY, False, add_generation_prompt=False, continue_final_message=True)[0]
    prompt = tiny_llm.tokenizer.apply_chat_template(msgs, False, continue_final_message=True)
    assert prompt.endswith("Sure, ") and tokens([out]) == tokens(tiny_llm.generate(prompt, GREEDY))
    with pytest.raises(ValueError):
        tiny_llm.chat(msgs, GREEDY, continue_final_message=True)  # and add_generation_prompt (default)
    # a template of the caller's, with its variables and the tools
    template = "{% if loud %}!{% endif %}{{ tools | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    custom = tiny_llm.chat(
        msgs[:1], GREEDY, chat_template=template, chat_template_kwargs={"loud": True}, tools=[{"type": "function"}]
    )[0]
    assert tokens([custom]) == tokens(tiny_llm.generate("!1hi", GREEDY))


def test_chat_template_kwargs_and_continue_final_message(tiny_llm):
    tok = tiny_llm.tokenizer
    tok.chat_template = (
        "{% if think %}[think]{% endif %}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    tok._template = None
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    assert tok.apply_chat_template(msgs[:1], template_args={"think": True}) == "[think]<user>hi</s><assistant>"
    # the variables the server sets win over the caller's
    assert tok.apply_chat_template(msgs[:1], False, template_args={"messages": []}) == "<user>hi</s>"
    assert tok.apply_chat_template(msgs, False, continue_final_message=True) == "<user>hi</s><assistant>Sure, "
    with pytest.raises(ValueError):
        tok.apply_chat_template([*msgs[:1], {"role": "assistant", "content": ""}], False, continue_final_message=True)
