"""bad_words (vLLM's sampling parameter): the output never contains a listed word's tokens."""

from __future__ import annotations

import pytest

from pdserve import SamplingParams
from pdserve.engine.sampler import bad_words_token_ids
from pdserve.engine.sampling_params import MAX_BAD_WORDS, InvalidRequest

GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i : i + len(part)] == part for i in range(len(seq) - len(part) + 1))


@pytest.mark.integration
def test_the_real_model_avoids_a_word_it_would_say():
    """SmolLM2 says Paris; forbidden "Paris" (one or more tokens, with or without a leading
    space), it says something else and never those tokens."""
    from pdserve import LLM

    llm = LLM(dtype="float32", num_gpu_blocks=64)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    params = dict(temperature=0.0, max_tokens=24)
    ref = llm.generate(prompt, SamplingParams(**params))[0].outputs[0]
    assert "Paris" in ref.text
    out = llm.generate(prompt, SamplingParams(bad_words=["Paris", "paris"], **params))[0].outputs[0]
    assert "Paris" not in out.text and out.token_ids != ref.token_ids
    for w in bad_words_token_ids(llm.tokenizer, ["Paris"]):
        assert not _contains(out.token_ids, w)
    llm.close()


def test_a_one_token_word_is_never_sampled(tiny_llm):
    tok = tiny_llm.tokenizer
    prompt = list(range(30, 50))
    ref = tiny_llm.generate([prompt], SamplingParams(**GREEDY))[0].outputs[0].token_ids
    singles = [tok.decode([t]) for t in ref if bad_words_token_ids(tok, [tok.decode([t])])[0] == [t]]
    assert singles
    params = SamplingParams(bad_words=singles, **GREEDY)
    out = tiny_llm.generate([prompt], params)[0].outputs[0].token_ids
    banned = {w[0] for w in bad_words_token_ids(tok, singles) if len(w) == 1}
    assert len(out) == 12 and not banned & set(out)


def test_bad_words_are_bounded():
    for words in (["x"] * (MAX_BAD_WORDS + 1), ["  "], ["x" * 300]):
        with pytest.raises(InvalidRequest, match="bad.word"):
            SamplingParams(bad_words=words)
    assert SamplingParams(bad_words=[]).bad_words is None
    assert SamplingParams(bad_words="Paris").bad_words == ["Paris"]  # one word, not five letters


def test_a_word_outside_the_models_vocabulary_is_refused_when_added(tmp_path):
    """A tokenizer's added token past the model's vocabulary: refused with the request (it used
    to fail the engine step, and with it every request in flight)."""
    import os

    from tokenizers import Tokenizer

    from pdserve import LLM
    from tests.tiny import write_tiny_model

    d = write_tiny_model(str(tmp_path))
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    tok.add_special_tokens(["<extra_0>"])  # past the model's embedding
    tok.save(os.path.join(d, "tokenizer.json"))
    llm = LLM(d, dtype="float32", block_size=4, num_gpu_blocks=64)
    with pytest.raises(InvalidRequest, match="outside this model's vocabulary") as e:
        llm.generate("hi", SamplingParams(bad_words=["<extra_0>"], max_tokens=2))
    assert e.value.param == "bad_words"
    assert llm.generate("hi", SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids  # still serving
