"""carpool's own models' fused small ops on CPU, compiled from C at start-up: add + RMSNorm, SiLU-and-multiply,
RoPE + KV store.

On CUDA these are the Triton kernels of `norm_act.py` and `rope_kv.py`. On
CPU their torch references cost a dispatch per op: the residual add and
RMSNorm are seven ops, SiLU-and-multiply three, RoPE of q and k and the KV
store about twenty, per layer and step, which for a small model is time
comparable to its matrix products. `model_ops_cpu.c` does each group in one
call, with the references' arithmetic in fp32 (the sum of squares in another
order, and its own e^x for SiLU). It is built like the attention kernel
(`kernels/cpu_build.py`, without reassociation and without contracting
multiply-adds, so each product rounds as torch's does), and the runner checks
it against the references on the model's shapes before the model uses it
(`worker/engine/kernel_checks.py`). fp32 on CPU only.

The checked calls (`CpuModelOps`) validate every tensor, which in Python
costs several times the work of the call itself for a small model. A forward
goes through `CpuForward` instead: the arguments shared by every layer (RoPE
tables, slots, caches, attention plan) are checked once per step, each layer's
call checks only its own input, and results go into buffers reused from layer
to layer.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu_build import load_library
from kernels.paged_attention_cpu import DecodePlan, query_limit

SOURCE = Path(__file__).with_suffix(".c")
_FLAGS = ("-ffp-contract=off",)
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _rows_ok(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors)


def _caches_ok(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> bool:
    """A layer's caches `[blocks, slots, kv_heads, head_dim]` as the RoPE + store kernel writes them."""
    return (k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim) and _rows_ok(k_cache, v_cache)
            and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride())


