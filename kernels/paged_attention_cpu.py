"""Paged decode attention on CPU, compiled from C at start-up: the torch backend's decode path.

The torch backend (`paged_attention_torch.py`) attends with SDPA over
contexts it first gathers out of the paged cache: for every layer of every
step it copies each decoding sequence's whole context, then SDPA reads the
copy again. `paged_attention_cpu.c` reads the keys and values in place,
block by block, with an online softmax per query row. It takes every
sequence with at most `MAX_QUERY_LEN` new tokens: decodes, and the few
tokens of a speculative verification; longer prefill chunks stay on the
torch path. For the default model at 8 sequences of 50-450 tokens on
one core of an AVX-512 CPU, attention went from about a third of a decode
step to an eighth (bench/RESULTS.md).

There is no C extension to install: `load_cpu_decode_attention` compiles the
one source file with the system's C compiler (`kernels/cpu_build.py`) and
loads it with ctypes. A machine without a compiler, or a build that fails,
gets the reason as a string and the backend's torch path. The runner checks the loaded kernel against the
reference on the model's own shapes before using it
(`worker.engine.kernel_checks`). fp32 caches only: a bf16 or fp16 model's
cache takes the torch path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cpu_build import load_library

SOURCE = Path(__file__).with_suffix(".c")
_SYMBOL = "paged_decode_attention_f32"
# Reassociated fp32 sums let the compiler vectorise the dot products, as SDPA's own kernels reorder them. Not
# -ffast-math: with it, gcc links a constructor that sets flush-to-zero for the whole process when the
# library loads, which would change every other computation in it.
_FLAGS = ("-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros")
# The C source's limits (MAX_BLOCK_SIZE, MAX_ROWS, MAX_ROWS_DIM), and the most new tokens of a sequence it is
# given: decodes and speculative verification; a longer prefill chunk is attended by SDPA, which does that better.
MAX_BLOCK_SIZE, MAX_ROWS, MAX_ROWS_DIM = 256, 256, 16384
MAX_QUERY_LEN = 16

_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _I, _I, _P, _P, _I, _I, _I, _I, _P, _I, _I, _P, _P, _I, _I, _I, _I, _I, _I, _I, ctypes.c_float,
             _P, _I, _I]


def query_limit(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """The most new tokens per sequence the kernel attends for these shapes; 0 when it takes none of them."""
    group = num_heads // max(num_kv_heads, 1)
    if (num_kv_heads < 1 or group < 1 or group * num_kv_heads != num_heads or head_dim < 1
            or not 1 <= block_size <= MAX_BLOCK_SIZE):
        return 0
    return max(0, min(MAX_QUERY_LEN, MAX_ROWS // group, MAX_ROWS_DIM // (group * head_dim)))


class CpuDecodeAttention:
    """The loaded kernel. Callable like the backends' attention; attends the decode sequences only."""

    def __init__(self, library: Path) -> None:
        self.library = library
        function = getattr(ctypes.CDLL(str(library)), _SYMBOL)
        function.argtypes = _ARGTYPES
        function.restype = ctypes.c_int64
        self.function = function

    def accepts(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> bool:
        """Whether these are tensors the kernel reads and writes: fp32 on CPU, head_dim contiguous, the k and
        v caches of one layout, `out` shaped as `q`, and shapes within the kernel's limits."""
        if q.dim() != 3 or k_cache.dim() != 4 or out.shape != q.shape or k_cache.shape != v_cache.shape:
            return False
        if q.shape[2] != k_cache.shape[3] or k_cache.stride() != v_cache.stride():
            return False
        for t in (q, k_cache, v_cache, out):
            if t.device.type != "cpu" or t.dtype != torch.float32 or t.stride(-1) != 1:
                return False
        return query_limit(q.shape[1], k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]) > 0

    def plan(self, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor) -> DecodePlan:
        """One step's sequences, checked once for every layer's call (`DecodePlan`)."""
        return DecodePlan(self, block_tables, cu_seqlens_q, seq_lens)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor) -> int:
        """Write the rows of every sequence with at most `query_limit` new tokens; return that limit.

        Arguments as `paged_attention_reference`'s (kernels/paged_attention.py); `out` fp32 with head_dim
        contiguous. Rows of longer chunks are left as they were, for the caller to attend. Raises
        ValueError for tensors the kernel does not read, or a sequence whose offsets, length or block table
        are out of range.
        """
        limit = self.plan(block_tables, cu_seqlens_q, seq_lens).try_attend(q, k_cache, v_cache, scale, out)
        if limit == 0:
            raise ValueError("cpu decode attention: needs fp32 CPU tensors, head_dim contiguous, k and v caches "
                             "of one layout, out shaped as q, and shapes within the kernel's limits")
        return limit


