"""Seeded noise for the sampler: a counter-based hash of (seed, position, token), on any device.

The exponential race (`argmax_i p_i / E_i`, see worker/engine/sampler.py) needs one
`E ~ Exp(1)` per token. Drawing them from a generator keyed by
`(seed, position)` ties the draw to one device and costs a generator per row;
here each `E` is a pure function of `(seed, position, token)`, computed for a
whole `[rows, vocab]` block at once with elementwise torch ops:

1. Per row, two 32-bit keys from `(seed, position)` by chained rounds of
   `pcg_hash` (Jarzynski & Olano, "Hash Functions for GPU Rendering", 2020).
   Two independent chains make a 64-bit row key, so two (seed, position)
   pairs share their noise only if both 32-bit chains collide.
2. Per token, `pcg(T[token] ^ k0) ^ k1` with `T[token] = pcg(token ^ c)` a
   constant table: 32 uniform bits. Hashing the token first keeps rows whose
   keys differ in a few low bits from sharing a permutation of one noise set.
3. The top 23 bits `m` give `u = (2m + 1) / 2^24`, strictly inside (0, 1).
4. `E = -log(u)` by a fixed polynomial (Cephes' `logf`) in plain float32
   multiplies and adds.

Every integer step keeps its values in int64 below 2^63 (32-bit words, and
multipliers below 2^30), so nothing overflows and the bits are the same on
every device. Step 3 is exact in float32 (`2m + 1 < 2^24`). Step 4 uses only
`frexp` (exact) and separate elementwise `+ - *` on float32, each rounded to
nearest by IEEE 754 on the CPU and on CUDA; `torch.log` is not used because
its CPU kernel rounds differently in its vectorised body and its scalar tail
(so an element's noise would depend on where it lands in the batch) and
CUDA's `logf` differs again. So `E` is bit-identical on every device and in
every batch.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
# Two row-key chains start from different lanes so that they are independent.
_LANE_0 = 0x243F6A88
_LANE_1 = 0x85A308D3
_LANE_TOKEN = 0x13198A2E
# Cephes logf: log(1 + x) = x - x^2/2 + x^3 * P(x) for x in [sqrt(1/2) - 1, sqrt(2) - 1].
_LOG_POLY = (
    7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
    -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1,
)
_SQRT_HALF = 0.707106781186547524
# ln 2 split in two so that e * ln2 keeps its precision: 0.693359375 has few bits, e * it is exact.
_LN2_HI = 0.693359375
_LN2_LO = -2.12194440e-4


def pcg_hash_(x: torch.Tensor) -> torch.Tensor:
    """`pcg_hash` of 32-bit words held in int64, in place (returns `x`, still 32-bit words)."""
    # In place because the sampler hashes [rows, vocab] blocks: a temporary per op costs as much as the op.
    # Products stay below 2^63: x < 2^32 and both multipliers < 2^30.
    x.mul_(747796405).add_(2891336453).bitwise_and_(_MASK32)
    word = torch.bitwise_right_shift(x, 28).add_(4)
    torch.bitwise_right_shift(x, word, out=word)
    word.bitwise_xor_(x).mul_(277803737).bitwise_and_(_MASK32)
    torch.bitwise_right_shift(word, 22, out=x)
    return x.bitwise_xor_(word)


def token_keys(vocab: int, device: str | torch.device) -> torch.Tensor:
    """One 32-bit key per token id (int64 `[vocab]`); a constant the sampler keeps per device."""
    return pcg_hash_(torch.arange(vocab, dtype=torch.int64, device=device) ^ _LANE_TOKEN)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row from int64 `seeds` (< 2^63) and `positions` (< 2^32), both `[n]`."""
    seed_lo, seed_hi = seeds & _MASK32, seeds >> 32
    position = positions & _MASK32
    keys = []
    for lane in (_LANE_0, _LANE_1):
        key = pcg_hash_(seed_lo ^ lane)
        key = pcg_hash_(key.bitwise_xor_(seed_hi))
        keys.append(pcg_hash_(key.bitwise_xor_(position)))
    return keys[0], keys[1]


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`[n, vocab]` float32 uniforms in (0, 1), a pure function of (seed, position, token).

    `tokens` is `token_keys(vocab, device)`.
    """
    key_0, key_1 = row_keys(seeds, positions)
    bits = pcg_hash_(tokens ^ key_0.unsqueeze(-1))
    bits.bitwise_xor_(key_1.unsqueeze(-1))
    odd = bits.bitwise_right_shift_(9).mul_(2).add_(1)  # in [1, 2^24): exact in float32
    return odd.to(torch.float32).mul_(2.0 ** -24)


def neg_log_(u: torch.Tensor) -> torch.Tensor:
    """`-log(u)` for float32 `u` in (0, 1], rounded the same way on every device (Cephes logf).

    Overwrites `u`'s memory for its own steps; returns a new tensor.
    """
    mantissa, exponent = torch.frexp(u)  # u = mantissa * 2^exponent, mantissa in [0.5, 1)
    is_low = mantissa < _SQRT_HALF
    # Bring the mantissa into [sqrt(1/2), sqrt(2)) and take x = mantissa - 1 (both steps exact).
    x = mantissa.mul_(is_low.to(torch.float32).add_(1.0)).sub_(1.0)
    e = exponent.sub_(is_low.to(exponent.dtype)).to(torch.float32)
    z = torch.mul(x, x, out=u)
    y = torch.full_like(x, _LOG_POLY[0])
    for coefficient in _LOG_POLY[1:]:
        y.mul_(x).add_(coefficient)
    # y = x^3 P(x) + e * ln2_lo - x^2 / 2, then log = x + y + e * ln2_hi, in Cephes' order.
    y.mul_(x).mul_(z).add_(e * _LN2_LO).sub_(z.mul_(0.5))
    return x.add_(y).add_(e.mul_(_LN2_HI)).neg_()


def exponential_noise(
    seeds: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, rows_per_chunk: int | None = None
) -> torch.Tensor:
    """`[n, vocab]` float32 draws of Exp(1), one per (seed, position, token); `tokens` as for `uniform_noise`.

    `rows_per_chunk` computes that many rows at a time: on a CPU the ~40 passes over the block then
    stay in cache (2-3x faster at a 128k vocabulary); on a GPU one chunk costs the fewest launches.
    Every element is computed on its own, so the chunking changes no value.
    """
    n = seeds.shape[0]
    step = n if rows_per_chunk is None else max(1, rows_per_chunk)
    if step >= n:
        return neg_log_(uniform_noise(seeds, positions, tokens))
    out = torch.empty(n, tokens.shape[0], device=tokens.device)
    for start in range(0, n, step):
        end = start + step
        out[start:end] = neg_log_(uniform_noise(seeds[start:end], positions[start:end], tokens))
    return out


def seeded_exponential_noise(seed: int, position: int, vocab: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """The `[vocab]` noise the sampler uses for a request with `seed` at `position`."""
    seeds = torch.tensor([seed], dtype=torch.int64, device=device)
    positions = torch.tensor([position], dtype=torch.int64, device=device)
    return exponential_noise(seeds, positions, token_keys(vocab, device))[0]
