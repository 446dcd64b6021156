"""The compiled CPU decode attention: built with the machine's C compiler, against the per-sequence reference.

These tests compile `kernels/paged_attention_cpu.c`, so they need a C compiler (`cc`, or `$CC`), as the
README's test set-up says.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kernels.cpu_build import compiler_of
from kernels.paged_attention import paged_attention_reference
from kernels.paged_attention_cpu import (
    MAX_QUERY_LEN, CpuDecodeAttention, DecodePlan, load_cpu_decode_attention, query_limit,
)
from kernels.paged_attention_torch import new_kv_cache, paged_attention_torch
from tests.harness.cpu_kernels import compiled
from tests.harness.kernel_batches import PagedBatch, assert_close, make_batch

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> CpuDecodeAttention:
    return compiled(load_cpu_decode_attention, tmp_path_factory.mktemp("kernels"))


def _head_major(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    caches = []
    for cache in (batch.k_cache, batch.v_cache):
        copy = new_kv_cache(*cache.shape, dtype=cache.dtype, device=CPU)
        caches.append(copy.copy_(cache))
    return caches[0], caches[1]


def _plan(kernel: CpuDecodeAttention, batch: PagedBatch) -> DecodePlan:
    return kernel.plan(batch.block_tables, batch.cu_seqlens_q, batch.seq_lens)


def _cases(seed: int, num_decodes: int, num_chunks: int, block_size: int) -> list[tuple[int, int]]:
    """Decodes at block boundaries and between them, and chunks shorter and longer than the kernel takes."""
    rng = random.Random(seed)
    cases = [(1, 1), (1, block_size), (1, block_size + 1), (1, 3 * block_size - 1)]
    cases += [(1, rng.randint(1, 300)) for _ in range(num_decodes)]
    for _ in range(num_chunks):
        q_len = rng.randint(2, 2 * MAX_QUERY_LEN)
        cases.append((q_len, q_len + rng.randint(0, 90)))
    rng.shuffle(cases)
    return cases


@pytest.mark.parametrize("layout", ["token-major", "head-major"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(4, 4, 16), (8, 2, 32), (6, 2, 80), (8, 1, 64), (16, 4, 128)],
                         ids=["mha", "gqa4", "gqa3-d80", "mqa", "gqa4-d128"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_torch_backend_with_the_kernel_matches_reference(kernel: CpuDecodeAttention, num_heads: int,
                                                         num_kv_heads: int, head_dim: int, block_size: int,
                                                         layout: str) -> None:
    for seed in range(2):
        for num_chunks in (0, 2):  # decode-only steps, and mixed ones
            cases = _cases(seed + 10 * block_size, 5, num_chunks, block_size)
            batch = make_batch(cases, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               block_size=block_size, dtype=torch.float32, device=CPU, seed=seed)
            expected = paged_attention_reference(*batch.args())
            q, k_cache, v_cache, *rest = batch.args()
            if layout == "head-major":
                k_cache, v_cache = _head_major(batch)
            got = paged_attention_torch(q, k_cache, v_cache, *rest, cpu_decode=_plan(kernel, batch),
                                        max_query_len=max(n for n, _ in cases))
            assert_close(got, expected, torch.float32)


def test_kernel_writes_the_rows_of_short_queries_only(kernel: CpuDecodeAttention) -> None:
    long_chunk = MAX_QUERY_LEN + 4
    cases = [(1, 40), (long_chunk, long_chunk + 5), (1, 3), (0, 9), (6, 20), (MAX_QUERY_LEN, 50), (1, 17)]
    batch = make_batch(cases, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=torch.float32,
                       device=CPU, seed=3)
    out = torch.full_like(batch.q, 5.0)
    assert kernel(*batch.args(), out=out) == MAX_QUERY_LEN
    expected = paged_attention_reference(*batch.args())
    chunk = slice(1, 1 + long_chunk)
    others = torch.ones(batch.q.shape[0], dtype=torch.bool)
    others[chunk] = False
    assert_close(out[others], expected[others], torch.float32)
    assert bool((out[chunk] == 5.0).all()), "a chunk longer than MAX_QUERY_LEN is left to SDPA"


def test_query_limit_keeps_rows_within_the_kernel(kernel: CpuDecodeAttention) -> None:
    assert query_limit(8, 2, 64, 16) == MAX_QUERY_LEN
    assert query_limit(64, 1, 128, 16) == 2, "an MQA group of 64 heads of 128: two tokens fill the rows"
    assert query_limit(8, 3, 64, 16) == 0 and query_limit(8, 2, 64, 512) == 0
    batch = make_batch([(3, 40), (2, 9), (1, 30)], num_heads=64, num_kv_heads=1, head_dim=128, block_size=16,
                       dtype=torch.float32, device=CPU, seed=8)
    got = paged_attention_torch(*batch.args(), cpu_decode=_plan(kernel, batch))
    assert_close(got, paged_attention_reference(*batch.args()), torch.float32)


def test_strided_query_as_sliced_from_a_fused_projection(kernel: CpuDecodeAttention) -> None:
    batch = make_batch([(1, 33), (1, 2), (1, 70)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                       dtype=torch.float32, device=CPU, seed=2)
    qkv = torch.randn((3, 8, 16))
    qkv[:, :4] = batch.q
    out = torch.empty_like(batch.q)
    kernel(qkv[:, :4], *batch.args()[1:], out=out)
    assert_close(out, paged_attention_reference(*batch.args()), torch.float32)


def test_out_of_range_blocks_and_lengths_are_refused_not_read(kernel: CpuDecodeAttention) -> None:
    batch = make_batch([(1, 9), (1, 12)], num_heads=2, num_kv_heads=1, head_dim=16, block_size=4,
                       dtype=torch.float32, device=CPU, seed=1)
    q, k_cache, v_cache, tables, cu, lens, scale = batch.args()
    out = torch.zeros_like(q)
    bad_tables = tables.clone()
    bad_tables[1, 1] = k_cache.shape[0]  # one past the last block
    with pytest.raises(ValueError, match="sequence 1"):
        kernel(q, k_cache, v_cache, bad_tables, cu, lens, scale, out)
    too_long = lens.clone()
    too_long[0] = tables.shape[1] * 4 + 1  # more tokens than the block table row holds
    with pytest.raises(ValueError, match="sequence 0"):
        kernel(q, k_cache, v_cache, tables, cu, too_long, scale, out)
    with pytest.raises(ValueError, match="sequence 1"):
        kernel(q, k_cache, v_cache, tables, cu, torch.tensor([9, -1], dtype=torch.int32), scale, out)


def test_half_precision_caches_take_the_torch_path(kernel: CpuDecodeAttention) -> None:
    batch = make_batch([(1, 30), (4, 12), (1, 5)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8,
                       dtype=torch.bfloat16, device=CPU, seed=4)
    q, k_cache, v_cache, *_ = batch.args()
    assert not kernel.accepts(q, k_cache, v_cache, torch.empty_like(q))
    with pytest.raises(ValueError, match="fp32"):
        kernel(*batch.args(), out=torch.empty_like(q))
    got = paged_attention_torch(*batch.args(), cpu_decode=_plan(kernel, batch))
    assert_close(got, paged_attention_reference(*batch.args()), torch.bfloat16)


def test_build_is_cached_and_shared(tmp_path: Path) -> None:
    compiler = compiler_of(os.environ)
    first = load_cpu_decode_attention(tmp_path, compiler)
    assert isinstance(first, CpuDecodeAttention)
    built = first.library.stat().st_mtime_ns
    again = load_cpu_decode_attention(tmp_path, compiler)
    assert isinstance(again, CpuDecodeAttention)
    assert again.library == first.library and again.library.stat().st_mtime_ns == built
    assert [p.name for p in tmp_path.iterdir()] == [first.library.name], "no partial builds left behind"


def test_no_compiler_is_a_reason_not_an_error(tmp_path: Path) -> None:
    reason = load_cpu_decode_attention(tmp_path, str(tmp_path / "no-such-cc"))
    assert isinstance(reason, str) and "no C compiler" in reason


def test_a_compiler_that_fails_is_a_reason(tmp_path: Path) -> None:
    failing = tmp_path / "failing-cc"
    failing.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo failing-cc 1.0; exit 0; fi\n"
                       "echo 'error: this compiler builds nothing' >&2\nexit 1\n")
    failing.chmod(0o755)
    reason = load_cpu_decode_attention(tmp_path / "build", str(failing))
    assert isinstance(reason, str) and "this compiler builds nothing" in reason


def test_runner_uses_the_kernel_and_falls_back_without_a_compiler(tiny_model: Callable[..., str], tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    from worker.engine.model_runner import ModelRunner
    from worker.engine.models.llama_family import LlamaFamilyModel

    tiny_llama = tiny_model("llama")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="worker.engine.model_runner"):
        runner = ModelRunner(tiny_llama, block_size=4, num_blocks=32)
    assert runner.cpu_decode is not None
    assert runner.cpu_decode.library.parent == tmp_path / "cache" / "carpool" / "kernels"
    assert "compiled CPU kernel" in caplog.text
    assert isinstance(runner.model, LlamaFamilyModel) and runner.model.cpu_ops is not None
    assert "RoPE + KV store by compiled CPU kernels" in caplog.text
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="worker.engine.model_runner"):
        fallback = ModelRunner(tiny_llama, block_size=4, num_blocks=32)
    assert fallback.cpu_decode is None
    assert isinstance(fallback.model, LlamaFamilyModel) and fallback.model.cpu_ops is None
    assert "no C compiler" in caplog.text
    with pytest.raises(ValueError, match="cpu_kernels: .*no C compiler"):
        ModelRunner(tiny_llama, block_size=4, num_blocks=32, cpu_kernels=True)
    plain = ModelRunner(tiny_llama, block_size=4, num_blocks=32, cpu_kernels=False)
    assert plain.cpu_decode is None
    assert isinstance(plain.model, LlamaFamilyModel) and plain.model.cpu_ops is None
    with pytest.raises(ValueError, match="float32 caches"):
        ModelRunner(tiny_llama, block_size=4, num_blocks=32, dtype="bfloat16", cpu_kernels=True)


def test_peaked_and_flat_softmax(kernel: CpuDecodeAttention) -> None:
    """Scores hundreds apart (weights that underflow next to the maximum) and scores all equal."""
    batch = make_batch([(1, 70), (3, 45), (1, 1), (1, 200)], num_heads=4, num_kv_heads=2, head_dim=32,
                       block_size=16, dtype=torch.float32, device=CPU, seed=6)
    q, k_cache, v_cache, tables, cu, lens, _ = batch.args()
    for scale in (40.0, 0.0):
        out = torch.empty_like(q)
        kernel(q, k_cache, v_cache, tables, cu, lens, scale, out)
        expected = paged_attention_reference(q, k_cache, v_cache, tables, cu, lens, scale)
        assert bool(torch.isfinite(out).all())
        assert_close(out, expected, torch.float32)


def test_tensors_the_kernel_cannot_read_are_refused(kernel: CpuDecodeAttention) -> None:
    batch = make_batch([(1, 20), (1, 9)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8,
                       dtype=torch.float32, device=CPU, seed=5)
    q, k_cache, v_cache, tables, cu, lens, scale = batch.args()
    narrow_q = q[..., :16]  # a head_dim smaller than the cache's: the kernel would write past out
    wrong = [
        (narrow_q, k_cache, v_cache, tables, cu, lens, torch.empty_like(narrow_q)),
        (q.flatten(1), k_cache, v_cache, tables, cu, lens, torch.empty_like(q.flatten(1))),
        (q, k_cache, v_cache[:1], tables, cu, lens, torch.empty_like(q)),
        (q, k_cache, v_cache, tables.to("meta"), cu, lens, torch.empty_like(q)),
        (q, k_cache, v_cache, tables[0], cu, lens, torch.empty_like(q)),
    ]
    for q_, k_, v_, tables_, cu_, lens_, out in wrong:
        with pytest.raises(ValueError, match="cpu decode attention"):
            kernel(q_, k_, v_, tables_, cu_, lens_, scale, out)


def test_a_nan_query_gives_nan_as_sdpa_does(kernel: CpuDecodeAttention) -> None:
    batch = make_batch([(1, 20), (1, 9)], num_heads=2, num_kv_heads=1, head_dim=16, block_size=4,
                       dtype=torch.float32, device=CPU, seed=6)
    q = batch.q.clone()
    q[0, 0, 3] = float("nan")
    out = torch.empty_like(q)
    kernel(q, *batch.args()[1:6], batch.scale, out)
    assert bool(out[0, 0].isnan().all()), "a NaN score is not silently dropped"
    assert bool(torch.isfinite(out[1]).all())


def test_a_cached_build_that_will_not_load_is_built_again(kernel: CpuDecodeAttention, tmp_path: Path) -> None:
    # Where a build of this source, compiler and CPU goes (never a file this process has loaded: rewriting a
    # mapped library in place would crash it), holding something that is not a library.
    broken = tmp_path / kernel.library.name
    broken.write_bytes(b"not a shared library")
    again = load_cpu_decode_attention(tmp_path, compiler_of(os.environ))
    assert isinstance(again, CpuDecodeAttention) and again.library == broken
    assert broken.read_bytes()[:4] == b"\x7fELF"
    assert [p.name for p in tmp_path.iterdir()] == [broken.name]


def test_loading_the_kernels_leaves_the_floating_point_mode_alone(kernel: CpuDecodeAttention) -> None:
    """A library built with -ffast-math would set flush-to-zero for the whole process as it loads."""
    from kernels.model_ops_cpu import load_cpu_model_ops

    compiled(load_cpu_model_ops, kernel.library.parent)
    smallest = 5e-324  # a subnormal double: flushed to zero, it would multiply to 0.0
    assert smallest * 1.0 == smallest
    assert float(torch.tensor([1e-40]) * 1.0) > 0.0, "fp32 subnormals survive in torch too"
