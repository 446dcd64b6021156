"""Decode-sized matrix products of the 1B model, timed as a step reads them: torch's against the matmul kernel.

    python -m bench.decode_matmul [--rows 1,8,32,64] [--weights bf16,int8,fp8] [--peak-gbps 4281]

For each of the 1B model's matrix kinds (qkv, o, gate_up and down, as many distinct copies as it has layers,
and lm_head) and each row count: torch's product on the weights in bf16 (or fp16, `--dtype`), then the Triton
kernel of `kernels/decode_matmul.py` with its default launch and with the fastest of the launches the
engine's `--matmul-tuning` times at start-up (`time_launches`: `candidate_plans`, and on a Hopper GPU the
fastest three again through a tensor descriptor), on those weights and on int8 / fp8 copies (fp8 on compute
capability 8.9+). Each is timed as `worker.engine.models.matmul_timing` times it: every copy in turn,
more bytes than the L2 cache holds, recorded once as a CUDA graph and replayed, so a launch from Python costs
nothing. The rate is the weights' bytes over that time; each kernel result is checked against the fp32
reference first. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton

from bench.kernels import peak_gbps
from kernels.decode_matmul import plan_decode_matmul
from kernels.split_kv import num_multiprocessors
from worker.engine.models.matmul_timing import Matrix, time_launches

# (name, out features, in features, copies: the 1B model's layers, one lm_head) of bench.gpu.make_1b_model.
LAYERS = [("qkv", 2560, 2048, 22), ("o", 2048, 2048, 22), ("gate_up", 11264, 2048, 22), ("down", 2048, 5632, 22),
          ("lm_head", 32000, 2048, 1)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
STORAGES = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


def _copies(n: int, k: int, copies: int, weights: str, dtype: torch.dtype, gen: torch.Generator) -> list[Matrix]:
    """`copies` distinct `[n, k]` matrices: in `dtype`, or quantized per row to int8 / fp8 with their scales."""
    out: list[Matrix] = []
    for _ in range(copies):
        dense = 0.02 * torch.randn((n, k), device="cuda", generator=gen)
        if weights not in STORAGES:
            out.append((dense.to(dtype), None))
            continue
        storage, qmax = STORAGES[weights]
        scales = dense.abs().amax(dim=1) / qmax
        scaled = (dense / scales[:, None]).clamp(-qmax, qmax)
        out.append(((scaled.round() if storage == torch.int8 else scaled).to(storage), scales.to(dtype)))
    return out


def _rate(ms: float, nbytes: int, peak: float | None) -> str:
    gbps = nbytes / (ms * 1e-3) / 1e9
    return f"{gbps:,.0f}" + (f" ({100 * gbps / peak:.0f} %)" if peak else "")


def kernel_rows(name: str, n: int, k: int, copies: int, weights: str, dtype: torch.dtype, rows: list[int],
                gen: torch.Generator, peak: float | None) -> list[str]:
    """One table row per row count for one matrix kind held as `weights`, timed as the engine's
    `--matmul-tuning` times it (`time_launches`: each plan checked against the reference first)."""
    matrices = _copies(n, k, copies, weights, dtype, gen)
    nbytes = sum(w.nbytes for w, _ in matrices)
    device = matrices[0][0].device
    with_tma = torch.cuda.get_device_capability(device) >= (9, 0)
    lines = []
    for m in rows:
        torch_ms, timed = time_launches(matrices, m, dtype, device, gen, num_multiprocessors(device),
                                        with_tma=with_tma)
        torch_cell = "–" if torch_ms is None else f"{1e3 * torch_ms / copies:.1f} µs, {_rate(torch_ms, nbytes, peak)}"
        default = plan_decode_matmul(m, n, k, num_multiprocessors(device))
        default_ms = next((ms for ms, plan in timed if plan == default), None)
        default_cell = "–" if default_ms is None else _rate(default_ms, nbytes, peak)
        if not timed:
            lines.append(f"| {name} | {n} x {k} | {weights} | {m} | {torch_cell} | – | no plan ran | – |")
            continue
        best_ms, best = min(timed, key=lambda item: item[0])
        lines.append(f"| {name} | {n} x {k} | {weights} | {m} | {torch_cell} | {default_cell} | "
                     f"{1e3 * best_ms / copies:.1f} µs, {_rate(best_ms, nbytes, peak)} | {best.describe()} |")
    return lines


TABLE_HEADER = ("| layer | N x K | weights | rows | torch's product, per matrix | kernel, default launch GB/s "
                "| kernel, fastest launch, per matrix | fastest launch |\n|---|---|---|---|---|---|---|---|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activations and plain weights")
    parser.add_argument("--rows", default="1,8,32,64", help="row counts (the decode batch), comma-separated")
    parser.add_argument("--weights", default="bf16,int8,fp8",
                        help="comma-separated: the plain dtype's name (bf16 / fp16), int8, fp8")
    parser.add_argument("--layers", default=",".join(name for name, *_ in LAYERS))
    parser.add_argument("--peak-gbps", type=float, default=None, help="the bandwidth to give rates as a share of")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.decode_matmul times GPU kernels and needs a CUDA device; none is available here.")
    name = torch.cuda.get_device_name()
    peak = peak_gbps(name, args.peak_gbps)
    dtype = DTYPES[args.dtype]
    weights = [w for w in args.weights.split(",") if w]
    if "fp8" in weights and torch.cuda.get_device_capability() < (8, 9):
        weights.remove("fp8")
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    print(f"device: {name}; rates as a share of {f'{peak:,.0f} GB/s' if peak else 'nothing (pass --peak-gbps)'}; "
          f"{args.dtype} activations, torch {torch.__version__}, triton {triton.__version__}\n", flush=True)
    print(TABLE_HEADER, flush=True)
    rows = [int(r) for r in args.rows.split(",")]
    for layer, n, k, copies in LAYERS:
        if layer not in args.layers.split(","):
            continue
        for held in weights:
            for line in kernel_rows(layer, n, k, copies, held, dtype, rows, gen, peak):
                print(line, flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
