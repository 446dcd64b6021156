"""The batched torch backend against the per-sequence torch reference (its oracle)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import get_backend
from kernels.kv_store import store_kv_reference
from kernels.paged_attention import paged_attention_reference
from kernels.paged_attention_torch import (
    new_kv_cache,
    paged_attention_torch,
    store_kv_torch,
    store_kv_torch_padded,
)
from tests.harness.kernel_batches import MIXED_CASES, PagedBatch, assert_close, make_batch

CPU = torch.device("cpu")
LAYOUTS = ["token-major", "head-major"]


def _in_layout(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """The same cache contents over token-major storage (as made) or head-major (the backend's own)."""
    if layout == "token-major":
        return cache
    copy = new_kv_cache(*cache.shape, dtype=cache.dtype, device=cache.device)
    # With one kv head (or one slot per block) both layouts are the same memory.
    assert copy.shape == cache.shape and copy.permute(2, 0, 1, 3).is_contiguous()
    return copy.copy_(cache)


def _batch_in_layout(batch: PagedBatch, layout: str) -> tuple[torch.Tensor, ...]:
    q, k_cache, v_cache, *rest = batch.args()
    return (q, _in_layout(k_cache, layout), _in_layout(v_cache, layout), *rest)


def _irregular_cases(seed: int, num_decodes: int, num_chunks: int) -> list[tuple[int, int]]:
    """Decodes of scattered context lengths and prefill chunks, shuffled together."""
    rng = random.Random(seed)
    cases = [(1, rng.randint(1, 200)) for _ in range(num_decodes)]
    for _ in range(num_chunks):
        q_len = rng.randint(2, 40)
        cases.append((q_len, q_len + rng.randint(0, 120)))
    rng.shuffle(cases)
    return cases


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2), (6, 2), (8, 1)],
                         ids=["mha", "gqa2", "gqa4", "gqa3", "mqa"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_steps_match_reference(num_heads: int, num_kv_heads: int, block_size: int, layout: str) -> None:
    for seed in range(3):
        cases = _irregular_cases(seed * 31 + block_size, num_decodes=5, num_chunks=2)
        batch = make_batch(cases, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16,
                           block_size=block_size, dtype=torch.float32, device=CPU, seed=seed)
        expected = paged_attention_reference(*batch.args())
        args = _batch_in_layout(batch, layout)
        assert_close(paged_attention_torch(*args), expected, torch.float32)
        # Host hints must not change the result.
        hinted = paged_attention_torch(*args, max_query_len=max(q for q, _ in cases),
                                       max_seq_len=max(c for _, c in cases))
        assert_close(hinted, expected, torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 3)], ids=["mha", "gqa4", "gqa2"])
