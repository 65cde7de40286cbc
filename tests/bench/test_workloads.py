"""Workload builders and arrival processes: deterministic, the right lengths, sharing and timing."""

import json
import math

import numpy as np
import pytest

from pdserve.bench import arrivals, datasets
from pdserve.bench.datasets import DatasetError, MixedConfig, MooncakeScaling
from pdserve.bench.tokens import TokenSource
from tests.data import MOONCAKE_SAMPLE

TOK = TokenSource(vocab_size=1000)


def test_random_lengths_seed_and_prefix():
    a = datasets.random(200, 100, 20, TOK, seed=1, range_ratio=0.5, prefix_len=8)
    assert a == datasets.random(200, 100, 20, TOK, seed=1, range_ratio=0.5, prefix_len=8)
    assert a != datasets.random(200, 100, 20, TOK, seed=2, range_ratio=0.5, prefix_len=8)
    ins = [r.prompt_len - 8 for r in a]
    outs = [r.output_len for r in a]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 20
    assert min(outs) >= 10 and max(outs) <= 30
    assert all(len(r.prompt) == r.prompt_len for r in a)
    assert all(r.prompt[:8] == a[0].prompt[:8] for r in a)  # the shared prefix
    assert all(100 <= t < 1000 for r in a for t in r.prompt)  # no low (special) ids
    fixed = datasets.random(5, 7, 3, TOK)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(7, 3)] * 5
    with pytest.raises(ValueError, match="range-ratio"):
        datasets.random(1, 10, 10, TOK, range_ratio=1.0)


def test_random_as_text():
    r = datasets.random(3, 16, 4, TOK, as_text=True)
    assert all(isinstance(x.prompt, str) and len(x.prompt.split()) == 16 for x in r)


def test_mixed_tags_and_burst_times():
    cfg = MixedConfig(
        num_chats=10,
        chat_input_len=8,
        chat_output_len=4,
        long_input_len=50,
        long_output_len=2,
        burst_size=2,
        num_bursts=3,
        burst_interval_s=1.5,
        first_burst_s=0.5,
        chat_streams=3,
    )
    reqs = datasets.mixed(cfg, TOK, seed=0)
    chats = [r for r in reqs if r.tag == "chat"]
    longs = [r for r in reqs if r.tag == "long"]
    assert len(chats) == 10 and all(r.arrival_s is None and r.prompt_len == 8 for r in chats)
    assert [r.arrival_s for r in longs] == [0.5, 0.5, 2.0, 2.0, 3.5, 3.5]
    assert all(r.prompt_len == 50 and r.output_len == 2 for r in longs)
    assert len({tuple(r.prompt) for r in longs}) == 6  # each long prompt is a full prefill
    assert cfg.tag_concurrency() == {"chat": 3}
    assert MixedConfig(chat_streams=None).tag_concurrency() == {}
    with pytest.raises(ValueError):
        MixedConfig(burst_interval_s=0)


def _trace(tmp_path, lines):
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(p)


TRACE = [
    {"timestamp": 1000, "input_length": 1100, "output_length": 40, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 700, "output_length": 9, "hash_ids": [0, 1]},
    {"timestamp": 3000, "input_length": 300, "output_length": 1, "hash_ids": [7]},
]


def test_mooncake_shared_prefixes_and_scaling(tmp_path):
    path = _trace(tmp_path, TRACE)
    sc = MooncakeScaling(block_tokens=8, output_scale=0.5, time_scale=0.1)
    a, b, c = datasets.mooncake(path, 10, TOK, scaling=sc)
    # lengths scale by 8/512: 1100 -> 17, 700 -> 11 (= one full block of 8 + 3), 300 -> 5
    assert [r.prompt_len for r in (a, b, c)] == [17, 11, 5] and len(a.prompt) == 17
    assert [r.output_len for r in (a, b, c)] == [20, 4, 1]  # halved, at least 1 (round half to even)
    assert a.prompt[:11] == b.prompt  # hash ids 0, 1 -> the same tokens
    assert a.prompt[:5] != c.prompt  # hash id 7 is another block
    assert [r.arrival_s for r in (a, b, c)] == pytest.approx([0, 0.05, 0.2])  # from the first line, x0.1
    assert datasets.mooncake(path, 2, TOK, scaling=sc) == [a, b]
    assert datasets.mooncake(path, 10, TOK, scaling=sc, as_text=True)[0].prompt == TOK.text(a.prompt)


