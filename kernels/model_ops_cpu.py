"""carpool's own models' fused small ops on CPU, compiled from C at start-up: add + RMSNorm, RoPE + KV store.

On CUDA these are the Triton kernels of `norm_act.py` and `rope_kv.py`. On
CPU their torch references cost a dispatch per op: the residual add and
RMSNorm are seven ops, RoPE of q and k and the KV store about twenty, per
layer and step, which for a small model is time comparable to its matrix
products. `model_ops_cpu.c` does each group in one call, with the
references' arithmetic in fp32 (the sum of squares in another order). It is
built like the attention kernel (`kernels/cpu_build.py`, without reassociation
and without contracting multiply-adds, so each product rounds as torch's
does), and the runner checks it against the references on the model's
shapes before the model uses it (`worker/engine/kernel_checks.py`). fp32 on
CPU only.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu_build import load_library

SOURCE = Path(__file__).with_suffix(".c")
_FLAGS = ("-ffp-contract=off",)
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _rows_ok(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors)


class CpuModelOps:
    """The loaded library: `add_rms_norm` and `rope_store_kv`, with the references' signatures."""

    def __init__(self, library: Path) -> None:
        self.library = library
        handle = ctypes.CDLL(str(library))
        self._norm = handle.add_rms_norm_f32
        self._norm.argtypes = [_P, _I, _P, _I, _P, _F, _P, _I, _P, _I, _I, _I]
        self._norm.restype = None
        self._rope = handle.rope_store_kv_f32
        self._rope.argtypes = [_P, _I, _I, _P, _I, _I, _P, _I, _I, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _P, _P,
                               _I, _I, _I, _I, _I, _I]
        self._rope.restype = ctypes.c_int64

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`add_rms_norm_reference` (kernels/norm_act.py): the normed rows and the residual sum, `[rows, hidden]`."""
        tensors = (x, weight) if residual is None else (x, weight, residual)
        if x.dim() != 2 or weight.dim() != 1 or not _rows_ok(*tensors) or (
                weight.shape != x.shape[1:] or not weight.is_contiguous()
                or (residual is not None and residual.shape != x.shape)):
            raise ValueError("cpu add_rms_norm: needs fp32 CPU rows [rows, hidden] with hidden contiguous, and a "
                             "contiguous weight [hidden]")
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        residual_out = x if residual is None else torch.empty_like(out)
        rows, hidden = x.shape
        self._norm(x.data_ptr(), x.stride(0), 0 if residual is None else residual.data_ptr(),
                   0 if residual is None else residual.stride(0), weight.data_ptr(), eps, out.data_ptr(),
                   out.stride(0), residual_out.data_ptr(), residual_out.stride(0), rows, hidden)
        return out, residual_out

    def rope_store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """`rope_store_kv_reference` (kernels/rope_kv.py): RoPE'd keys and the values into their cache slots (-1:
        none), and the RoPE'd queries returned, `[tokens, heads, head_dim]`."""
        if (q.dim(), k.dim(), k_cache.dim(), cos.dim(), slot_mapping.dim()) != (3, 3, 4, 2, 1) or (
                slot_mapping.device.type != "cpu"):
            raise ValueError("cpu rope_store_kv: needs q, k, v [tokens, heads, head_dim], caches [blocks, slots, "
                             "kv_heads, head_dim], cos and sin [tokens, head_dim] and slot_mapping [tokens] on CPU")
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        if (not _rows_ok(q, k, v, cos, sin, k_cache, v_cache) or k.shape != v.shape or k.shape[0] != num_tokens
                or k.shape[2] != head_dim or head_dim % 2 or k_cache.shape[2:] != k.shape[1:]
                or k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape
                or cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape or cos.stride() != sin.stride()
                or slot_mapping.shape != (num_tokens,)):
            raise ValueError("cpu rope_store_kv: needs fp32 CPU tensors with head_dim contiguous and even, q/k/v "
                             "of the same tokens, caches of one layout, and cos/sin [tokens, head_dim]")
        slots = slot_mapping.to(torch.int64).contiguous()
        q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
        num_blocks, block_size = k_cache.shape[:2]
        status = self._rope(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1), cos.data_ptr(), sin.data_ptr(), cos.stride(0),
            k_cache.data_ptr(), v_cache.data_ptr(), num_blocks * block_size, block_size,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), slots.data_ptr(),
            q_out.data_ptr(), q_out.stride(0), q_out.stride(1), num_tokens, num_heads, num_kv_heads, head_dim,
        )
        if status != 0:
            raise ValueError(f"cpu rope_store_kv: token {status - 1}'s slot is outside the cache")
        return q_out


def load_cpu_model_ops(build_dir: Path, compiler: str = "cc") -> CpuModelOps | str:
    """The library, built into `build_dir` unless a build for this source, compiler and CPU is there
    (`kernels.cpu_build`); otherwise why it cannot be had."""
    return load_library(SOURCE, _FLAGS, build_dir, compiler, CpuModelOps)
