"""CUDA graphs for decode-only steps.

A decode step of a small model on a GPU is mostly launch overhead: every layer is a dozen kernels,
each launched from Python. Captured once as a CUDA graph, the whole forward is one launch. As vLLM
does, one graph is captured per batch-size bucket (1, 2, 4, 8, then every 8 up to the engine's
`max_num_seqs`), and a step of `n` sequences replays the smallest bucket that holds them, with the
rows past `n` padded.

A graph replays fixed device addresses, so a step copies its inputs into static buffers sized for
the largest bucket: token ids, positions, KV slots, block tables as wide as the longest context the
engine allows, and context lengths. Padded rows are harmless by construction: their slot is -1 (the
Triton KV writer skips it), their context is one token (the decode kernel reads one valid block),
and their logits are dropped. The decode kernel sizes its split-K partitions from the block
tables' width, not from the lengths, so one graph serves every mix of lengths.

Only the Triton backend qualifies (its KV writer skips padded slots; the PyTorch path would write
slot -1). A step with prefill tokens, more sequences than the largest bucket, or a per-layer hook
(the KV bridge shipping layers while the next computes) runs eagerly. `enforce_eager` turns graphs
off altogether.

`capture=False` runs exactly what a graph would replay (the static buffers, the bucket, the
padding) eagerly: the tests check the padded path on a CPU under Triton's interpreter that way,
where no graph can be captured.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pdserve.engine.attention import AttentionMetadata

log = logging.getLogger(__name__)


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to `max_batch` (itself the last bucket when it is not a multiple of 8)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


@dataclass
class _Graph:
    meta: AttentionMetadata
    logits: torch.Tensor | None = None  # the captured forward's output (static), when captured
    graph: object | None = None  # torch.cuda.CUDAGraph


class DecodeGraphs:
    """The static buffers, and a graph per bucket, for decode-only steps of one model runner."""

    def __init__(self, runner, max_batch: int, max_blocks: int, capture: bool = True):
        self.runner = runner
        self.sizes = bucket_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.capture = capture
        dev = runner.device
        long = dict(dtype=torch.long, device=dev)
        self.input_ids = torch.zeros(self.max_batch, **long)
        self.positions = torch.zeros(self.max_batch, **long)
        self.slots = torch.full((self.max_batch,), -1, **long)
        self.block_tables = torch.zeros((self.max_batch, max_blocks), **long)
        self.seq_lens = torch.ones(self.max_batch, **long)
        self.logits_idx = torch.arange(self.max_batch, **long)
        self.graphs: dict[int, _Graph] = {}
        self.pool = None
        self.replays = 0

    def _meta(self, bs: int) -> AttentionMetadata:
        r = self.runner
        meta = AttentionMetadata(slot_mapping=self.slots[:bs], num_decodes=bs)
        meta.kv_writer = r.kv_writer
        meta.decode_kernel = r.decode_kernel
        meta.decode_block_tables = self.block_tables[:bs]
        meta.decode_seq_lens = self.seq_lens[:bs]
        return meta

    def _forward(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        r = self.runner
        return r.model(self.input_ids[:bs], self.positions[:bs], r.kv_caches, meta, self.logits_idx[:bs])

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket, largest first (the smaller ones then fit in its memory pool).

        The buffers hold padding while capturing (slot -1 everywhere), so capture writes no KV."""
        if not self.capture:
            self.graphs = {bs: _Graph(self._meta(bs)) for bs in self.sizes}
            return
        t0 = time.monotonic()
        self.slots.fill_(-1)
        self.seq_lens.fill_(1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream: Triton compiles, cuBLAS picks
            for bs in self.sizes:  # every size: nothing may compile or load while a graph captures
                self._forward(bs, self._meta(bs))
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for bs in reversed(self.sizes):
            g = _Graph(self._meta(bs), graph=torch.cuda.CUDAGraph())
            with torch.cuda.graph(g.graph, pool=self.pool):
                g.logits = self._forward(bs, g.meta)
            if self.pool is None:
                self.pool = g.graph.pool()
            self.graphs[bs] = g
        torch.cuda.synchronize()
        log.info(
            "captured %d CUDA graphs for decode steps (batch %d..%d) in %.1f s",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            time.monotonic() - t0,
        )

    def can_run(self, num_decodes: int, num_tokens: int, on_layer_done) -> bool:
        return 0 < num_decodes == num_tokens <= self.max_batch and on_layer_done is None

    @torch.inference_mode()
    def run(self, input_ids, positions, meta: AttentionMetadata, logits_idx: torch.Tensor) -> torch.Tensor:
        """The logits of rows `logits_idx` of a step of `n` one-token entries, from the smallest
        bucket that holds them; `meta` is the eager step's metadata (its tensors on the runner's
        device), copied into the static buffers. (A one-token entry that is the last token of a
        prompt chunk, not of its sequence, samples nothing: `logits_idx` leaves it out.)"""
        n = input_ids.shape[0]
        bs = next(b for b in self.sizes if b >= n)
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:bs].fill_(-1)
        # columns past a row's own blocks are never read (its length bounds the kernel's loop)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables)
        self.seq_lens[:n].copy_(meta.decode_seq_lens)
        self.seq_lens[n:bs].fill_(1)
        g = self.graphs[bs]
        self.replays += 1
        if g.graph is None:
            return self._forward(bs, g.meta)[logits_idx]
        g.graph.replay()
        return g.logits[logits_idx]  # a copy: the next replay overwrites the static output