def test_mooncake_real_trace_head():
    reqs = datasets.mooncake(MOONCAKE_SAMPLE, 50, TOK, scaling=MooncakeScaling(block_tokens=4))
    assert len(reqs) == 50
    first = [r.prompt[:4] for r in reqs]
    assert sum(p == first[0] for p in first) > 10  # hash id 0 starts many conversations


def test_mooncake_conversations_group_turns_and_replay_from_records(tmp_path):
    sys_prompt = [0]
    turns = [  # conversation A: 3 turns, B: 2 turns (too few), C: 3 turns with one too long
        {"timestamp": 10, "input_length": 600, "output_length": 8, "hash_ids": sys_prompt + [1, 2]},
        {"timestamp": 20, "input_length": 600, "output_length": 8, "hash_ids": sys_prompt + [5, 6]},
        {"timestamp": 30, "input_length": 900, "output_length": 8, "hash_ids": sys_prompt + [1, 2, 3]},
        {"timestamp": 40, "input_length": 600, "output_length": 8, "hash_ids": sys_prompt + [8, 9]},
        {"timestamp": 50, "input_length": 1200, "output_length": 8, "hash_ids": sys_prompt + [1, 2, 3, 4]},
        {"timestamp": 60, "input_length": 600, "output_length": 8, "hash_ids": sys_prompt + [8, 9, 10]},
        {"timestamp": 70, "input_length": 99999, "output_length": 8, "hash_ids": sys_prompt + [8, 9, 10, 11]},
        {"timestamp": 80, "input_length": 700, "output_length": 8, "hash_ids": sys_prompt + [5, 6, 7]},
    ]
    path = _trace(tmp_path, turns)
    convs = datasets.mooncake_conversations(path, 5, min_turns=3, max_turns=3, max_input_tokens=2000)
    assert [[t["timestamp"] for t in c] for c in convs] == [[10, 30, 50]]
    # C's third turn is too long only once it is kept
    convs = datasets.mooncake_conversations(path, 5, min_turns=2, max_turns=2, max_input_tokens=2000)
    assert [[t["timestamp"] for t in c] for c in convs] == [[10, 30], [20, 80], [40, 60]]
    assert len(datasets.mooncake_conversations(path, 1, min_turns=2, max_turns=2, max_input_tokens=2000)) == 1
    with pytest.raises(ValueError, match="min_turns"):
        datasets.mooncake_conversations(path, 5, min_turns=3, max_turns=2, max_input_tokens=2000)
    # replaying the records in the order given is replaying a trace of just those lines
    recs = sorted((t for c in convs for t in c), key=lambda t: t["timestamp"])
    sc = MooncakeScaling(block_tokens=8)
    assert datasets.mooncake_records(recs, TOK, scaling=sc) == datasets.mooncake(
        _trace(tmp_path, recs), 99, TOK, scaling=sc
    )


