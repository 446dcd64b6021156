"""Quantized matmul benchmark: the Triton kernel against widen-then-matmul and the bf16 matmul, per layer shape.

    python -m bench.quantized_matmul [--dtype bf16] [--rows 1,8,32,128] [--peak-gbps 3350]

The 1B model's four layer matrices (qkv, o, gate_up, down) at each row count: the kernel of
`kernels/decode_matmul.py` on int8 and fp8 weights (fp8 on compute capability 8.9+; rows above its
MAX_ROWS are not its regime and show as -), `F.linear` on the int8 weight widened to the activations' dtype
(the path `linear()` takes without the kernel), `F.linear` on the same matrix in the activations' dtype, and
the same kernel reading that unquantized matrix (scales of 1), to tell the kernel's own efficiency from the
bytes saved.
Each result is checked against the reference first; times are `triton.testing.do_bench` medians (L2 flushed
between runs), seeded, in the same run. The kernel's rate is the weight bytes it reads over its time. Needs a
CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton.testing

from bench.kernels import peak_gbps
from kernels.decode_matmul import MAX_ROWS, decode_matmul, decode_matmul_reference

# (name, out features, in features) of the 1B model's layers.
LAYERS = [("qkv", 2560, 2048), ("o", 2048, 2048), ("gate_up", 11264, 2048), ("down", 2048, 5632)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The kernel and the reference differ by summation order and one rounding.
TOLERANCE = 2e-2


def _ms(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def _weights(n: int, k: int, gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """int8 and (where the GPU has it) fp8 data with per-row scales, as `quantize_weight` makes them."""
    dense = 0.02 * torch.randn((n, k), device="cuda", generator=gen)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    storages = [("int8", torch.int8, 127.0)]
    if torch.cuda.get_device_capability() >= (8, 9):
        storages.append(("fp8", torch.float8_e4m3fn, 448.0))
    for name, storage, qmax in storages:
        scales = dense.abs().amax(dim=1) / qmax
        scaled = (dense / scales[:, None]).clamp(-qmax, qmax)
        out[name] = ((scaled.round() if storage == torch.int8 else scaled).to(storage), scales)
    return out


def _kernel_ms(x: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> float | None:
    """The kernel's time, once its result matches the reference; None for more rows than it takes."""
    if x.shape[0] > MAX_ROWS:
        return None
    expected = decode_matmul_reference(x, data, scales).float()
    got = decode_matmul(x, data, scales).float()
    torch.testing.assert_close(got, expected, atol=TOLERANCE * expected.abs().max().item(), rtol=TOLERANCE)
    return _ms(lambda: decode_matmul(x, data, scales))


def _kernel_cells(ms: float | None, nbytes: int, peak: float | None) -> str:
    if ms is None:
        return "- | -"
    gbps = nbytes / (ms * 1e-3) / 1e9
    share = f" ({100 * gbps / peak:.0f}%)" if peak else ""
    return f"{ms * 1e3:.1f} | {gbps:.0f}{share}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--rows", default="1,8,32,128", help="row counts (the decode batch), comma-separated")
    parser.add_argument("--peak-gbps", type=float, default=None, help="peak DRAM bandwidth, if the device is not known")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/quantized_matmul.py times GPU kernels and needs a CUDA device; none is available here.")

    name = torch.cuda.get_device_name()
    peak = peak_gbps(name, args.peak_gbps)
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    print(f"device: {name}; peak bandwidth: {f'{peak:.0f} GB/s' if peak else 'unknown (pass --peak-gbps)'}; "
          f"{args.dtype} activations, torch {torch.__version__}, triton {triton.__version__}\n")
    print(f"| layer | N x K | rows | int8 kernel µs | int8 GB/s | fp8 kernel µs | fp8 GB/s | int8 widened µs "
          f"| {args.dtype} µs | {args.dtype} kernel µs | {args.dtype} kernel GB/s | int8 kernel / {args.dtype} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for layer, n, k in LAYERS:
        weights = _weights(n, k, gen)
        dense = weights["int8"][0].to(dtype) * weights["int8"][1].to(dtype)[:, None]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn((m, k), device="cuda", generator=gen).to(dtype)
            kernel_ms = {w: _kernel_ms(x, data, scales.to(dtype)) for w, (data, scales) in weights.items()}
            cells = {w: _kernel_cells(ms, weights[w][0].nbytes, peak) for w, ms in kernel_ms.items()}
            data, scales = weights["int8"][0], weights["int8"][1].to(dtype)
            widened_ms = _ms(lambda: F.linear(x, data.to(dtype)) * scales)
            dense_ms = _ms(lambda: F.linear(x, dense))
            dense_kernel_ms = _kernel_ms(x, dense, torch.ones(n, dtype=dtype, device="cuda"))
            int8_ms = kernel_ms["int8"]
            ratio = "-" if int8_ms is None else f"{int8_ms / dense_ms:.2f}x"
            print(f"| {layer} | {n} x {k} | {m} | {cells['int8']} | {cells.get('fp8', '- | -')} "
                  f"| {widened_ms * 1e3:.1f} | {dense_ms * 1e3:.1f} | {_kernel_cells(dense_kernel_ms, dense.nbytes, peak)} "
                  f"| {ratio} |")


if __name__ == "__main__":
    main()
