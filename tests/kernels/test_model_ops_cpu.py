"""The compiled CPU add + RMSNorm and RoPE + KV store of carpool's models, against their torch references.

Like the attention kernel's tests, these compile C with the machine's compiler (`cc`, or `$CC`).
"""

from __future__ import annotations


import pytest
import torch

from kernels.model_ops_cpu import CpuModelOps, load_cpu_model_ops
from kernels.norm_act import add_rms_norm_reference
from kernels.paged_attention_torch import new_kv_cache
from kernels.rope_kv import rope_store_kv_reference
from tests.harness.cpu_kernels import compiled
from tests.harness.kernel_batches import assert_close

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory) -> CpuModelOps:
    return compiled(load_cpu_model_ops, tmp_path_factory.mktemp("kernels"))


@pytest.mark.parametrize("hidden", [8, 256, 1000])
def test_add_rms_norm_matches_reference(ops: CpuModelOps, hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    # x as a strided slice of a wider activation, as the model's are views of its products.
    wide = torch.randn((6, hidden + 3), generator=gen) * 3
    x = wide[:, :hidden]
    residual = torch.randn((6, hidden), generator=gen)
    weight = torch.randn(hidden, generator=gen)
    for given in (None, residual):
        normed, total = ops.add_rms_norm(x, given, weight, 1e-5)
        want_normed, want_total = add_rms_norm_reference(x, given, weight, 1e-5)
        assert_close(normed, want_normed, torch.float32)
        assert torch.equal(total, want_total), "the residual sum is the same fp32 add"
    assert ops.add_rms_norm(x, None, weight, 1e-5)[1] is x, "with no residual, the residual is x itself"
    empty = ops.add_rms_norm(x[:0], residual[:0], weight, 1e-5)
    assert empty[0].shape == (0, hidden)


@pytest.mark.parametrize("layout", ["token-major", "head-major"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 16), (8, 2, 32), (6, 1, 80)])
def test_rope_store_kv_matches_reference_exactly(ops: CpuModelOps, num_heads: int, num_kv_heads: int,
                                                 head_dim: int, layout: str) -> None:
    gen = torch.Generator().manual_seed(num_heads * head_dim)
    tokens, num_blocks, block_size = 7, 5, 4
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn((tokens, q_size + 2 * kv_size), generator=gen)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = (t.view(tokens, -1, head_dim) for t in (q, k, v))
    cos, sin = torch.randn((tokens, head_dim), generator=gen), torch.randn((tokens, head_dim), generator=gen)
    make = new_kv_cache if layout == "head-major" else (
        lambda *shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device))
    caches = [make(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32, device=CPU)
              for _ in range(4)]
    for cache in caches:
        cache.copy_(torch.full(cache.shape, 9.0))
    slots = torch.tensor([3, -1, 19, 0, 7, -1, 12])
    got = ops.rope_store_kv(q, k, v, cos, sin, caches[0], caches[1], slots)
    want = rope_store_kv_reference(q, k, v, cos, sin, caches[2], caches[3], slots)
    assert torch.equal(got, want)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert bool((caches[0].reshape(-1, num_kv_heads, head_dim)[[1, 2, 4]] == 9.0).all()), "unused slots untouched"


def test_rope_store_kv_refuses_a_slot_outside_the_cache(ops: CpuModelOps) -> None:
    q, k, v = torch.randn((2, 2, 8)), torch.randn((2, 1, 8)), torch.randn((2, 1, 8))
    cos, sin = torch.randn((2, 8)), torch.randn((2, 8))
    k_cache, v_cache = torch.zeros((2, 4, 1, 8)), torch.zeros((2, 4, 1, 8))
    with pytest.raises(ValueError, match="token 1's slot"):
        ops.rope_store_kv(q, k, v, cos, sin, k_cache, v_cache, torch.tensor([0, 8]))
    assert bool((k_cache[0, 0] != 0).all()), "the token before it was written"
    assert bool((k_cache[1:] == 0).all())


def test_other_dtypes_are_refused(ops: CpuModelOps) -> None:
    x = torch.randn((2, 16), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp32"):
        ops.add_rms_norm(x, None, torch.ones(16, dtype=torch.bfloat16), 1e-6)


def test_tensors_the_ops_cannot_read_are_refused(ops: CpuModelOps) -> None:
    q, k, v = torch.randn((2, 2, 8)), torch.randn((2, 1, 8)), torch.randn((2, 1, 8))
    cos, sin = torch.randn((2, 8)), torch.randn((2, 8))
    k_cache, v_cache = torch.zeros((2, 4, 1, 8)), torch.zeros((2, 4, 1, 8))
    slots = torch.tensor([0, 1])
    wrong = [
        (q, k.flatten(1), v, cos, sin, k_cache, v_cache, slots),
        (q, k, v, cos[:1], sin[:1], k_cache, v_cache, slots),
        (q, k, v, cos, sin, k_cache, v_cache[:1], slots),
        (q, k, v, cos, sin, k_cache, v_cache, slots.to("meta")),
        (q[..., :6], k[..., :6], v[..., :6], cos[:, :6], sin[:, :6], k_cache, v_cache, slots),
    ]
    for args in wrong:
        with pytest.raises(ValueError, match="cpu rope_store_kv"):
            ops.rope_store_kv(*args)
    with pytest.raises(ValueError, match="cpu add_rms_norm"):
        ops.add_rms_norm(torch.randn(4), None, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="cpu add_rms_norm"):
        ops.add_rms_norm(torch.randn((2, 4)), None, torch.ones((1, 4)), 1e-6)