@pytest.mark.parametrize(
    "line, reason",
    [
        ("{not json", "not valid JSON"),
        ('{"timestamp": 0, "input_length": "12", "output_length": 1, "hash_ids": []}', "'input_length' must be"),
        ('{"timestamp": 0, "input_length": 12, "output_length": 1, "hash_ids": "0,1"}', "'hash_ids' must be"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_mooncake_malformed_line_is_named(tmp_path, line, reason):
    path = _trace(tmp_path, [TRACE[0], line, TRACE[1]])
    with pytest.raises(DatasetError, match=f"trace.jsonl:2: .*{reason}.*--skip-bad-lines"):
        datasets.mooncake(path, 10, TOK)
    assert len(datasets.mooncake(path, 10, TOK, skip_bad=True)) == 2


def test_missing_files(tmp_path):
    with pytest.raises(DatasetError, match="cannot read"):
        datasets.mooncake(str(tmp_path / "nope.jsonl"), 1, TOK)
    with pytest.raises(DatasetError, match="cannot read"):
        datasets.sharegpt(str(tmp_path / "nope.json"), 1, TOK)


def test_sharegpt(tmp_path):
    def conv(q, a):
        return {"id": q, "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}

    data = [
        conv("what is the capital of france and why " * 2, "paris is the capital of france " * 3),
        {"id": "short", "conversations": [{"from": "human", "value": "hi"}]},  # one turn: skipped quietly
        conv("tell me a long story about a cat " * 2, "once upon a time there was a cat " * 4),
        conv("x", "y"),
    ]  # too short for vLLM's filter
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(data))
    reqs = datasets.sharegpt(str(p), 10, TOK)
    assert len(reqs) == 2 and all(isinstance(r.prompt, str) and r.prompt_len >= 4 for r in reqs)
    assert all(r.output_len == 4 for r in datasets.sharegpt(str(p), 10, TOK, output_len=4))
    p.write_text(json.dumps(data + [{"conversations": [{"from": "human"}, {"from": "gpt", "value": 3}]}]))
    with pytest.raises(DatasetError, match="entry 4: a turn without a string 'value'"):
        datasets.sharegpt(str(p), 10, TOK)
    assert len(datasets.sharegpt(str(p), 10, TOK, skip_bad=True)) == 2
    p.write_text('[{"conversations": [')
    with pytest.raises(DatasetError, match="not a ShareGPT JSON file"):
        datasets.sharegpt(str(p), 10, TOK)


def test_arrivals():
    assert arrivals.offsets_s(4, math.inf).tolist() == [0, 0, 0, 0]
    off = arrivals.offsets_s(4000, 10.0, seed=3)
    assert off[0] == 0 and np.all(np.diff(off) >= 0)
    assert off[-1] / 3999 == pytest.approx(0.1, rel=0.05)  # mean gap 1/rate
    steady = np.diff(arrivals.offsets_s(4000, 10.0, burstiness=20.0))
    bursty = np.diff(arrivals.offsets_s(4000, 10.0, burstiness=0.2))
    assert steady.mean() == pytest.approx(0.1, rel=0.05) and bursty.mean() == pytest.approx(0.1, rel=0.15)
    assert steady.std() < 0.05 < bursty.std()  # shape k: cv = 1/sqrt(k)
    assert arrivals.offsets_s(5, 2.0, seed=1).tolist() == arrivals.offsets_s(5, 2.0, seed=1).tolist()
    with pytest.raises(ValueError):
        arrivals.gaps_s(3, 0.0)
    with pytest.raises(ValueError):
        arrivals.gaps_s(3, 1.0, burstiness=0)


def test_schedule_mixes_fixed_and_drawn_times():
    reqs = [datasets.Request([1], 1, 1), datasets.Request([1], 1, 1, arrival_s=5.0), datasets.Request([1], 1, 1)]
    assert arrivals.schedule(reqs, 2.0, seed=0)[1] == 5.0
    t = arrivals.schedule(reqs, 2.0, seed=0)
    assert t[0] == 0 and t[2] > 0
    assert arrivals.schedule(reqs, math.inf, use_trace_times=False) == [0, 0, 0]


def test_token_source_with_a_tokenizer(tiny_model_dir):
    src = TokenSource.from_path(tiny_model_dir)
    ids = src.random_ids(np.random.default_rng(0), 2000)
    tok = src.tokenizer
    assert max(ids) < tok.vocab_size and not (set(ids) & (tok.special_ids | set(tok.eos_token_ids)))
    assert src.exact and src.count("hello world") == len(tok.encode("hello world", add_special_tokens=False))


def test_base_url_is_the_server_root_with_or_without_v1():
    from pdserve.bench.cli import server_root

    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert server_root(url) == "http://h:8000"
    assert server_root("http://h:8000/api/v1x") == "http://h:8000/api/v1x"
