"""Continuous batching on `skewed` at a GPU's slot count: output tokens/s, engine direct.

    python -m bench.skewed_gpu --model PATH [--max-num-seqs 32] [--requests 64] [--dtype bfloat16]

The `skewed` workload and warmed-up engine of `carpool bench`, continuous batching only, all
requests at once; reports output tokens/s over the whole run (tail included).
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.config import MODEL_DTYPES
from bench.offline import make_engine, run_offline
from bench.workloads import skewed


def skewed_tokens_per_s(model: str, max_num_seqs: int, num_requests: int, device: str, dtype: str,
                        **engine_kwargs: Any) -> tuple[float, int]:
    """(output tokens/s, output tokens) of one run of `skewed` through a fresh, warmed-up engine."""
    engine = make_engine(model, "continuous", max_num_seqs, device=device, dtype=dtype, **engine_kwargs)
    run = run_offline(engine, skewed(num_requests, seed=0), "continuous")
    tokens = sum(t.num_output_tokens for t in run.requests)
    return tokens / run.duration_s, tokens


def peer_tokens_per_s(peer: str, model: str, max_num_seqs: int, num_requests: int, device: str,
                      dtype: str) -> tuple[float, int]:
    """(output tokens/s, output tokens) of transformers' padded `generate` (`peer="generate"`, groups of
    `max_num_seqs`) or its continuous `generate_batch` on the same `skewed` requests, after a short warm-up
    (as `carpool bench` runs them)."""
    from bench.peers import load_hf_model, run_hf_generate, run_hf_generate_batch

    hf_model, tokenizer = load_hf_model(model, device, dtype)
    warm = skewed(2, seed=99, output_scale=0.02)
    workload = skewed(num_requests, seed=0)
    if peer == "generate":
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        run_hf_generate(hf_model, pad_id, warm, max_num_seqs)
        run = run_hf_generate(hf_model, pad_id, workload, max_num_seqs)
    elif peer == "generate_batch":
        run_hf_generate_batch(hf_model, warm, max_num_seqs)
        run = run_hf_generate_batch(hf_model, workload, max_num_seqs)
    else:
        raise ValueError(f"peer: generate or generate_batch, not {peer!r}")
    tokens = sum(t.num_output_tokens for t in run.requests)
    return tokens / run.duration_s, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=MODEL_DTYPES)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--modes", default="eager,graphs")
    args = parser.parse_args()
    print("| mode | slots | requests | output tokens | output tok/s |\n|---|---|---|---|---|")
    for mode in args.modes.split(","):
        rate, tokens = skewed_tokens_per_s(args.model, args.max_num_seqs, args.requests, args.device, args.dtype,
                                           cuda_graphs=mode == "graphs")
        print(f"| {mode} | {args.max_num_seqs} | {args.requests} | {tokens} | {rate:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
