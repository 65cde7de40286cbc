"""allowed_token_ids (vLLM's sampling parameter): only those tokens are ever sampled, greedy or
not, beside unconstrained rows of the same batch; bad lists are refused before queueing."""

import pytest

from pdserve import SamplingParams
from pdserve.engine.sampling_params import InvalidRequest


def test_only_the_allowed_tokens_are_sampled(tiny_llm):
    allowed = [97, 10, 50, 77]  # ids of the tiny model's byte-level vocabulary
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    held = [
        SamplingParams(temperature=t, seed=3, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)
        for t in (0, 1.0)
    ]
    alone = tiny_llm.generate(["hello"], free)[0].outputs[0].token_ids
    outs = tiny_llm.generate(["hello"] * 3, [free, *held])
    assert outs[0].outputs[0].token_ids == alone  # the unconstrained row is untouched
    for o in outs[1:]:
        assert set(o.outputs[0].token_ids) <= set(allowed) and len(o.outputs[0].token_ids) == 12
    assert not set(alone) <= set(allowed)  # (so the constraint did something)


@pytest.mark.parametrize("ids, why", [([], "empty"), ([-1], ">= 0"), ([10**6], "must be in")])
def test_bad_lists_are_refused(tiny_llm, ids, why):
    with pytest.raises(InvalidRequest, match=why) as e:
        tiny_llm.generate("x", SamplingParams(allowed_token_ids=ids))
    assert e.value.param == "allowed_token_ids"
