"""Triton paged attention and KV store against the plain-torch reference.

Without a GPU the kernels run under Triton's numpy interpreter, which has to
be switched on before `kernels` is imported; shapes stay small for it.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels import get_backend  # noqa: E402
from kernels.interpret import check_launchable  # noqa: E402
from kernels.kv_store import store_kv, store_kv_reference  # noqa: E402
from kernels.paged_attention import (  # noqa: E402
    launch_paged_attention,
    paged_attention,
    paged_attention_reference,
)
from kernels.paged_attention_torch import paged_attention_torch  # noqa: E402
from kernels.workspace import Workspace  # noqa: E402
from tests.harness.kernel_batches import MIXED_CASES, assert_close, make_batch  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _naive_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last `len(q)` positions over contiguous K/V, one row at a time."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(q_len):
        visible = seq_len - q_len + i + 1
        for h in range(num_heads):
            k = keys[:visible, h // group].float()
            weights = torch.softmax(k @ q[i, h].float() * scale, dim=0)
            out[i, h] = weights @ values[:visible, h // group].float()
    return out


def test_reference_matches_row_by_row_attention() -> None:
    batch = make_batch([(1, 1), (3, 9), (4, 4)], num_heads=4, num_kv_heads=2, head_dim=8,
                       block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    out = paged_attention_reference(*batch.args())
    starts = batch.cu_seqlens_q.tolist()
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        blocks = batch.block_tables[s].long()
        keys = batch.k_cache[blocks].flatten(0, 1)[:seq_len]
        values = batch.v_cache[blocks].flatten(0, 1)[:seq_len]
        q = batch.q[starts[s] : starts[s + 1]]
        expected = _naive_attention(q, keys, values, batch.scale)
        torch.testing.assert_close(out[starts[s] : starts[s + 1]], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_mixed_batch_matches_reference(dtype: torch.dtype, block_size: int) -> None:
    batch = make_batch(MIXED_CASES, num_heads=4, num_kv_heads=2, head_dim=64,
                       block_size=block_size, dtype=dtype, device=DEVICE, seed=block_size)
    out = paged_attention(*batch.args())
    assert_close(out, paged_attention_reference(*batch.args()), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_dims(dtype: torch.dtype, head_dim: int) -> None:
    batch = make_batch([(1, 17), (5, 18), (1, 40)], num_heads=2, num_kv_heads=1, head_dim=head_dim,
                       block_size=16, dtype=dtype, device=DEVICE, seed=head_dim)
    out = paged_attention(*batch.args())
    assert_close(out, paged_attention_reference(*batch.args()), dtype)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 2), (6, 2), (8, 1)],
                         ids=["mha", "gqa2", "gqa4", "gqa3", "mqa"])
def test_gqa_ratios(num_heads: int, num_kv_heads: int) -> None:
    batch = make_batch([(1, 1), (1, 17), (5, 18), (16, 33)], num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=64, block_size=16, dtype=torch.float16, device=DEVICE, seed=num_heads)
    out = paged_attention(*batch.args())
    assert_close(out, paged_attention_reference(*batch.args()), torch.float16)


@pytest.mark.parametrize("num_kv_splits", [2, 3, 7])
def test_split_kv_matches_single_pass(num_kv_splits: int) -> None:
    # Short sequences next to long ones leave some splits with no keys at all.
    cases = [(1, 200), (1, 5), (2, 129)]
    batch = make_batch(cases, num_heads=4, num_kv_heads=2, head_dim=64, block_size=32,
                       dtype=torch.float16, device=DEVICE, seed=num_kv_splits)
    # One slice per 16 tokens, up to num_kv_splits: every decoding sequence here splits but the shortest.
    split = paged_attention(*batch.args(), num_kv_splits=num_kv_splits, kv_split_min_len=16)
    assert_close(split, paged_attention(*batch.args(), num_kv_splits=1), torch.float16)
    assert_close(split, paged_attention_reference(*batch.args()), torch.float16)


def test_launch_hints_and_out_in_place() -> None:
    batch = make_batch(MIXED_CASES, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=torch.float16, device=DEVICE)
    out = torch.full_like(batch.q, float("nan"))
    returned = paged_attention(*batch.args(), out=out, max_query_len=37, max_seq_len=300)
    assert returned is out
    assert_close(out, paged_attention_reference(*batch.args()), torch.float16)


def test_strided_query_from_fused_projection() -> None:
    # q sliced out of a fused qkv projection: its token stride spans q, k and v.
    batch = make_batch([(5, 18), (1, 33)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=torch.float16, device=DEVICE)
    qkv = torch.randn((batch.q.shape[0], 8, 64), dtype=torch.float16, device=DEVICE)
    qkv[:, :4] = batch.q
    strided = qkv[:, :4]
    assert not strided.is_contiguous()
    out = paged_attention(strided, *batch.args()[1:])
    assert_close(out, paged_attention_reference(*batch.args()), torch.float16)


def test_block_ids_past_int32_offsets() -> None:
    """Blocks whose element offset exceeds 2**31 (a ~4.5 GB virtual cache, barely touched)."""
    num_blocks, block_size, head_dim = 1_100_000, 16, 64
    kv = torch.empty((num_blocks, 2, block_size, 1, head_dim), dtype=torch.float16, device=DEVICE)
    k_cache, v_cache = kv[:, 0], kv[:, 1]
    assert k_cache.stride(0) * (num_blocks - 1) > 2**31
    block_tables = torch.tensor([[num_blocks - 1, 7, 1_050_000, num_blocks - 2]], dtype=torch.int32, device=DEVICE)
    positions = torch.arange(60, device=DEVICE)
    slots = block_tables[0, positions // block_size].long() * block_size + positions % block_size
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn((60, 1, head_dim), generator=gen).half().to(DEVICE)
    values = torch.randn((60, 1, head_dim), generator=gen).half().to(DEVICE)
    store_kv(keys, values, k_cache, v_cache, slots)
    assert torch.equal(k_cache[slots // block_size, slots % block_size], keys)
    assert torch.equal(v_cache[slots // block_size, slots % block_size], values)

    q = torch.randn((3, 2, head_dim), generator=gen).half().to(DEVICE)
    cu_seqlens_q = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([60], dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, head_dim**-0.5)
    expected = _naive_attention(q.cpu(), keys.cpu(), values.cpu(), head_dim**-0.5)
    assert_close(paged_attention(*args), expected, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_matches_reference_and_skips_padding(dtype: torch.dtype) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = 6, 16, 3, 80
    gen = torch.Generator().manual_seed(1)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype=dtype, device=DEVICE)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype=dtype, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:20]
    slots[[0, 7, 19]] = -1
    slots = slots.to(DEVICE)
    keys = torch.randn((20, num_kv_heads, head_dim), generator=gen).to(dtype=dtype, device=DEVICE)
    values = torch.randn((20, num_kv_heads, head_dim), generator=gen).to(dtype=dtype, device=DEVICE)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    store_kv_reference(keys, values, k_expected, v_expected, slots)

    store_kv(keys, values, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)
    kept = slots >= 0
    assert int(kept.sum()) == 17
    assert torch.equal(k_cache[slots[kept] // block_size, slots[kept] % block_size], keys[kept])


def test_backends_by_name() -> None:
    assert get_backend("torch").attention is paged_attention_torch
    triton_backend = get_backend("triton")
    assert (triton_backend.name, triton_backend.store_kv, triton_backend.attention) == ("triton", store_kv, paged_attention)
    with pytest.raises(ValueError, match="cuda-graph"):
        get_backend("cuda-graph")


def test_cpu_tensors_without_interpreter_get_a_clear_error() -> None:
    def compiled_kernel() -> None: ...

    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        check_launchable(torch.device("cpu"), compiled_kernel)
    check_launchable(torch.device("cuda"), compiled_kernel)


def test_launch_settings_fixed_at_a_short_context_hold_past_2k() -> None:
    """What a CUDA graph does: one launch's settings and buffers, recorded at short contexts, replayed at long ones.

    The launch reads no length on the host: each sequence's split count and
    slice come from its length on the device, so the same call is right when
    the contexts grow past 2k (a slice length frozen at capture would stop
    attending to the keys beyond it).
    """
    long_cases = [(1, 2100), (1, 2600), (1, 3000)]
    batch = make_batch(long_cases, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=torch.float16, device=DEVICE, seed=21)
    workspace = Workspace()
    out = torch.full_like(batch.q, float("nan"))
    seq_lens = torch.tensor([40, 100, 7], dtype=torch.int32, device=DEVICE)

    def launch() -> None:
        # The same Python arguments every time, as a replay would have them.
        launch_paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.cu_seqlens_q,
                               seq_lens, batch.scale, out, max_query_len=1, num_kv_splits=4, workspace=workspace)

    launch()
    short = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.cu_seqlens_q, seq_lens, batch.scale)
    assert_close(out, paged_attention_reference(*short), torch.float16)
    seq_lens.copy_(batch.seq_lens)  # the contexts grow in place; nothing else changes
    out.fill_(float("nan"))
    launch()
    assert_close(out, paged_attention_reference(*batch.args()), torch.float16)