class CpuModelOps:
    """The loaded library: `add_rms_norm`, `silu_and_mul` and `rope_store_kv`, with the references' signatures,
    each call checked; `forward` for a model's forward."""

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
        self._silu = handle.silu_and_mul_f32
        self._silu.argtypes = [_P, _I, _P, _I, _I, _I]
        self._silu.restype = None
        # The caches of the last forward, checked: a runner passes the same tensors every step.
        self._checked_caches: tuple[tuple[int, int], list[torch.Tensor]] | None = None

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

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu_and_mul_reference` (kernels/norm_act.py): `[rows, 2 * inter]` in, `[rows, inter]` out."""
        if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not _rows_ok(gate_up):
            raise ValueError("cpu silu_and_mul: needs fp32 CPU rows [rows, 2 * inter], each row contiguous")
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, inter), dtype=gate_up.dtype)
        self._silu(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0), rows, inter)
        return out

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
        if (not _rows_ok(q, k, v, cos, sin) or k.shape != v.shape or k.shape[0] != num_tokens
                or k.shape[2] != head_dim or head_dim % 2 or not _caches_ok(k_cache, v_cache, num_kv_heads, head_dim)
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

    def caches_ok(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], num_kv_heads: int,
                  head_dim: int) -> bool:
        """Whether every layer's caches are ones `rope_store_kv` writes (`[blocks, slots, kv_heads, head_dim]`,
        fp32 on CPU, k and v of one layout). Checked once for the same tensors (which no one resizes in place)."""
        if len(k_caches) != len(v_caches):
            return False
        tensors = [*k_caches, *v_caches]  # equal halves: the same list means the same k/v pairs
        checked = self._checked_caches
        if checked is not None and checked[0] == (num_kv_heads, head_dim) and len(checked[1]) == len(tensors) and all(
                a is b for a, b in zip(checked[1], tensors)):
            return True
        if not all(_caches_ok(k, v, num_kv_heads, head_dim) for k, v in zip(k_caches, v_caches)):
            return False
        self._checked_caches = ((num_kv_heads, head_dim), tensors)
        return True

    def forward(self, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int, head_dim: int,
                cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor], decode: DecodePlan | None) -> CpuForward:
        """The calls of one forward over `slot_mapping`'s tokens (`CpuForward`), its shared arguments checked."""
        return CpuForward(self, hidden, intermediate, num_heads, num_kv_heads, head_dim, cos, sin, slot_mapping,
                          k_caches, v_caches, decode)


class CpuForward:
    """One forward's calls into the library, for every layer of a model; raises ValueError for arguments the
    kernels cannot take.

    The step-wide arguments are checked once: the RoPE tables `cos`/`sin` `[tokens, head_dim]`, the slots,
    every layer's caches, and `decode`, the compiled attention's plan for the step (None: attention is left to
    the caller). Each call then checks only its own input. The residual stream is one `[tokens, hidden]` tensor:
    the first `add_rms_norm` takes its input (the embeddings) as it, and every later one adds into it in place.
    The normed rows, RoPE'd queries, attention output and activations go into buffers reused from layer to
    layer, so each result must be used (by the next matrix product, or the attention) before the same call of
    the next layer.
    """

    def __init__(self, ops: CpuModelOps, hidden: int, intermediate: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                 k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], decode: DecodePlan | None) -> None:
        num_tokens = slot_mapping.shape[0]
        if (slot_mapping.dim() != 1 or slot_mapping.device.type != "cpu" or head_dim % 2
                or not _rows_ok(cos, sin) or cos.shape != (num_tokens, head_dim) or sin.shape != cos.shape
                or cos.stride() != sin.stride() or not ops.caches_ok(k_caches, v_caches, num_kv_heads, head_dim)):
            raise ValueError("cpu forward: needs slot_mapping [tokens], fp32 CPU cos and sin [tokens, head_dim] of "
                             "one layout, an even head_dim, and each layer's fp32 caches of one layout")
        self._ops = ops
        self._caches = (k_caches, v_caches)
        # The most new tokens per sequence the compiled attention takes on these shapes (0: none).
        block_size = k_caches[0].shape[1] if k_caches else 0
        self._decode_limit = 0 if decode is None else query_limit(num_heads, num_kv_heads, head_dim, block_size)
        self._decode = decode
        self._slots = slot_mapping.to(torch.int64).contiguous()
        self._tables = (cos, sin)  # held: the kernels read them through their addresses
        self._rows = (num_tokens, hidden)
        self._qkv_shape = (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
        self._gate_up_shape = (num_tokens, 2 * intermediate)
        self._heads = (num_heads, num_kv_heads, head_dim)
        self._residual: torch.Tensor | None = None
        self._normed = torch.empty(self._rows)
        self._q = torch.empty((num_tokens, num_heads, head_dim))
        self._attended = torch.empty((num_tokens, num_heads, head_dim))
        self._act = torch.empty((num_tokens, intermediate))

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """As `CpuModelOps.add_rms_norm`, `residual` the one this forward returned last (None the first time):
        the normed rows and the residual stream, updated in place."""
        if residual is not self._residual or not _contiguous(x, self._rows) or not _contiguous(weight, self._rows[1:]):
            raise ValueError("cpu forward: add_rms_norm takes contiguous fp32 rows [tokens, hidden], a weight "
                             "[hidden], and the residual stream this forward returned last")
        if residual is None:
            self._residual = residual = x
            residual_pointer = 0
        else:
            residual_pointer = residual.data_ptr()
        normed = self._normed
        rows, hidden = self._rows
        self._ops._norm(x.data_ptr(), hidden, residual_pointer, hidden, weight.data_ptr(), eps, normed.data_ptr(),
                        hidden, residual.data_ptr(), hidden, rows, hidden)
        return normed, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """As `CpuModelOps.silu_and_mul`, for contiguous rows `[tokens, 2 * intermediate]`."""
        if not _contiguous(gate_up, self._gate_up_shape):
            raise ValueError("cpu forward: silu_and_mul takes contiguous fp32 rows [tokens, 2 * intermediate]")
        act = self._act
        self._ops._silu(gate_up.data_ptr(), gate_up.shape[1], act.data_ptr(), act.shape[1], *act.shape)
        return act

    def rope_store_kv(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        """The RoPE'd queries `[tokens, heads, head_dim]` of the fused qkv product's contiguous rows; the keys,
        RoPE'd, and values written to layer `layer`'s caches (as `CpuModelOps.rope_store_kv`)."""
        if not _contiguous(qkv, self._qkv_shape):
            raise ValueError("cpu forward: rope_store_kv takes the contiguous fp32 rows of the qkv product")
        num_heads, num_kv_heads, head_dim = self._heads
        k_cache, v_cache = self._caches[0][layer], self._caches[1][layer]
        cos, sin = self._tables
        q_out = self._q
        num_tokens, width = self._qkv_shape
        k_offset = 4 * num_heads * head_dim  # bytes into a row: q, then k, then v
        v_offset = k_offset + 4 * num_kv_heads * head_dim
        num_blocks, block_size = k_cache.shape[:2]
        base = qkv.data_ptr()
        status = self._ops._rope(
            base, width, head_dim, base + k_offset, width, head_dim, base + v_offset, width, head_dim,
            cos.data_ptr(), sin.data_ptr(), cos.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            num_blocks * block_size, block_size, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            self._slots.data_ptr(), q_out.data_ptr(), num_heads * head_dim, head_dim, num_tokens, num_heads,
            num_kv_heads, head_dim,
        )
        if status != 0:
            raise ValueError(f"cpu rope_store_kv: token {status - 1}'s slot is outside the cache")
        return q_out

    def attend(self, layer: int, q: torch.Tensor, max_query_len: int, scale: float) -> torch.Tensor | None:
        """Layer `layer`'s attention of `q` `[tokens, heads, head_dim]` by the compiled kernel, when it takes every
        sequence of the step (at most `max_query_len` new tokens each); None when the caller must attend."""
        if self._decode is None or max_query_len > self._decode_limit:
            return None
        out = self._attended
        limit = self._decode.try_attend(q, self._caches[0][layer], self._caches[1][layer], scale, out)
        return out if limit else None


def _contiguous(t: torch.Tensor, shape: tuple[int, ...]) -> bool:
    return t.shape == shape and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def load_cpu_model_ops(build_dir: Path, compiler: str = "cc") -> CpuModelOps | str:
    """The library, built into `build_dir` unless a build for this source, compiler and CPU is there
    (`kernels.cpu_build`); otherwise why it cannot be had."""
    return load_library(SOURCE, _FLAGS, build_dir, compiler, CpuModelOps)
