"""The slot arithmetic of the paged KV cache, against the per-token formula and a flat view."""

import pytest
import torch

from pdserve.kv.slots import slot_list, slot_mapping


def per_token(table, start, end, bs):
    return [table[p // bs] * bs + p % bs for p in range(start, end)]


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_every_range_matches_the_per_token_formula(bs):
    table = [7, 2, 9, 0, 5]  # scattered, not in order
    for start in range(len(table) * bs + 1):
        for end in range(start, len(table) * bs + 1):
            assert slot_list(table, start, end, bs) == per_token(table, start, end, bs)


def test_single_decode_token_and_block_edges():
    table = [3, 8]
    assert slot_list(table, 5, 6, 4) == [8 * 4 + 1]
    assert slot_list(table, 3, 5, 4) == [15, 32]  # the last slot of one block, the first of the next
    assert slot_list(table, 4, 4, 4) == []


def test_slots_address_the_tokens_in_the_cache():
    """The slot of position p, in the flat view of the cache, is the row at [block, offset]."""
    bs, table = 4, [5, 1, 3]
    cache = torch.randn(6, bs, 2, 3)
    flat = cache.view(-1, 2, 3)
    s = slot_mapping(table, 2, 11, bs)
    assert s.dtype == torch.long and s.shape == (9,)
    for i, p in enumerate(range(2, 11)):
        assert torch.equal(flat[s[i]], cache[table[p // bs], p % bs])


def test_mapping_is_empty_for_an_empty_range_and_refuses_positions_past_the_table():
    assert slot_mapping([1], 3, 3, 4).shape == (0,)
    with pytest.raises(IndexError):
        slot_list([1, 2], 6, 9, 4)
