"""fp32 weights packed for oneDNN on CPU: the same products as `F.linear`, and which models hold them.

Greedy tokens and logits of packed models against transformers are checked
where every own model is (`test_own_models.py`): on CPU in fp32 those models
run with packed weights.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from worker.engine.model_runner import ModelRunner
from worker.engine.models.llama_family import read_safetensors
from worker.engine.models.packed import PackedWeight, pack_verified, pack_weight, packed_linear

# Relative to the product's largest value: the two differ by the order of fp32 sums.
TOLERANCE = 1e-5


@pytest.mark.parametrize("shape", [(96, 64), (1024, 1024)], ids=["small", "large"])
@pytest.mark.parametrize("rows", [1, 2, 8, 33])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_packed_product_is_f_linear(shape: tuple[int, int], rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(shape, generator=gen)
    bias = torch.randn(shape[0], generator=gen) if with_bias else None
    x = torch.randn((rows, shape[1]), generator=gen)
    packed = pack_weight(weight)
    # The plain copy serves one-row products; both copies count in the bytes held.
    assert torch.equal(packed.plain, weight) and packed.shape == weight.shape
    assert packed.nbytes == 2 * weight.nbytes
    want = F.linear(x, weight, bias)
    got = packed_linear(x, packed, bias)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=TOLERANCE * float(want.abs().max()), rtol=0)


@pytest.mark.parametrize("shape", [(96, 64), (64, 172), (262, 256)])
def test_packing_passes_its_check_on_this_cpu(shape: tuple[int, int]) -> None:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    packed = pack_verified(weight)
    assert isinstance(packed, PackedWeight), packed
    x = torch.randn((4, shape[1]))
    torch.testing.assert_close(packed_linear(x, packed), F.linear(x, weight), rtol=0,
                               atol=TOLERANCE * float(F.linear(x, weight).abs().max()))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_cpu_fp32_models_hold_packed_weights(tiny_model: Callable[..., str], tied: bool) -> None:
    path = tiny_model("qwen2", tie_word_embeddings=tied)
    runner = ModelRunner(path, dtype="float32", num_blocks=8, model_impl="carpool")
    model = runner.model
    assert model.packed  # type: ignore[attr-defined]
    for layer in model.layers:  # type: ignore[attr-defined]
        assert all(isinstance(w, PackedWeight) for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    # A tied output projection is the embedding table, which the lookup reads plain.
    assert isinstance(model.lm_head, torch.Tensor) == tied  # type: ignore[attr-defined]
    assert (model.lm_head is model.embed) == tied  # type: ignore[attr-defined]


def test_other_dtypes_keep_plain_weights(tiny_model: Callable[..., str]) -> None:
    runner = ModelRunner(tiny_model("llama"), dtype="bfloat16", num_blocks=8, model_impl="carpool")
    layer = runner.model.layers[0]  # type: ignore[attr-defined]
    assert not runner.model.packed  # type: ignore[attr-defined]
    assert all(isinstance(w, torch.Tensor) for w in (layer.qkv, layer.o, layer.gate_up, layer.down))


@pytest.mark.parametrize(("dtype", "tied"), [("float32", False), ("float32", True), ("bfloat16", False)])
def test_matrix_bytes_count_each_matrix_once(tiny_model: Callable[..., str], dtype: str, tied: bool) -> None:
    """What a decode step reads of the matrices: the checkpoint's projections and output layer in the model's
    dtype, a packed weight's two copies counted once."""
    path = tiny_model("llama", tie_word_embeddings=tied)
    weights = read_safetensors(path)
    names = [n for n in weights if n.endswith("_proj.weight")] + ["embed_tokens.weight" if tied else "lm_head.weight"]
    element_size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    runner = ModelRunner(path, dtype=dtype, num_blocks=8, model_impl="carpool")
    assert runner.model.matrix_nbytes == element_size * sum(weights[n].numel() for n in names)  # type: ignore[attr-defined]
