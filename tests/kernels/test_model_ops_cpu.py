"""The compiled CPU add + RMSNorm, SiLU-and-multiply and RoPE + KV store of carpool's models, one by one and
through a forward's calls, against their torch references.

Like the attention kernel's tests, these compile C with the machine's compiler (`cc`, or `$CC`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kernels.model_ops_cpu import CpuModelOps, load_cpu_model_ops
from kernels.norm_act import add_rms_norm_reference, silu_and_mul_reference
from kernels.paged_attention import paged_attention_reference
from kernels.paged_attention_cpu import CpuDecodeAttention, load_cpu_decode_attention
from kernels.paged_attention_torch import new_kv_cache
from kernels.rope_kv import rope_store_kv_reference
from tests.harness.cpu_kernels import compiled
from tests.harness.kernel_batches import assert_close

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory) -> CpuModelOps:
    return compiled(load_cpu_model_ops, tmp_path_factory.mktemp("kernels"))


@pytest.fixture(scope="module")
def attention(tmp_path_factory: pytest.TempPathFactory) -> CpuDecodeAttention:
    return compiled(load_cpu_decode_attention, tmp_path_factory.mktemp("kernels"))


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


@pytest.mark.parametrize("scale", [1.0, 4.0, 40.0])
def test_silu_and_mul_matches_reference(ops: CpuModelOps, scale: float) -> None:
    gen = torch.Generator().manual_seed(int(scale))
    wide = torch.randn((5, 2 * 300 + 7), generator=gen) * scale
    gate_up = wide[:, : 2 * 300]  # rows strided as a slice of a wider tensor
    assert_close(ops.silu_and_mul(gate_up), silu_and_mul_reference(gate_up), torch.float32)
    assert ops.silu_and_mul(gate_up[:0]).shape == (0, 300)


def test_silu_and_mul_at_the_ends_of_the_float_range(ops: CpuModelOps) -> None:
    gate = torch.tensor([0.0, -0.0, 88.0, -88.0, 89.0, -89.0, 104.0, -104.0, 200.0, -200.0, 1e-30, -1e-30,
                         float("inf"), float("-inf"), float("nan")])
    gate_up = torch.cat([gate, torch.full_like(gate, 1.5)])[None]
    got, want = ops.silu_and_mul(gate_up), silu_and_mul_reference(gate_up)
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    finite = ~want.isnan()
    assert torch.equal(got[finite].isinf(), want[finite].isinf()), (got, want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-6, atol=1e-38), (got, want)


def test_silu_and_mul_refuses_what_it_cannot_read(ops: CpuModelOps) -> None:
    for wrong in (torch.randn(8), torch.randn((2, 7)), torch.randn((2, 8), dtype=torch.bfloat16),
                  torch.randn((8, 2)).t()):
        with pytest.raises(ValueError, match="cpu silu_and_mul"):
            ops.silu_and_mul(wrong)


@dataclass
class _ForwardCase:
    """A forward of 5 tokens over two layers' head-major caches; hidden 48, intermediate 40, 4 heads, 2 kv heads,
    head_dim 16."""

    shapes: tuple[int, int, int, int, int] = (48, 40, 4, 2, 16)
    gen: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(5))
    cos: torch.Tensor = field(init=False)
    sin: torch.Tensor = field(init=False)
    slots: torch.Tensor = field(default_factory=lambda: torch.tensor([9, -1, 0, 30, 17]))
    k_caches: list[torch.Tensor] = field(init=False)
    v_caches: list[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        head_dim = self.shapes[4]
        self.cos, self.sin = (torch.randn((5, head_dim), generator=self.gen) for _ in range(2))
        self.k_caches, self.v_caches = ([new_kv_cache(8, 4, 2, head_dim, torch.float32, CPU).normal_(generator=self.gen)
                                         for _ in range(2)] for _ in range(2))


def test_forward_calls_match_the_checked_ops_layer_after_layer(ops: CpuModelOps) -> None:
    case = _ForwardCase()
    hidden, intermediate, num_heads, num_kv_heads, head_dim = case.shapes
    cos, sin, slots, gen, k_caches, v_caches = case.cos, case.sin, case.slots, case.gen, case.k_caches, case.v_caches
    want_k, want_v = [c.clone() for c in k_caches], [c.clone() for c in v_caches]
    forward = ops.forward(hidden, intermediate, num_heads, num_kv_heads, head_dim, cos, sin, slots, k_caches,
                          v_caches, None)
    embeddings = torch.randn((5, hidden), generator=gen)
    weight = torch.randn(hidden, generator=gen)
    want_stream: torch.Tensor | None = None
    stream: torch.Tensor | None = None
    x = embeddings.clone()
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    for layer in range(2):
        normed, stream = forward.add_rms_norm(x, stream, weight, 1e-6)
        want_normed, want_stream = add_rms_norm_reference(x if layer else embeddings, want_stream, weight, 1e-6)
        assert_close(normed, want_normed, torch.float32)
        assert torch.equal(stream, want_stream)
        qkv = torch.randn((5, q_size + 2 * kv_size), generator=gen)
        q, k, v = (t.view(5, -1, head_dim) for t in qkv.split([q_size, kv_size, kv_size], dim=-1))
        got_q = forward.rope_store_kv(layer, qkv)
        want_q = rope_store_kv_reference(q, k, v, cos, sin, want_k[layer], want_v[layer], slots)
        assert torch.equal(got_q, want_q)
        assert torch.equal(k_caches[layer], want_k[layer]) and torch.equal(v_caches[layer], want_v[layer])
        gate_up = torch.randn((5, 2 * intermediate), generator=gen)
        assert_close(forward.silu_and_mul(gate_up), silu_and_mul_reference(gate_up), torch.float32)
        x = torch.randn((5, hidden), generator=gen)
    assert forward.attend(0, got_q, 1, head_dim**-0.5) is None, "no attention plan: the caller attends"


def test_forward_attends_decodes_and_leaves_longer_chunks_to_the_caller(ops: CpuModelOps,
                                                                       attention: CpuDecodeAttention) -> None:
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    gen = torch.Generator().manual_seed(8)
    caches = [new_kv_cache(6, block_size, num_kv_heads, head_dim, torch.float32, CPU).normal_(generator=gen)
              for _ in range(2)]
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    cu, lens = torch.tensor([0, 1, 2, 3], dtype=torch.int32), torch.tensor([5, 8, 1], dtype=torch.int32)
    q = torch.randn((3, num_heads, head_dim), generator=gen)
    cos = sin = torch.zeros((3, head_dim))
    plan = attention.plan(tables, cu, lens)
    forward = ops.forward(32, 8, num_heads, num_kv_heads, head_dim, cos, sin, torch.tensor([-1, -1, -1]),
                          [caches[0]], [caches[1]], plan)
    got = forward.attend(0, q, 1, head_dim**-0.5)
    assert got is not None
    assert_close(got, paged_attention_reference(q, caches[0], caches[1], tables, cu, lens, head_dim**-0.5),
                 torch.float32)
    assert forward.attend(0, q, 40, head_dim**-0.5) is None, "a chunk longer than the kernel takes"


def test_forward_refuses_what_its_kernels_cannot_read(ops: CpuModelOps) -> None:
    case = _ForwardCase()
    shapes, cos, sin, slots = case.shapes, case.cos, case.sin, case.slots
    k_caches, v_caches = case.k_caches, case.v_caches
    hidden, intermediate = shapes[:2]
    half = [c.to(torch.bfloat16) for c in k_caches]
    for wrong in ((cos[:2], sin[:2], slots, k_caches, v_caches), (cos, sin, slots, half, v_caches),
                  (cos, sin, slots, k_caches, v_caches[:1]), (cos, sin.t(), slots, k_caches, v_caches)):
        with pytest.raises(ValueError, match="cpu forward"):
            ops.forward(*shapes, *wrong, None)
    forward = ops.forward(*shapes, cos, sin, slots, k_caches, v_caches, None)
    weight = torch.ones(hidden)
    with pytest.raises(ValueError, match="add_rms_norm"):
        forward.add_rms_norm(torch.randn((4, hidden)), None, weight, 1e-6)  # rows of another step
    _, stream = forward.add_rms_norm(torch.randn((5, hidden)), None, weight, 1e-6)
    with pytest.raises(ValueError, match="residual stream"):
        forward.add_rms_norm(torch.randn((5, hidden)), stream.clone(), weight, 1e-6)
    with pytest.raises(ValueError, match="rope_store_kv"):
        forward.rope_store_kv(0, torch.randn((5, 3 * hidden)))
    with pytest.raises(ValueError, match="silu_and_mul"):
        forward.silu_and_mul(torch.randn((5, intermediate)))
    # The caches are checked again when other tensors come: a bf16 layer in place of a checked one.
    with pytest.raises(ValueError, match="cpu forward"):
        ops.forward(*shapes, cos, sin, slots, [k_caches[0], half[1]], v_caches, None)