def test_decode_only_steps_match_reference(num_heads: int, num_kv_heads: int, layout: str) -> None:
    # Context lengths 1, block-aligned, mid-block, and one far longer than the rest.
    cases = [(1, 1), (1, 16), (1, 17), (1, 250), (1, 3), (1, 64), (1, 31)]
    batch = make_batch(cases, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32,
                       block_size=16, dtype=torch.float32, device=CPU, seed=num_heads)
    expected = paged_attention_reference(*batch.args())
    args = _batch_in_layout(batch, layout)
    assert_close(paged_attention_torch(*args), expected, torch.float32)
    assert_close(paged_attention_torch(*args, max_query_len=1, max_seq_len=250), expected, torch.float32)
    # A replayed decode step attends over the block table's whole width, masked on the device.
    assert_close(paged_attention_torch(*args, is_graphed=True), expected, torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replayed_verify_steps_match_reference(layout: str) -> None:
    """A replayed speculative verify step: every sequence brings the same number of query rows over its cached
    context, attended over the table's whole width with the causal offsets masked on the device."""
    cases = [(4, 4), (4, 17), (4, 5), (4, 250), (4, 33), (4, 16)]
    batch = make_batch(cases, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32,
                       device=CPU, seed=5)
    expected = paged_attention_reference(*batch.args())
    args = _batch_in_layout(batch, layout)
    assert_close(paged_attention_torch(*args, max_query_len=4, is_graphed=True), expected, torch.float32)
    # A sequence of fewer real tokens is padded before them: those rows sit before its context's start, or see
    # none of it (a padding sequence, of length 0), and stay finite.
    q, k_cache, v_cache = args[0], args[1], args[2]
    seq_lens = batch.seq_lens.clone()
    seq_lens[0], seq_lens[2] = 2, 0
    out = paged_attention_torch(q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens_q, seq_lens, batch.scale,
                                max_query_len=4, is_graphed=True)
    assert torch.isfinite(out).all()
    alone = paged_attention_reference(q[2:4], k_cache, v_cache, batch.block_tables[:1], torch.tensor([0, 2]),
                                      seq_lens[:1], batch.scale)
    assert_close(out[2:4], alone, torch.float32)


def test_each_row_equals_attending_alone() -> None:
    """A sequence's output does not depend on what it is batched with."""
    cases = _irregular_cases(7, num_decodes=6, num_chunks=3)
    batch = make_batch(cases, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                       dtype=torch.float32, device=CPU, seed=7)
    together = paged_attention_torch(*batch.args())
    starts = batch.cu_seqlens_q.tolist()
    for s in range(len(cases)):
        q = batch.q[starts[s] : starts[s + 1]]
        cu = torch.tensor([0, q.shape[0]], dtype=torch.int32)
        alone = paged_attention_torch(q, batch.k_cache, batch.v_cache, batch.block_tables[s : s + 1], cu,
                                      batch.seq_lens[s : s + 1], batch.scale)
        assert_close(together[starts[s] : starts[s + 1]], alone, torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_matches_reference(dtype: torch.dtype, layout: str) -> None:
    batch = make_batch(MIXED_CASES, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=dtype, device=CPU, seed=5)
    out = paged_attention_torch(*_batch_in_layout(batch, layout))
    assert out.dtype == dtype
    assert_close(out, paged_attention_reference(*batch.args()), dtype)


def test_out_in_place_and_strided_query() -> None:
    batch = make_batch([(5, 18), (1, 33), (1, 2)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                       dtype=torch.float32, device=CPU, seed=2)
    # q sliced out of a fused qkv projection.
    qkv = torch.randn((batch.q.shape[0], 8, 16))
    qkv[:, :4] = batch.q
    out = torch.full_like(batch.q, float("nan"))
    returned = paged_attention_torch(qkv[:, :4], *batch.args()[1:], out=out)
    assert returned is out
    assert_close(out, paged_attention_reference(*batch.args()), torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("with_padding", [False, True], ids=["dense", "padded"])
def test_store_kv_matches_reference(with_padding: bool, layout: str) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = 6, 4, 3, 16
    gen = torch.Generator().manual_seed(4)
    k_expected = torch.randn((num_blocks, block_size, num_kv_heads, head_dim), generator=gen)
    v_expected = torch.randn(k_expected.shape, generator=gen)
    k_cache, v_cache = _in_layout(k_expected.clone(), layout), _in_layout(v_expected.clone(), layout)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:10]
    if with_padding:
        slots[[0, 6]] = -1
    keys = torch.randn((10, num_kv_heads, head_dim), generator=gen)
    values = torch.randn((10, num_kv_heads, head_dim), generator=gen)
    store_kv_reference(keys, values, k_expected, v_expected, slots)
    store_kv_torch(keys, values, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    kept = slots >= 0
    assert int(kept.sum()) == (8 if with_padding else 10)
    assert torch.equal(v_cache[slots[kept] // block_size, slots[kept] % block_size], values[kept])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padded_store_leaves_the_cache_as_the_real_rows_do(layout: str) -> None:
    """A replayed step's store: padding rows (slot -1) among the real ones must change nothing."""
    num_blocks, block_size, num_kv_heads, head_dim = 5, 4, 2, 8
    gen = torch.Generator().manual_seed(9)
    k_expected = torch.randn((num_blocks, block_size, num_kv_heads, head_dim), generator=gen)
    v_expected = torch.randn(k_expected.shape, generator=gen)
    k_cache, v_cache = _in_layout(k_expected.clone(), layout), _in_layout(v_expected.clone(), layout)
    # A decode step's padding follows its real rows; a verify step's comes first in each sequence's rows.
    slots = torch.tensor([-1, -1, 7, 2, -1, 13, -1, -1])
    keys = torch.randn((8, num_kv_heads, head_dim), generator=gen)
    values = torch.randn((8, num_kv_heads, head_dim), generator=gen)
    store_kv_reference(keys, values, k_expected, v_expected, slots)
    store_kv_torch_padded(keys, values, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    assert torch.equal(k_cache[1, 3], keys[2]), "slot 7 is block 1, offset 3"


def test_torch_backend_is_the_batched_path() -> None:
    backend = get_backend("torch")
    assert (backend.name, backend.store_kv, backend.attention) == ("torch", store_kv_torch, paged_attention_torch)
    cache = backend.new_cache(3, 4, 2, 8, torch.float32, CPU)
    assert cache.shape == (3, 4, 2, 8) and bool((cache == 0).all())
    assert cache.permute(2, 0, 1, 3).is_contiguous(), "the torch backend's cache is head-major in memory"
    assert get_backend("triton").new_cache(3, 4, 2, 8, torch.float32, CPU).is_contiguous()
