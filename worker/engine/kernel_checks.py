"""Start-up checks of the Triton kernels and the compiled CPU decode kernel on the model's own shapes, against
their torch references.

A kernel that fails to compile for a GPU or CPU, or computes something else there,
must not take the worker down or serve wrong tokens: the runner checks each
kernel family once on a small batch of the model's shapes and dtype, and on
a failure runs the plain-torch path instead, with a log line saying why.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.model_ops_cpu import CpuModelOps
from kernels.paged_attention_cpu import CpuDecodeAttention

# Relative to the reference's largest value: the kernels differ from their references by rounding only.
_TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    scale = float(want.float().abs().max()) or 1.0
    return bool(torch.isfinite(got.float()).all()) and float((got.float() - want.float()).abs().max()) <= (
        _TOLERANCE[dtype] * scale)


def check_paged_attention(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                          head_dim: int, block_size: int) -> str | None:
    """None when the Triton attention and store give their references' results, else why not."""
    from kernels.kv_store import store_kv, store_kv_reference
    from kernels.paged_attention import paged_attention, paged_attention_reference

    try:
        gen = torch.Generator().manual_seed(0)
        # Two decodes (one long enough to split) and a prefill chunk over shuffled blocks.
        q_lens, seq_lens = [1, 1, 5], [3 * block_size + 1, 2100 + block_size // 2, 2 * block_size]
        num_blocks = sum(-(-n // block_size) for n in seq_lens) + 1
        width = max(-(-n // block_size) for n in seq_lens)
        order = torch.randperm(num_blocks, generator=gen)
        tables = torch.zeros((3, width), dtype=torch.int32)
        used = 0
        for s, n in enumerate(seq_lens):
            count = -(-n // block_size)
            tables[s, :count] = order[used:used + count]
            used += count
        cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = torch.randn(cache_shape, generator=gen).to(dtype=dtype, device=device)
        v_cache = torch.randn(cache_shape, generator=gen).to(dtype=dtype, device=device)
        q = torch.randn((sum(q_lens), num_heads, head_dim), generator=gen).to(dtype=dtype, device=device)
        cu = torch.tensor([0, 1, 2, 7], dtype=torch.int32, device=device)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        args = (q, k_cache, v_cache, tables.to(device), cu, lens, head_dim**-0.5)
        if not _close(paged_attention(*args, num_kv_splits=4), paged_attention_reference(*args), dtype):
            return "paged attention differs from its reference"
        new_k = torch.randn((3, num_kv_heads, head_dim), generator=gen).to(dtype=dtype, device=device)
        slots = torch.tensor([5, -1, 2 * block_size], device=device)
        caches, expected = [k_cache.clone(), v_cache.clone()], [k_cache.clone(), v_cache.clone()]
        store_kv(new_k, new_k, caches[0], caches[1], slots)
        store_kv_reference(new_k, new_k, expected[0], expected[1], slots)
        if not all(torch.equal(a, b) for a, b in zip(caches, expected)):
            return "the KV store differs from its reference"
    except Exception as e:  # a compile or launch failure on this GPU
        return f"{type(e).__name__}: {e}"
    return None


def check_model_kernels(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int, num_heads: int,
                        num_kv_heads: int, head_dim: int) -> str | None:
    """None when the fused norm, activation and RoPE-with-KV-write kernels give their references' results."""
    from kernels.norm_act import add_rms_norm, add_rms_norm_reference, silu_and_mul, silu_and_mul_reference
    from kernels.rope_kv import rope_store_kv, rope_store_kv_reference

    try:
        gen = torch.Generator().manual_seed(1)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

        x, residual, weight = randn(3, hidden), randn(3, hidden), randn(hidden)
        got, want = add_rms_norm(x, residual, weight, 1e-6), add_rms_norm_reference(x, residual, weight, 1e-6)
        if not (_close(got[0], want[0], dtype) and _close(got[1], want[1], dtype)):
            return "fused add + RMSNorm differs from its reference"
        gate_up = randn(3, 2 * intermediate)
        if not _close(silu_and_mul(gate_up), silu_and_mul_reference(gate_up), dtype):
            return "SiLU-and-multiply differs from its reference"
        q, k, v = randn(3, num_heads, head_dim), randn(3, num_kv_heads, head_dim), randn(3, num_kv_heads, head_dim)
        angles = torch.randn(3, head_dim // 2, generator=gen).to(device)
        cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
        sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
        slots = torch.tensor([1, -1, 6], device=device)
        caches = [randn(2, 4, num_kv_heads, head_dim) for _ in range(2)]
        expected = [c.clone() for c in caches]
        got_q = rope_store_kv(q, k, v, cos, sin, caches[0], caches[1], slots)
        want_q = rope_store_kv_reference(q, k, v, cos, sin, expected[0], expected[1], slots)
        if not (_close(got_q, want_q, dtype) and all(_close(a, b, dtype) for a, b in zip(caches, expected))):
            return "RoPE with the KV write differs from its reference"
    except Exception as e:  # a compile or launch failure on this GPU
        return f"{type(e).__name__}: {e}"
    return None


def check_sample_race(device: torch.device, vocab: int) -> str | None:
    """None when the sampler's race kernel draws its reference's tokens for given noise and draws ids of the
    vocabulary with its own, else why not. On the model's vocabulary size, so that both of the kernel's variants
    are compiled here rather than in the first steps."""
    from kernels.sample_race import sample_race, sample_race_reference

    try:
        gen = torch.Generator().manual_seed(0)
        cut = vocab // 2
        logits = (torch.randn(4, vocab, generator=gen) * 3).to(device)
        logits[1, :cut] = float("-inf")
        temperature = torch.tensor([0.0, 0.7, 1e-40, 1.5], device=device)
        noise = (-torch.empty(4, vocab).exponential_(generator=gen).log()).to(device)
        if sample_race(logits, temperature, 0, noise).tolist() != sample_race_reference(logits, temperature,
                                                                                        noise).tolist():
            return "the race differs from its reference"
        drawn = sample_race(logits, temperature, 12345).tolist()
        if drawn[0] != int(logits[0].argmax()) or not all(0 <= t < vocab for t in drawn) or drawn[1] < cut:
            return f"the race drew {drawn} with its own noise"
    except Exception as e:  # a kernel that cannot compile or launch here
        return f"{type(e).__name__}: {e}"
    return None


def check_quantized_matmul(device: torch.device, dtype: torch.dtype, storage: torch.dtype,
                           shapes: Sequence[tuple[int, int]]) -> str | None:
    """None when the quantized matmul kernel gives its reference's results for `(out, in)` weights of each of
    `shapes` held in `storage` (int8 or float8_e4m3fn), at a row count of each of its block sizes, else why not."""
    from kernels.decode_matmul import MAX_ROWS, decode_matmul, decode_matmul_reference

    try:
        # Drawn on the device: a model's matrices are tens of millions of values.
        gen = torch.Generator(device=device).manual_seed(2)
        for n, k in shapes:
            if storage == torch.int8:
                data = torch.randint(-127, 128, (n, k), generator=gen, device=device, dtype=torch.int8)
            else:
                data = (100 * torch.randn((n, k), generator=gen, device=device)).clamp(-448, 448).to(storage)
            scales = (1e-3 + 1e-2 * torch.rand(n, generator=gen, device=device)).to(dtype)
            # One row (a mostly masked row tile), and rows for the 32- and 64-row tiles.
            for m in (1, 17, MAX_ROWS):
                x = torch.randn((m, k), generator=gen, device=device).to(dtype)
                if not _close(decode_matmul(x, data, scales), decode_matmul_reference(x, data, scales), dtype):
                    return f"the quantized matmul differs from its reference for [{m}, {k}] x [{n}, {k}]^T"
    except Exception as e:  # a compile or launch failure on this GPU
        return f"{type(e).__name__}: {e}"
    return None


def check_cpu_decode_attention(kernel: CpuDecodeAttention, num_heads: int, num_kv_heads: int, head_dim: int,
                               block_size: int) -> str | None:
    """None when the compiled CPU kernel gives the reference's rows on the model's shapes, in the torch
    backend's cache layout, for decodes and a short chunk, and leaves a longer chunk's rows alone; else why not."""
    from kernels.paged_attention import paged_attention_reference
    from kernels.paged_attention_cpu import MAX_QUERY_LEN
    from kernels.paged_attention_torch import new_kv_cache

    try:
        gen = torch.Generator().manual_seed(0)
        # Decodes of one token, of a block and one more, of several blocks; a short chunk and a long one.
        long_chunk = MAX_QUERY_LEN + 1
        q_lens = [1, 1, 3, long_chunk, 1]
        seq_lens = [1, block_size + 1, 2 * block_size + 3, long_chunk + block_size, 3 * block_size]
        width = max(-(-n // block_size) for n in seq_lens)
        num_blocks = len(seq_lens) * width + 1
        tables = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * width].view(len(seq_lens), width)
        cpu = torch.device("cpu")
        k_cache, v_cache = (new_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, torch.float32, cpu)
                            for _ in range(2))
        k_cache.copy_(torch.randn(k_cache.shape, generator=gen))
        v_cache.copy_(torch.randn(v_cache.shape, generator=gen))
        q = torch.randn((sum(q_lens), num_heads, head_dim), generator=gen)
        starts = [sum(q_lens[:s]) for s in range(len(q_lens) + 1)]
        cu = torch.tensor(starts, dtype=torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        out = torch.full_like(q, 7.0)
        limit = kernel(q, k_cache, v_cache, tables.int(), cu, lens, head_dim**-0.5, out)
        want = paged_attention_reference(q, k_cache, v_cache, tables.int(), cu, lens, head_dim**-0.5)
        attended = [t for s, n in enumerate(q_lens) if n <= limit for t in range(starts[s], starts[s + 1])]
        left = [t for s, n in enumerate(q_lens) if n > limit for t in range(starts[s], starts[s + 1])]
        if not _close(out[attended], want[attended], torch.float32):
            return "the compiled CPU attention differs from its reference"
        if not bool((out[left] == 7.0).all()):
            return "the compiled CPU attention wrote the rows of a chunk longer than it takes"
    except Exception as e:  # a library that loaded but misbehaves on these shapes
        return f"{type(e).__name__}: {e}"
    return None


def check_cpu_model_ops(ops: CpuModelOps, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int,
                        head_dim: int) -> str | None:
    """None when the compiled add + RMSNorm, SiLU-and-multiply and RoPE + KV store give their references' results
    on the model's shapes, called one by one and through a forward's calls (queries, keys and values read out of
    the fused qkv rows), else why not."""
    from kernels.norm_act import add_rms_norm_reference, silu_and_mul_reference
    from kernels.paged_attention_torch import new_kv_cache
    from kernels.rope_kv import rope_store_kv_reference

    try:
        gen = torch.Generator().manual_seed(0)
        x, residual = torch.randn((5, hidden), generator=gen), torch.randn((5, hidden), generator=gen)
        weight = torch.randn(hidden, generator=gen)
        for given in (None, residual):
            got, want = ops.add_rms_norm(x, given, weight, 1e-6), add_rms_norm_reference(x, given, weight, 1e-6)
            if not (_close(got[0], want[0], torch.float32) and torch.equal(got[1], want[1])):
                return "the compiled add + RMSNorm differs from its reference"
        gate_up = 3 * torch.randn((5, 2 * intermediate), generator=gen)
        if not _close(ops.silu_and_mul(gate_up), silu_and_mul_reference(gate_up), torch.float32):
            return "the compiled SiLU-and-multiply differs from its reference"
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        qkv = torch.randn((5, q_size + 2 * kv_size), generator=gen)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k, v = q.view(5, num_heads, head_dim), k.view(5, num_kv_heads, head_dim), v.view(5, num_kv_heads, head_dim)
        cos, sin = torch.randn((5, head_dim), generator=gen), torch.randn((5, head_dim), generator=gen)
        cpu = torch.device("cpu")
        caches = [new_kv_cache(3, 4, num_kv_heads, head_dim, torch.float32, cpu) for _ in range(6)]
        slots = torch.tensor([5, -1, 0, 11, 2])
        got_q = ops.rope_store_kv(q, k, v, cos, sin, caches[0], caches[1], slots)
        want_q = rope_store_kv_reference(q, k, v, cos, sin, caches[2], caches[3], slots)
        if not (_close(got_q, want_q, torch.float32) and torch.equal(caches[0], caches[2])
                and torch.equal(caches[1], caches[3])):
            return "the compiled RoPE + KV store differs from its reference"
        # A forward's calls: the second of two layers, the residual stream kept in place, buffers reused.
        forward = ops.forward(hidden, intermediate, num_heads, num_kv_heads, head_dim, cos, sin, slots,
                              [caches[2], caches[4]], [caches[3], caches[5]], None)
        _, stream = forward.add_rms_norm(x.clone(), None, weight, 1e-6)
        normed, stream = forward.add_rms_norm(residual, stream, weight, 1e-6)
        want_normed, want_stream = add_rms_norm_reference(residual, x, weight, 1e-6)
        if not (_close(normed, want_normed, torch.float32) and torch.equal(stream, want_stream)):
            return "the compiled add + RMSNorm of a forward differs from its reference"
        if not _close(forward.silu_and_mul(gate_up), silu_and_mul_reference(gate_up), torch.float32):
            return "the compiled SiLU-and-multiply of a forward differs from its reference"
        got_q = forward.rope_store_kv(1, qkv)
        if not (_close(got_q, want_q, torch.float32) and torch.equal(caches[4], caches[2])
                and torch.equal(caches[5], caches[3])):
            return "the compiled RoPE + KV store of a forward differs from its reference"
    except Exception as e:  # a library that loaded but misbehaves on these shapes
        return f"{type(e).__name__}: {e}"
    return None