class DecodePlan:
    """One step's block tables, query offsets and context lengths, checked and converted for the kernel once:
    each layer's call then checks only its own query, caches and output.

    Raises ValueError for metadata the kernel cannot be given (not on the CPU, wrong ranks, too few entries).
    """

    def __init__(self, kernel: CpuDecodeAttention, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 seq_lens: torch.Tensor) -> None:
        metadata = (block_tables, cu_seqlens_q, seq_lens)
        if any(t.device.type != "cpu" for t in metadata) or (block_tables.dim(), cu_seqlens_q.dim(),
                                                                seq_lens.dim()) != (2, 1, 1):
            raise ValueError("cpu decode attention: block_tables [num_seqs, width], cu_seqlens_q [num_seqs + 1] and "
                             "seq_lens [num_seqs] must be CPU tensors")
        tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
        if tables.stride(-1) != 1:
            tables = tables.contiguous()
        cu, lens = _int32(cu_seqlens_q), _int32(seq_lens)
        num_seqs = lens.shape[0]
        if cu.shape[0] != num_seqs + 1 or tables.shape[0] < num_seqs:
            raise ValueError("cpu decode attention: cu_seqlens_q needs num_seqs + 1 entries and a block-table row "
                             "per sequence")
        self.kernel = kernel
        # Held: the kernel reads them through these addresses.
        self._tensors = (tables, cu, lens)
        self._metadata = (tables.data_ptr(), tables.shape[1], tables.stride(0), cu.data_ptr(), lens.data_ptr(),
                          num_seqs)

    def try_attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                   out: torch.Tensor) -> int:
        """Write the rows of every sequence with at most `query_limit` new tokens and return that limit; 0 (and
        nothing written) for tensors the kernel does not read (`CpuDecodeAttention.accepts`), which the caller
        then attends itself. Raises ValueError for a sequence whose offsets, length or blocks are out of range."""
        if not self.kernel.accepts(q, k_cache, v_cache, out):
            return 0
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        limit = query_limit(q.shape[1], num_kv_heads, head_dim, block_size)
        tables, width, table_stride, cu, lens, num_seqs = self._metadata
        status = self.kernel.function(
            q.data_ptr(), q.stride(0), q.stride(1),
            k_cache.data_ptr(), v_cache.data_ptr(), num_blocks, k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), tables, width, table_stride, cu, lens, num_seqs, q.shape[0],
            limit, q.shape[1], num_kv_heads, head_dim, block_size, scale,
            out.data_ptr(), out.stride(0), out.stride(1),
        )
        if status != 0:
            which = "shapes beyond its limits" if status < 0 else f"sequence {status - 1}'s offsets, length or blocks"
            raise ValueError(f"cpu decode attention: {which} out of range")
        return limit


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def load_cpu_decode_attention(build_dir: Path, compiler: str = "cc") -> CpuDecodeAttention | str:
    """The library, built into `build_dir` unless a build for this source, compiler and CPU is there
    (`kernels.cpu_build`); otherwise why it cannot be had."""
    return load_library(SOURCE, _FLAGS, build_dir, compiler, CpuDecodeAttention)
