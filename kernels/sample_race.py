"""A token per row of logits by the exponential race, in one kernel: Triton kernel, wrapper, torch reference.

The sampler (worker/engine/sampler.py) draws a row's token as `argmax_i p_i / E_i`, `E_i ~ Exp(1)`,
`p = softmax((x - max x) / T)`. Taking logs, that is `argmax_i (x_i - max x) / T + G_i` with
`G_i = -log E_i` standard Gumbel noise: no softmax, no division by the noise, and the whole draw is
one pass to find the row's largest logit and one to race. A row of temperature 0 takes
`argmax_i x_i`. Ties go to the lowest id, as `torch.argmax`'s do.

Subtracting the row's largest logit first is what keeps a tiny temperature (1e-40, say) finite: the top
logits' keys become 0 and the rest -inf, instead of overflowing to infinities that tie.

The kernel draws its uniforms with Triton's counter-based generator keyed by a seed the caller gives
each step, at counter `row * vocab + id`, so rows and ids never share a draw. Given noise instead
(the tests and the start-up check), it races with that, and then gives exactly what the reference gives.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.interpret import check_launchable

# The uniforms' counters are int32: rows * vocab must stay below this.
MAX_COUNTER = 2**31
SEED_RANGE = 2**31
"""Seeds are drawn below this, so that the kernel's seed argument always has the same type."""


@triton.jit(do_not_specialize=["seed"])
def _race_kernel(
    logits_ptr,
    temperature_ptr,
    noise_ptr,
    out_ptr,
    seed,
    stride_l,
    stride_n,
    VOCAB: tl.constexpr,
    BLOCK: tl.constexpr,
    GIVEN_NOISE: tl.constexpr,
):
    # One program per row.
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    t = tl.load(temperature_ptr + row64)
    is_sampled = t > 0.0
    safe_t = tl.where(is_sampled, t, 1.0)
    # First pass: the row's largest logit (0 for a row that is -inf throughout, so that nothing becomes NaN).
    top = tl.full((), float("-inf"), tl.float32)
    for start in range(0, VOCAB, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row64 * stride_l + offs, mask=offs < VOCAB, other=float("-inf"))
        top = tl.maximum(top, tl.max(x, axis=0))
    top = tl.where(top == float("-inf"), 0.0, top)
    # Second pass: each id's key, tempered and raced against Gumbel noise for a sampled row, the logit itself
    # for a greedy one; the best key so far and its id, an earlier id kept on a tie.
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.full((), 0, tl.int64)
    for start in range(0, VOCAB, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < VOCAB
        x = tl.load(logits_ptr + row64 * stride_l + offs, mask=mask, other=float("-inf"))
        if GIVEN_NOISE:
            gumbel = tl.load(noise_ptr + row64 * stride_n + offs, mask=mask, other=0.0)
        else:
            # G = -log(-log U) for U uniform in [0, 1): U = 0 gives -inf, never drawn (probability 2^-24 an id).
            uniform = tl.rand(seed, row * VOCAB + offs)
            gumbel = -tl.log(-tl.log(uniform))
        # Correctly rounded division, as torch's: the same keys as the reference bit for bit, a subnormal
        # temperature included.
        key = tl.where(is_sampled, tl.div_rn(x - top, safe_t) + gumbel, x)
        key = tl.where(mask, key, float("-inf"))
        block_best = tl.max(key, axis=0)
        block_id = tl.argmax(key, axis=0).to(tl.int64) + start
        take = block_best > best
        best_id = tl.where(take, block_id, best_id)
        best = tl.where(take, block_best, best)
    tl.store(out_ptr + row64, best_id)


def sample_race(logits: torch.Tensor, temperature: torch.Tensor, seed: int,
                noise: torch.Tensor | None = None) -> torch.Tensor:
    """`[rows]` int64: each row's token of `logits` `[rows, vocab]` (float32) at its `temperature` `[rows]` (0:
    greedy), raced against the kernel's own noise for `seed` (below `SEED_RANGE`), or against `noise`
    `[rows, vocab]` (standard Gumbel) when given."""
    assert logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(-1) == 1, (logits.shape, logits.dtype)
    rows, vocab = logits.shape
    assert temperature.shape == (rows,) and temperature.dtype == torch.float32 and temperature.is_contiguous()
    assert 0 <= seed < SEED_RANGE and rows * vocab < MAX_COUNTER, (seed, rows, vocab)
    if noise is not None:
        assert noise.shape == logits.shape and noise.dtype == torch.float32 and noise.stride(-1) == 1
    check_launchable(logits.device, _race_kernel)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _race_kernel[(rows,)](
            logits, temperature, noise if noise is not None else logits, out, seed,
            logits.stride(0), noise.stride(0) if noise is not None else 0,
            VOCAB=vocab, BLOCK=min(2048, triton.next_power_of_2(vocab)), GIVEN_NOISE=noise is not None,
            num_warps=8,
        )
    return out


def sample_race_reference(logits: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The same race in torch ops, against the given Gumbel `noise`."""
    top = logits.amax(dim=-1, keepdim=True)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    t = temperature.unsqueeze(-1)
    is_sampled = t > 0
    keys = torch.where(is_sampled, (logits - top) / torch.where(is_sampled, t, torch.ones_like(t)) + noise, logits)
    return keys.argmax(dim=-1)
