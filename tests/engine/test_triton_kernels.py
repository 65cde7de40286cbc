"""The Triton paged-attention kernels, run by Triton's CPU interpreter, against a float64 reference.

TRITON_INTERPRET is read when a kernel is decorated (when pdserve.engine.triton_attention is imported),
so it is set here before that import; the kernels then run on CPU tensors.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be checked")

from pdserve.engine import triton_attention as ta  # noqa: E402


def make_cache(num_blocks, block_size, n_kv, d, dtype, gen):
    k = torch.randn(num_blocks, block_size, n_kv, d, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, n_kv, d, generator=gen).to(dtype)
    return k, v


def random_tables(lens, block_size, num_blocks, gen):
    """Distinct random blocks per sequence, padded with 0 to the widest table."""
    need = [-(-n // block_size) for n in lens]
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(need)
    table = torch.zeros(len(lens), width, dtype=torch.int64)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used : used + n]
        used += n
    return table


def gather(cache, table_row, n):
    bs = cache.shape[1]
    pos = torch.arange(n)
    return cache[table_row[pos // bs], pos % bs].double()  # [n, n_kv, D]


def ref_attention(q, k, v, qpos):
    """q: [L, H, D]; k, v: [n, n_kv, D]; query i sees keys 0..qpos[i]. float64."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("lhd,nhd->hln", q.double(), k) * q.shape[-1] ** -0.5
    mask = torch.arange(k.shape[0])[None, :] <= qpos[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hln,nhd->lhd", s.softmax(-1), v)


TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def test_write_kv_puts_rows_in_their_slots_and_skips_negative_slots():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        k_cache = torch.zeros(6, 4, 2, 64, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        # the model hands K/V over in the cache's dtype
        k = torch.randn(5, 2, 64, generator=gen).to(dtype)
        v = torch.randn(5, 2, 64, generator=gen).to(dtype)
        slots = torch.tensor([3, 9, 22, -1, 0])
        ta.write_kv_triton(k_cache, v_cache, k, v, slots)
        flat_k, flat_v = k_cache.view(-1, 2, 64), v_cache.view(-1, 2, 64)
        for row, slot in enumerate(slots.tolist()):
            if slot >= 0:
                assert torch.equal(flat_k[slot], k[row])
                assert torch.equal(flat_v[slot], v[row])
        written = {s for s in slots.tolist() if s >= 0}
        untouched = [i for i in range(flat_k.shape[0]) if i not in written]
        assert flat_k[untouched].abs().sum() == 0  # the padded row (-1) wrote nothing


@pytest.mark.parametrize(
    "n_heads,n_kv,d,block_size,lens,dtype,partition",
    [
        (4, 4, 64, 16, [1, 17, 40], torch.float32, 256),  # MHA, no split
        (6, 2, 64, 4, [5, 70, 33], torch.float32, 32),  # GQA 3, small blocks, split-K (3 partitions)
        (8, 2, 128, 8, [90, 7], torch.bfloat16, 32),  # GQA 4, head_dim 128, bf16, split-K
        (4, 1, 64, 32, [45, 3], torch.float16, 16),  # MQA, fp16, split-K, block > tile
    ],
)
def test_decode_attention_matches_reference(n_heads, n_kv, d, block_size, lens, dtype, partition):
    gen = torch.Generator().manual_seed(1)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k_cache, v_cache = make_cache(num_blocks, block_size, n_kv, d, dtype, gen)
    tables = random_tables(lens, block_size, num_blocks, gen)
    q = torch.randn(len(lens), n_heads, d, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens)
    out = torch.empty_like(q)
    splits = ta.decode_num_splits(tables.shape[1] * block_size, partition)
    ta.decode_attention_triton(out, q, k_cache, v_cache, tables, seq_lens, d**-0.5, num_splits=splits)
    for i, n in enumerate(lens):
        ref = ref_attention(
            q[i : i + 1], gather(k_cache, tables[i], n), gather(v_cache, tables[i], n), torch.tensor([n - 1])
        )
        torch.testing.assert_close(out[i].double(), ref[0], atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("splits", [5, 40])
def test_decode_split_k_equals_single_partition(splits):
    """40 splits of 16 tokens: the 300-token row has 19 live partitions, more than the merge
    takes at a time (SPLIT_TILE); the short rows' empty partitions are neither written nor read."""
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = make_cache(60, 8, 2, 64, torch.float32, gen)
    lens = [300, 9, 64]
    tables = random_tables(lens, 8, 60, gen)
    q = torch.randn(3, 4, 64, generator=gen)
    one, many = torch.empty_like(q), torch.empty_like(q)
    ta.decode_attention_triton(one, q, k_cache, v_cache, tables, torch.tensor(lens), 0.125, num_splits=1)
    ta.decode_attention_triton(many, q, k_cache, v_cache, tables, torch.tensor(lens), 0.125, num_splits=splits)
    torch.testing.assert_close(one, many, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "n_heads,n_kv,d,block_size,spans,dtype",
    [
        # (span length, context_len): context_len > length is a prefix hit / a later chunk
        (4, 4, 64, 16, [(20, 20), (5, 5)], torch.float32),
        (6, 2, 64, 4, [(7, 30), (18, 18), (1, 9)], torch.float32),  # GQA 3, cached prefixes
        (8, 2, 128, 8, [(17, 40), (3, 3)], torch.bfloat16),  # GQA 4, head_dim 128, bf16
        (4, 1, 64, 32, [(9, 50)], torch.float16),
    ],
)
def test_prefill_attention_matches_reference(n_heads, n_kv, d, block_size, spans, dtype):
    gen = torch.Generator().manual_seed(3)
    ctx_lens = [c for _, c in spans]
    num_blocks = sum(-(-n // block_size) for n in ctx_lens) + 2
    k_cache, v_cache = make_cache(num_blocks, block_size, n_kv, d, dtype, gen)
    tables = random_tables(ctx_lens, block_size, num_blocks, gen)
    total = sum(length for length, _ in spans)
    q = torch.randn(total, n_heads, d, generator=gen).to(dtype)
    rows, start = [], 0
    for length, ctx in spans:
        rows.append([start, start + length, ctx])
        start += length
    span_t = torch.tensor(rows)
    out = torch.full_like(q, float("nan"))
    ta.prefill_attention_triton(out, q, k_cache, v_cache, span_t, tables, d**-0.5)
    for i, (s, e, ctx) in enumerate(rows):
        qpos = torch.arange(ctx - (e - s), ctx)
        ref = ref_attention(q[s:e], gather(k_cache, tables[i], ctx), gather(v_cache, tables[i], ctx), qpos)
        torch.testing.assert_close(out[s:e].double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_engine_on_the_triton_backend_gives_the_cpu_paths_tokens(tiny_model_dir):
    """The whole engine, forced onto the Triton kernels (interpreted), against its default CPU path in fp32:
    mixed steps (decodes beside chunked prefill spans) and a prefix-cache hit."""
    from pdserve import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    base = "a shared prefix that fills several blocks. "
    prompts = ["hi", base + "one", "the quick brown fox jumps", base + "two, a longer tail"]
    results = []
    for backend in ("auto", "triton"):
        llm = LLM(
            tiny_model_dir,
            dtype="float32",
            block_size=4,
            num_gpu_blocks=64,
            max_num_batched_tokens=24,
            max_num_seqs=4,
            attention_backend=backend,
        )
        assert llm.engine.runner.attention_backend == ("triton" if backend == "triton" else "cpp")
        first = [o.outputs[0].token_ids for o in llm.generate([base + "zero"], greedy)]
        hits = llm.engine.block_manager.stats.hits_tokens
        rest = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        assert llm.engine.block_manager.stats.hits_tokens - hits >= 40  # the prefix came from the cache
        results.append(first + rest)
    assert results[0] == results[1]


def test_bucket_sizes():
    from pdserve.engine.cuda_graphs import bucket_sizes

    assert bucket_sizes(1) == [1]
    assert bucket_sizes(4) == [1, 2, 4]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


@pytest.mark.parametrize("budget", [4, 24])
def test_padded_decode_graph_path_gives_the_eager_tokens(tiny_model_dir, budget):
    """What a CUDA graph replays (static buffers, the bucket's padded rows with slot -1 and one
    token of context, stale block-table columns), run eagerly on the Triton kernels, against the
    plain eager path. Budget 4 with 4 sequences: once three decode, the fourth prompt is fed one
    token a step, so one-token entries that sample nothing ride in the padded batch too."""
    from pdserve import LLM, SamplingParams

    # the batch shrinks 4 -> 3 -> 2 as requests finish: 3 runs padded to the bucket of 4
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 5, 3, 10)]
    prompts = ["hi", "the quick brown fox", "x", "a longer prompt that spans several blocks of four tokens"]
    results = []
    for graphs in (False, True):
        llm = LLM(
            tiny_model_dir,
            dtype="float32",
            block_size=4,
            num_gpu_blocks=64,
            max_num_batched_tokens=budget,
            max_num_seqs=4,
            attention_backend="triton",
        )
        runner = llm.engine.runner
        assert runner.graphs is None  # a CPU never captures
        if graphs:
            runner.enable_decode_graphs(capture=False)
            assert runner.graphs.sizes == [1, 2, 4]
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy)])
        if graphs:
            assert runner.graphs.replays >= 9  # every decode step (10 tokens: 1 from a prefill) went this way
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    assert results[0] == results[1]


def test_padded_rows_write_no_kv_and_read_one_token(tiny_model_dir):
    """Rows past the step's own in a bucket: whatever a previous step left in the static buffers,
    they write nowhere (slot -1) and attend to one token, and their logits are not returned."""
    from pdserve import LLM
    from pdserve.engine.attention import AttentionMetadata

    llm = LLM(
        tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks=16, max_num_seqs=4, attention_backend="triton"
    )
    runner = llm.engine.runner
    runner.enable_decode_graphs(capture=False)
    g = runner.graphs
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    g.slots[3] = 13  # a stale slot of an earlier, bigger step: a live sequence's token now
    g.seq_lens[3] = 9
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    long = dict(dtype=torch.long)
    meta = AttentionMetadata(slot_mapping=torch.tensor([0, 5, 9], **long), num_decodes=3)
    meta.decode_block_tables = torch.tensor([[0, 0], [0, 1], [0, 2]], **long)
    meta.decode_seq_lens = torch.tensor([1, 6, 6], **long)
    ids, pos = torch.tensor([7, 8, 9], **long), torch.tensor([0, 5, 5], **long)
    logits = g.run(ids, pos, meta, torch.tensor([0, 2], **long))
    assert logits.shape[0] == 2  # row 1 samples nothing (the end of a prompt chunk)
    assert g.slots[3] == -1 and g.seq_lens[3] == 1
    for (k0, v0), (k1, v1) in zip(before, runner.kv_caches):
        changed = ((k0 != k1).flatten(2).any(2) | (v0 != v1).flatten(2).any(2)).nonzero().tolist()
        assert sorted(b * 4 + o for b, o in changed) == [0, 5, 9]  # exactly the step's own slots
    # the same step eagerly: the same logits for the rows that sample
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        k.copy_(k0)
        v.copy_(v0)
    meta.kv_writer, meta.decode_kernel = runner.kv_writer, runner.decode_kernel
    eager = runner.model(ids, pos, runner.kv_caches, meta, torch.tensor([0, 2], **long))
    torch.testing.assert_close(logits, eager)


def test_an_explicit_triton_backend_refuses_a_head_dim_it_cannot_tile(tmp_path):
    """tl.arange tiles the head dim: 48 would fail to compile on the first step; the engine
    says so when it is built instead (auto takes torch for such a model)."""
    from pdserve import LLM
    from pdserve.config import ConfigError
    from tests.tiny import write_tiny_model

    path = write_tiny_model(str(tmp_path), hidden=96, heads=2, kv_heads=1)
    with pytest.raises(ConfigError, match="head dim that is a power of two"):
        LLM(path, device="cpu", dtype="float32", attention_backend="triton", num_gpu_blocks=16)
    assert LLM(path, device="cpu", dtype="float32", num_gpu_blocks=16).engine.runner.attention_backend != "triton"
