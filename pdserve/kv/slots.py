"""Where a sequence's tokens live in the paged KV cache: one place for the slot arithmetic.

Per layer the cache is ``[num_blocks, block_size, n_kv_heads, head_dim]``. Token
position ``p`` of a sequence with block table ``table`` sits in block
``table[p // block_size]`` at offset ``p % block_size``; viewed flat
(``[num_blocks * block_size, ...]``) that is slot ``block * block_size + offset``.
The model runner writes each step's new K/V through these slots, the KV bridge
reads a prefill worker's slots and the receiver lands them in the decode
worker's own (the two may use different block sizes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def slot_list(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The flat slot of each position in [start, end) of a sequence with `block_table`.

    Built a block at a time (one `range` per block touched), so a long prefill
    costs per block, not per token, and a single decode token stays cheap.
    IndexError if the table does not cover position end - 1."""
    out: list[int] = []
    pos = start
    while pos < end:
        i, offset = divmod(pos, block_size)
        n = min(block_size - offset, end - pos)
        first = block_table[i] * block_size + offset
        out.extend(range(first, first + n))
        pos += n
    return out


def slot_mapping(
    block_table: Sequence[int], start: int, end: int, block_size: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """`slot_list` as a [end - start] int64 tensor (for index_select / index_copy_)."""
    return torch.tensor(slot_list(block_table, start, end, block_size), dtype=torch.long, device=device)
