"""The prefill worker's side of the KV bridge, hooked into the engine step.

Layer-wise (default): after each layer's forward, the K/V this step computed
for a transferring request are copied out of the cache and handed to the
sender, which ships them while the next layer computes, so the transfer
hides behind compute and only the last layer's bytes add to TTFT.
Eager: nothing moves until the whole prompt is prefilled, then every layer
goes at once, and TTFT waits for all of it (the baseline; kept to measure
the difference).
"""

from __future__ import annotations

import logging

from pdserve.kv.slots import slot_mapping
from pdserve.transfer import host_copy
from pdserve.transfer.connector import KVDestination, KVSender

log = logging.getLogger("pdserve.transfer")


class PrefillBridge:
    def __init__(self, sender: KVSender, num_layers: int, layerwise: bool = True):
        self.sender = sender
        self.num_layers = num_layers
        self.layerwise = layerwise
        self.dests: dict[str, KVDestination] = {}  # seq_id -> where its KV goes
        self.sent_upto: dict[str, int] = {}  # seq_id -> first token not yet handed to the sender
        self.failed: set[str] = set()  # transfers that failed mid-step (skipped for the rest of it)

    def begin(self, seq_id: str, dest: KVDestination) -> None:
        self.failed.discard(dest.transfer_id)
        self.dests[seq_id] = dest
        self.sent_upto[seq_id] = dest.start_token
        self.sender.begin(dest, self.num_layers)

    def abort(self, seq_id: str, reason: str) -> None:
        """The request ended before its prompt did: drop its transfer on both sides."""
        dest = self.dests.pop(seq_id, None)
        self.sent_upto.pop(seq_id, None)
        if dest is not None:
            self.sender.abort(dest.transfer_id, reason)

    def _ranges(self, scheduled, block_manager, block_size, final_only: bool):
        """(dest, token_start, P-side slots) of what each transferring request sends now."""
        out = []
        for s in scheduled:
            dest = self.dests.get(s.seq.seq_id)
            if dest is None:
                continue
            end = min(s.seq.num_computed_tokens + s.num_new_tokens, dest.num_tokens)
            if final_only and end < dest.num_tokens:
                continue
            # From what the receiver lacks, not from what this step computes: a prefix this
            # worker had cached (and so does not compute) may be longer than the receiver's.
            start = dest.start_token if final_only else self.sent_upto[s.seq.seq_id]
            self.sent_upto[s.seq.seq_id] = max(start, end)
            if start >= end:
                continue
            out.append((dest, start, slot_mapping(block_manager.block_table(s.seq.seq_id), start, end, block_size)))
        return out

    def layer_hook(self, scheduled, runner, block_manager):
        """The `on_layer_done` callback for this step, or None if nothing is sent layer by layer."""
        if not self.layerwise:
            return None
        ranges = self._ranges(scheduled, block_manager, runner.block_size, final_only=False)
        if not ranges:
            return None

        def on_layer_done(layer: int) -> None:
            self._save(runner, layer, ranges)

        return on_layer_done

    def after_step(self, scheduled, runner, block_manager) -> list[str]:
        """Send eager transfers whose prompt just completed, close finished transfers.

        Returns the seq ids whose transfer was closed (all layers queued)."""
        if not self.layerwise:
            ranges = self._ranges(scheduled, block_manager, runner.block_size, final_only=True)
            for layer in range(self.num_layers):
                self._save(runner, layer, ranges)
        closed = []
        for s in scheduled:
            dest = self.dests.get(s.seq.seq_id)
            # num_computed_tokens is not advanced yet: compare what this step reaches
            if dest is not None and s.seq.num_computed_tokens + s.num_new_tokens >= dest.num_tokens:
                self.sender.finish(dest.transfer_id)
                closed.append(s.seq.seq_id)
                del self.dests[s.seq.seq_id]
                self.sent_upto.pop(s.seq.seq_id, None)
        self.failed.clear()  # their destinations are gone: no later step sends for them
        return closed

    def _save(self, runner, layer: int, ranges) -> None:
        k_cache, v_cache = runner.kv_caches[layer]
        for dest, start, slots in ranges:
            if dest.transfer_id in self.failed:
                continue
            flat_k = k_cache.view(-1, *k_cache.shape[-2:])
            flat_v = v_cache.view(-1, *v_cache.shape[-2:])
            slots = slots.to(flat_k.device)
            # index_select copies: the sender may read after these blocks are reused; a CUDA
            # cache's rows then go to pinned host memory, which the socket writes from
            k = host_copy.to_host(flat_k.index_select(0, slots))
            v = host_copy.to_host(flat_v.index_select(0, slots))
            try:
                self.sender.save_layer(dest.transfer_id, layer, start, k, v)
            except Exception as e:  # this transfer's trouble: it fails, the step goes on
                self._fail(dest, f"layer {layer} could not be sent: {type(e).__name__}: {e}")

    def _fail(self, dest: KVDestination, reason: str) -> None:
        log.warning("KV transfer %s fails: %s; its decode worker recomputes the prompt", dest.transfer_id, reason)
        self.failed.add(dest.transfer_id)
        for seq_id, d in list(self.dests.items()):
            if d is dest:  # no more layers, and no `finish`, for it
                del self.dests[seq_id]
                self.sent_upto.pop(seq_id, None)
        self.sender.fail(dest.transfer_id, reason)
