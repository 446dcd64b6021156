"""BlockManager bookkeeping: allocation, ref counts, prefix cache and LRU eviction."""

from __future__ import annotations

import pytest

from scheduler import BlockManager, SamplingParams, Sequence
from scheduler.block_manager import ROOT_HASH, chain_hash


def make_seq(request_id: str, token_ids: list[int]) -> Sequence:
    return Sequence(request_id, list(token_ids), SamplingParams(max_tokens=4))


def admit(bm: BlockManager, seq: Sequence) -> int:
    """Take the cached prefix, allocate and 'compute' the rest; returns the hit tokens."""
    prefix = bm.lookup_prefix(seq.token_ids)
    num_new = seq.num_tokens - prefix.num_blocks * bm.block_size
    assert bm.can_allocate(seq, num_new, prefix)
    bm.take_prefix(seq, prefix)
    bm.allocate_for(seq, num_new)
    seq.num_computed_tokens += num_new
    bm.cache_computed_blocks(seq)
    bm.check_invariants()
    return seq.num_cached_tokens


def test_allocates_on_demand_and_frees_everything() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    seq = make_seq("a", list(range(5)))
    bm.allocate_for(seq, 5)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 5
    bm.allocate_for(seq, 3)  # positions 5..7 still fit in block 2
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 8
    bm.allocate_for(seq, 1)
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 5
    bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_can_allocate_refuses_past_the_pool() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq("a", list(range(9)))
    assert not bm.can_allocate(seq, 9)
    assert bm.can_allocate(seq, 8)


def test_prefix_hits_share_blocks_and_never_cover_the_last_token() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    shared = list(range(100, 112))  # three full blocks
    a = make_seq("a", shared + [1, 2])
    assert admit(bm, a) == 0
    b = make_seq("b", shared + [3])
    assert admit(bm, b) == 12
    assert b.block_table[:3] == a.block_table[:3]
    # Same tokens exactly: the last block is not taken, one token must be computed.
    c = make_seq("c", shared)
    assert admit(bm, c) == 8
    assert bm.prefix_cache_hit_tokens == 20
    assert bm.prefix_cache_query_tokens == 14 + 13 + 12
    for seq in (a, b, c):
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == 16
    assert bm.num_cached_blocks == 3


def test_chained_hash_needs_the_same_parents() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    admit(bm, make_seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Second block's tokens match, but its parent block does not.
    other = make_seq("b", [0, 0, 0, 0, 5, 6, 7, 8, 9])
    assert bm.lookup_prefix(other.token_ids).num_blocks == 0


def test_the_chained_hash_tells_apart_what_pythons_hash_identifies() -> None:
    # Python's hash reduces integers modulo 2**61 - 1: as a chain of `hash((parent, tokens))`, two prefixes whose
    # parents' hashes differ by that much named the same block. The chain is a 32-byte BLAKE2b digest instead.
    modulus = 2**61 - 1
    assert hash(5) == hash(5 + modulus) and hash((5, (1, 2))) == hash((5 + modulus, (1, 2)))
    root = chain_hash(ROOT_HASH, [5])
    assert len(root) == 32 and root == chain_hash(ROOT_HASH, (5,))
    assert chain_hash(root, [1, 2]) != chain_hash(chain_hash(ROOT_HASH, [5 + modulus]), [1, 2])
    assert chain_hash(ROOT_HASH, [0]) != chain_hash(ROOT_HASH, [modulus])
    assert chain_hash(ROOT_HASH, [1, 2]) != chain_hash(ROOT_HASH, [2, 1])
    assert chain_hash(chain_hash(ROOT_HASH, [1]), [2]) != chain_hash(ROOT_HASH, [1, 2])


def test_cached_blocks_evicted_lru_only_when_free_list_empty() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq("a", [1, 2, 3, 4, 5])  # 2 full blocks cached + 1 partial
    admit(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    # One new block comes from the free list, cached ones stay.
    b = make_seq("b", [9])
    admit(bm, b)
    assert bm.num_cached_blocks == 2
    assert bm.lookup_prefix([1, 2, 3, 4, 5]).num_blocks == 2
    # Three more blocks: one free, then the two cached ones, deepest first.
    c = make_seq("c", [7, 7, 7, 7, 7])
    bm.allocate_for(c, 3)  # 2 blocks: free one + evicts [3, 4]
    assert bm.num_cached_blocks == 1
    assert bm.lookup_prefix([1, 2, 3, 4, 5]).num_blocks == 1
    bm.check_invariants()
    bm.free(b)
    bm.free(c)
    bm.check_invariants()
    assert bm.num_free_blocks == 4


def test_hit_on_evictable_block_takes_it_out_of_the_pool() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_seq("a", [1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)
    b = make_seq("b", [1, 2, 3, 4, 6])
    prefix = bm.lookup_prefix(b.token_ids)
    assert prefix.num_blocks == 2
    assert bm.can_allocate(b, 1, prefix)
    # Three blocks are free-or-evictable, but two of them are the hit itself.
    assert not bm.can_allocate(b, 3, prefix)
    assert admit(bm, b) == 4
    assert bm.num_free_blocks == 0
    bm.free(b)
    assert bm.num_free_blocks == 3


def test_double_free_is_caught() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    a = make_seq("a", [1])
    bm.allocate_for(a, 1)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError):
        bm.free(a)
