"""Decode sequences grouped by context length, and the reused gather workspace, in the torch backend."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_attention_reference
from kernels.paged_attention_torch import (
    GROUP_OVERHEAD_BYTES,
    paged_attention_torch,
    plan_decode_groups,
)
from kernels.workspace import Workspace
from tests.harness.kernel_batches import assert_close, make_batch

CPU = torch.device("cpu")
BLOCK_SIZE = 16
# One block of fp32 keys and values for 4 kv heads of 32: 16 KiB, so a group costs 24 block-rows.
BLOCK_ROW_BYTES = 2 * BLOCK_SIZE * 4 * 32 * 4


def _tables(seq_lens: list[int]) -> torch.Tensor:
    """Block tables giving sequence s the blocks 1000 * s + 0, 1, ...: distinct, and easy to check."""
    width = max(-(-n // BLOCK_SIZE) for n in seq_lens)
    return torch.tensor([[1000 * s + b for b in range(width)] for s in range(len(seq_lens))], dtype=torch.int32)


def _groups(seq_lens: list[int]) -> list[tuple[list[int], int]]:
    groups = plan_decode_groups(list(range(len(seq_lens))), seq_lens, _tables(seq_lens), BLOCK_SIZE, BLOCK_ROW_BYTES)
    return [(sorted(g.seqs.tolist()), g.max_seq_len) for g in groups]


def test_one_long_context_gets_its_own_group() -> None:
    assert GROUP_OVERHEAD_BYTES // BLOCK_ROW_BYTES == 24
    # Padding seven 3-block rows to 34 blocks would gather 7 * 31 block-rows more than a second group costs.
    groups = _groups([40, 530, 35, 48, 33, 47, 40, 39])
    assert groups == [([1], 530), ([0, 2, 3, 4, 5, 6, 7], 48)]


def test_similar_contexts_share_one_group() -> None:
    # A split would save at most 8 block-rows, less than a group's overhead.
    assert _groups([200, 190, 210, 180, 205, 199]) == [([0, 1, 2, 3, 4, 5], 210)]
    assert _groups([7]) == [([0], 7)]


def test_every_sequence_lands_in_exactly_one_group() -> None:
    seq_ids = [3, 9, 4, 12, 0, 7, 5, 11, 2]
    lens = [1, 16, 17, 600, 33, 250, 251, 1000, 64]
    tables = _tables([1] * 13 + [1000])
    groups = plan_decode_groups(seq_ids, lens, tables, BLOCK_SIZE, BLOCK_ROW_BYTES)
    assert sorted(s for g in groups for s in g.seqs.tolist()) == sorted(seq_ids)
    for g in groups:
        members = g.seqs.tolist()
        assert g.max_seq_len == max(lens[seq_ids.index(s)] for s in members)
        num_blocks = -(-g.max_seq_len // BLOCK_SIZE)
        # Each member's own blocks, padded to the group's longest, and a mask over exactly its context.
        assert g.blocks.tolist() == [1000 * s + b for s in members for b in range(num_blocks)]
        assert g.is_visible.shape == (len(members), 1, 1, num_blocks * BLOCK_SIZE)
        assert g.is_visible.sum(-1).flatten().tolist() == [lens[seq_ids.index(s)] for s in members]
    assert len(groups) == 4  # 1000, 600, 250-251, and the short ones


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_grouped_decodes_match_reference_with_and_without_hints(num_heads: int, num_kv_heads: int) -> None:
    # Decodes far apart in length (several groups) and two prefill chunks between them.
    cases = [(1, 530), (1, 40), (7, 50), (1, 33), (1, 300), (12, 12), (1, 2), (1, 529)]
    batch = make_batch(cases, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32, block_size=BLOCK_SIZE,
                       dtype=torch.float32, device=CPU, seed=num_heads)
    expected = paged_attention_reference(*batch.args())
    decodes = [s for s, (q_len, _) in enumerate(cases) if q_len == 1]
    groups = plan_decode_groups(decodes, [cases[s][1] for s in decodes], batch.block_tables, BLOCK_SIZE,
                                2 * BLOCK_SIZE * num_kv_heads * 32 * 4)
    assert len(groups) >= 2
    workspace = Workspace()
    planned = paged_attention_torch(*batch.args(), max_query_len=12, max_seq_len=530, decode_groups=groups,
                                    workspace=workspace)
    assert_close(planned, expected, torch.float32)
    # Planned inside, and again with a workspace that already holds the larger buffers.
    assert_close(paged_attention_torch(*batch.args()), expected, torch.float32)
    assert_close(paged_attention_torch(*batch.args(), workspace=workspace), expected, torch.float32)


def test_decode_only_step_with_groups_matches_reference() -> None:
    cases = [(1, n) for n in (530, 41, 17, 1, 499, 64, 40, 530)]
    batch = make_batch(cases, num_heads=8, num_kv_heads=4, head_dim=32, block_size=BLOCK_SIZE,
                       dtype=torch.float32, device=CPU, seed=11)
    groups = plan_decode_groups(list(range(len(cases))), [c for _, c in cases], batch.block_tables, BLOCK_SIZE,
                                BLOCK_ROW_BYTES)
    out = paged_attention_torch(*batch.args(), max_query_len=1, max_seq_len=530, decode_groups=groups,
                                workspace=Workspace())
    assert_close(out, paged_attention_reference(*batch.args()), torch.float32)


def test_workspace_reuses_its_buffer_and_grows_when_needed() -> None:
    workspace = Workspace()
    a = workspace.take("keys", (4, 16, 2, 8), torch.float32, CPU)
    b = workspace.take("keys", (2, 16, 2, 8), torch.float32, CPU)
    assert a.data_ptr() == b.data_ptr() and b.shape == (2, 16, 2, 8)
    c = workspace.take("keys", (8, 16, 2, 8), torch.float32, CPU)
    assert c.numel() == 8 * 16 * 2 * 8
    assert workspace.take("keys", (3, 16, 2, 8), torch.float32, CPU).data_ptr() == c.data_ptr()
    # Another name or dtype never shares storage.
    assert workspace.take("values", (3, 16, 2, 8), torch.float32, CPU).data_ptr() != c.data_ptr()
    assert workspace.take("keys", (3, 16, 2, 8), torch.float16, CPU).data_ptr() != c.data_ptr()


def test_a_reservation_serves_the_takes_of_tensors_on_its_device() -> None:
    """A runner reserves with the device it was configured with (`cuda`, or here `cpu:0`); its kernels take with
    their tensors' device, which names it otherwise (`cuda:0`, `cpu`): a capture must find the reserved buffer."""
    workspace = Workspace()
    configured = torch.device("cpu", 0)
    workspace.reserve("split_out", (16, 4, 8), torch.float32, configured)
    tensor_device = torch.empty(0, device=configured).device
    # A smaller take first, then the reserved size: neither allocates, so both lie on the reserved buffer.
    small = workspace.take("split_out", (3, 2, 8), torch.float32, tensor_device)
    assert workspace.take("split_out", (16, 4, 8), torch.float32, tensor_device).data_ptr() == small.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_cache_through_the_workspace(dtype: torch.dtype) -> None:
    cases = [(1, 300), (1, 20), (5, 18), (1, 21)]
    batch = make_batch(cases, num_heads=4, num_kv_heads=2, head_dim=64, block_size=BLOCK_SIZE, dtype=dtype,
                       device=CPU, seed=3)
    out = paged_attention_torch(*batch.args(), workspace=Workspace())
    assert out.dtype == dtype
    assert_close(out, paged_attention_reference(*batch.args()), dtype)
