"""A step's bookkeeping costs the same at the 3,000th token as at the 30th: nothing in it copies
a sequence's whole history (token ids, text, penalty counts). Counted in bytes allocated, not
timed."""

import random
import tracemalloc

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import OutputText, TokenIds
from tests.tiny import write_tiny_model

LONG = 3000


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = write_tiny_model(str(tmp_path_factory.mktemp("long")), max_pos=4096)
    cfg = EngineConfig.from_kwargs(
        model=d, dtype="float32", block_size=64, num_gpu_blocks=160, max_num_batched_tokens=4096, max_model_len=4096
    )
    return LLMEngine(cfg)


def _step_peak_bytes(engine, history: int, params: SamplingParams) -> int:
    """Peak bytes Python allocated during one decode step of a sequence `history` tokens into
    its output (reached in one prefill: a resumed request recomputes what it had streamed)."""
    rng = random.Random(history)
    vocab = engine.model_config.vocab_size - 3  # byte tokens only: every one has text
    out = [rng.randrange(vocab) for _ in range(history)]
    engine.add_request(f"r{history}", [1, 2, 3], params, resume_token_ids=out)
    engine.step()  # the prefill of prompt + history
    engine.step()  # one decode step to warm any per-sequence state
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        engine.step()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    engine.abort_request(f"r{history}")
    return peak


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=LONG + 16, ignore_eos=True, stop=["zzzq"], logprobs=2),
        SamplingParams(temperature=0, max_tokens=LONG + 16, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, seed=1, max_tokens=LONG + 16, ignore_eos=True, frequency_penalty=0.5),
    ],
    ids=["stop-and-logprobs", "repetition-penalty", "frequency-penalty"],
)
def test_a_decode_step_does_not_touch_the_whole_history(engine, params):
    short = _step_peak_bytes(engine, 30, params)
    long = _step_peak_bytes(engine, LONG, params)
    # a copy of 3,000 token ids is 24 KB (their list alone), of the text about as much again;
    # what does grow is the block table the attention reads (47 blocks of 64 tokens here)
    assert long - short < 4096, (short, long)


def test_output_text_reads_and_cuts_like_a_string():
    rng = random.Random(0)
    for _ in range(300):
        text, ref = OutputText(), ""
        for _ in range(rng.randrange(1, 12)):
            piece = "".join(rng.choice("ab\u00e9") for _ in range(rng.randrange(0, 4)))
            text.append(piece)
            ref += piece
            start = rng.randrange(0, len(ref) + 3)
            assert text.tail(start) == ref[start:]
            if rng.random() < 0.3:
                cut = rng.randrange(0, len(ref) + 1)
                text.truncate(cut)
                ref = ref[:cut]
            assert len(text) == len(ref) and str(text) == ref


def test_token_ids_read_like_the_joined_list():
    prompt, output = [1, 2, 3], [4, 5]
    view, ref = TokenIds(prompt, output), prompt + output
    assert len(view) == 5 and list(view) == ref
    for a in range(-6, 7):
        if -5 <= a < 5:
            assert view[a] == ref[a]
        for b in range(-6, 8):
            assert view[a:b] == ref[a:b]
    assert view[::2] == ref[::2]
    output.append(6)  # a view, not a copy
    assert view[-1] == 6 and len(view) == 6
