"""Paged-attention kernel benchmark: decode bandwidth and prefill TFLOP/s vs torch SDPA.

    python -m bench.kernels [--dtype bf16] [--peak-gbps 3350]

Decode: batch 64, one new token per sequence, contexts 1k/4k/16k, reported as
achieved memory bandwidth (bytes of K/V read + q/out) against the device's
peak. Prefill: whole prompts, causal, reported as TFLOP/s. Each paged case is
timed in the same run as `scaled_dot_product_attention` on the same data laid
out contiguously. Seeded, warmed up, timed with CUDA events; needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.paged_attention import paged_attention

# Peak DRAM bandwidth in GB/s by a substring of `torch.cuda.get_device_name()`,
# most specific first (vendor datasheets).
KNOWN_PEAK_GBPS: list[tuple[str, float]] = [
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L4", 300.0),
    ("A10", 600.0),
    ("RTX 4090", 1008.0),
]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


def time_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def paged_inputs(shape: Shape, q_lens: list[int], ctx_lens: list[int], gen: torch.Generator) -> dict:
    """Random K/V for each sequence, scattered over shuffled cache blocks, plus the same data contiguous."""
    dev = torch.device("cuda")
    blocks_per_seq = [math.ceil(c / shape.block_size) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq)
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, device=dev, dtype=shape.dtype, generator=gen)
    v_cache = torch.randn(cache_shape, device=dev, dtype=shape.dtype, generator=gen)
    pool = torch.randperm(num_blocks, device=dev, generator=gen).to(torch.int32)
    block_tables = torch.zeros((len(ctx_lens), max(blocks_per_seq)), dtype=torch.int32, device=dev)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = pool[used : used + n]
        used += n
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q = torch.randn((sum(q_lens), shape.num_heads, shape.head_dim), device=dev, dtype=shape.dtype, generator=gen)
    # Contiguous copy for SDPA: [batch, heads, len, D]; every sequence has the same lengths here.
    assert len(set(ctx_lens)) == 1 and len(set(q_lens)) == 1
    k_dense = k_cache[block_tables.long()].flatten(1, 2)[:, : ctx_lens[0]].transpose(1, 2).contiguous()
    v_dense = v_cache[block_tables.long()].flatten(1, 2)[:, : ctx_lens[0]].transpose(1, 2).contiguous()
    q_dense = q.view(len(q_lens), q_lens[0], shape.num_heads, shape.head_dim).transpose(1, 2).contiguous()
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, cu_seqlens_q=cu,
                seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
                q_dense=q_dense, k_dense=k_dense, v_dense=v_dense)


def bench_case(shape: Shape, q_lens: list[int], ctx_lens: list[int], args: argparse.Namespace) -> tuple[float, float]:
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    t = paged_inputs(shape, q_lens, ctx_lens, gen)
    scale = shape.head_dim**-0.5
    out = torch.empty_like(t["q"])
    is_gqa = shape.num_kv_heads != shape.num_heads
    is_causal = q_lens[0] > 1

    def run_paged() -> torch.Tensor:
        return paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["cu_seqlens_q"],
                               t["seq_lens"], scale, out, max_query_len=max(q_lens), max_seq_len=max(ctx_lens))

    def run_sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(t["q_dense"], t["k_dense"], t["v_dense"], is_causal=is_causal,
                                              scale=scale, enable_gqa=is_gqa)

    # Same answer before timing: the benchmark compares equal work.
    expected = run_sdpa().transpose(1, 2).reshape(out.shape)
    torch.testing.assert_close(run_paged().float(), expected.float(), atol=2e-2, rtol=2e-2)
    return time_ms(run_paged, args.warmup, args.iters), time_ms(run_sdpa, args.warmup, args.iters)


def peak_gbps(device_name: str, override: float | None) -> float | None:
    if override is not None:
        return override
    return next((gbps for key, gbps in KNOWN_PEAK_GBPS if key in device_name), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--prefill-lens", default="1024,4096")
    parser.add_argument("--peak-gbps", type=float, default=None, help="peak DRAM bandwidth, if the device is not known")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py measures GPU kernels and needs a CUDA device; none is available here.")

    name = torch.cuda.get_device_name()
    peak = peak_gbps(name, args.peak_gbps)
    shape = Shape(args.num_heads, args.num_kv_heads, args.head_dim, args.block_size, DTYPES[args.dtype])
    elem = torch.finfo(shape.dtype).bits // 8
    print(f"device: {name}; peak bandwidth: {f'{peak:.0f} GB/s' if peak else 'unknown (pass --peak-gbps)'}")
    print(f"heads {shape.num_heads}/{shape.num_kv_heads} kv, head_dim {shape.head_dim}, "
          f"block_size {shape.block_size}, {args.dtype}, torch {torch.__version__}\n")
    print("| phase | batch | context | paged ms | paged | % of peak | SDPA ms | SDPA |")
    print("|---|---|---|---|---|---|---|---|")
    for ctx in (int(c) for c in args.contexts.split(",")):
        paged_ms, sdpa_ms = bench_case(shape, [1] * args.batch, [ctx] * args.batch, args)
        kv_bytes = 2 * args.batch * ctx * shape.num_kv_heads * shape.head_dim * elem
        qo_bytes = 2 * args.batch * shape.num_heads * shape.head_dim * elem
        gbps = [(kv_bytes + qo_bytes) / (ms * 1e-3) / 1e9 for ms in (paged_ms, sdpa_ms)]
        share = f"{100 * gbps[0] / peak:.0f}%" if peak else "-"
        print(f"| decode | {args.batch} | {ctx} | {paged_ms:.3f} | {gbps[0]:.0f} GB/s | {share} "
              f"| {sdpa_ms:.3f} | {gbps[1]:.0f} GB/s |")
    for length in (int(n) for n in args.prefill_lens.split(",")):
        batch = args.prefill_batch
        paged_ms, sdpa_ms = bench_case(shape, [length] * batch, [length] * batch, args)
        # Causal: QK^T and PV over the lower triangle, 2 flops per multiply-add.
        flops = 4 * batch * shape.num_heads * shape.head_dim * length * (length + 1) / 2
        tflops = [flops / (ms * 1e-3) / 1e12 for ms in (paged_ms, sdpa_ms)]
        print(f"| prefill | {batch} | {length} | {paged_ms:.3f} | {tflops[0]:.1f} TFLOP/s | - "
              f"| {sdpa_ms:.3f} | {tflops[1]:.1f} TFLOP/s |")


if __name__ == "__main__":
    main()
