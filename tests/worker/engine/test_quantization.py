"""Weight-only int8 and fp8 quantization of carpool's own models, on CPU.

Quantization changes the model, so greedy tokens are compared with a
reference that holds the same quantized weights: transformers' model with
each q/k/v/o/gate/up/down weight replaced by its quantize-then-dequantize
value (per-row scales quantize a fused matrix exactly as they quantize its
parts). Logits are compared with full precision at stated tolerances, and
the bytes of the linear weights with those of the full-precision model.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from scheduler import SamplingParams
from tests.harness.model_reference import assert_greedy_in_every_regime
from worker import Engine
from worker.config import WorkerConfig
from worker.engine.model_runner import ModelRunner, StepSeq
from worker.engine.models.quantization import (
    Quantization,
    QuantizedLinear,
    QuantizedWeight,
    check_device_supports,
    linear,
    quantize_weight,
)

MAX_NEW_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("llama", {}),
    "qwen2-bias-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 32}),
}
# Largest logit error over a batch, relative to the batch's largest full-precision logit. The random tiny models
# amplify any rounding (bf16 alone is 0.02-0.045 off fp32 on them); measured over six batches of the three
# variants in fp32 and bf16: int8 0.02-0.12, fp8 (3 mantissa bits) 0.08-0.33.
LOGIT_TOLERANCES = {Quantization.INT8: 0.15, Quantization.FP8: 0.4}
# The bound: quantized linear weights (data + scales) against the same matrices in the model's dtype.
MAX_BYTES_RATIO = 0.55


def _name(value: object) -> str:
    return value.value if isinstance(value, Quantization) else str(value)


def _linear_bytes(runner: ModelRunner) -> int:
    """Bytes the four layer matrices hold: quantized, their data and scales; otherwise, the matrices in the model's
    dtype (a full-precision model may hold them packed for CPU as well, which is not what quantization compares)."""
    layers = runner.model.layers  # type: ignore[attr-defined]
    weights = [w for layer in layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    if all(isinstance(w, QuantizedWeight) for w in weights):
        return sum(w.nbytes for w in weights)
    return sum(w.shape[0] * w.shape[1] for w in weights) * runner.dtype.itemsize


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(11)
    lengths = [1, 3, 8, 9, 17, 30, rng.randint(2, 30), rng.randint(2, 30)]
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]
    shared = [rng.randrange(vocab_size) for _ in range(16)]
    return prompts + [shared + [rng.randrange(vocab_size) for _ in range(i)] for i in range(4)]


def _reference_greedy(path: str, quantization: Quantization | None, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens in fp32, with every linear layer but the output projection replaced by its
    quantized value (if any)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    output = model.get_output_embeddings()
    with torch.inference_mode():
        for module in model.modules():
            if quantization and isinstance(module, torch.nn.Linear) and module is not output:
                module.weight.copy_(quantize_weight(module.weight, quantization, torch.float32).dequantize())
        outputs = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.mark.parametrize("quantization", list(Quantization), ids=_name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_linear_matches_the_dequantized_weight(quantization: Quantization, dtype: torch.dtype) -> None:
    """Irregular shapes, a bias, a 3-D input and an all-zero row; bf16 int8 takes the int8 kernel."""
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features, rows in [(1, 7, 1), (37, 64, 5), (130, 33, 19)]:
        weight = torch.randn(out_features, in_features, generator=generator) * 0.3
        weight[out_features // 2] = 0.0
        quantized = quantize_weight(weight, quantization, dtype)
        assert quantized.data.dtype == (torch.int8 if quantization is Quantization.INT8 else torch.float8_e4m3fn)
        assert quantized.scales.dtype == dtype and quantized.scales.shape == (out_features,)
        dequantized = quantized.dequantize()
        assert not dequantized[out_features // 2].any()
        if quantization is Quantization.INT8:
            # Round to nearest: within half a step of the original, the step being the row's (rounded) scale.
            half_step = quantized.scales.float()[:, None] / 2
            assert ((dequantized - weight).abs() <= half_step * (1 + 1e-6) + 1e-12).all()
        else:
            # e4m3 keeps 3 mantissa bits: within 2^-4 of each value (relative), or the subnormal step.
            floor = quantized.scales.float()[:, None] * 2.0**-9
            assert ((dequantized - weight).abs() <= (weight.abs() * 2.0**-4).clamp(min=floor) + 1e-12).all()
        x = torch.randn(2, rows, in_features, generator=generator).to(dtype)
        bias = torch.randn(out_features, generator=generator).to(dtype)
        expected = F.linear(x.float(), dequantized, bias.float())
        got = linear(x, quantized, bias)
        assert got.dtype == dtype and got.shape == (2, rows, out_features)
        tolerance = (1e-5 if dtype == torch.float32 else 2e-2) * expected.abs().max().item()
        torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=_name)
def test_rows_of_small_weights_keep_the_whole_int8_range_in_every_dtype(dtype: torch.dtype) -> None:
    """fp16 holds scales below its smallest normal number (6e-5) as subnormals: a row whose largest weight
    is 3e-4 gets its own scale, not one far too large, and stays within half a step; no weight is clipped."""
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(5, 4096, generator=generator)
    weight = weight / weight.abs().amax(dim=1, keepdim=True) * torch.tensor([0.1, 0.01, 2e-3, 3e-4, 0.0])[:, None]
    quantized = quantize_weight(weight, Quantization.INT8, dtype)
    maxima = weight.abs().amax(dim=1)[:4]
    scales = quantized.scales.float()[:4]
    assert (scales >= maxima / 127).all() and (scales <= maxima / 127 * 1.05).all(), scales * 127 / maxima
    assert (quantized.data[:4].abs().amax(dim=1) >= 120).all()  # each row spans (nearly) the whole range
    error = (quantized.dequantize() - weight).abs().amax(dim=1)[:4]
    assert (error <= scales / 2 * (1 + 1e-6)).all() and (error / maxima <= 0.0041).all(), error / maxima
    assert not quantized.dequantize()[4].any()


@pytest.mark.parametrize("quantization", list(Quantization), ids=_name)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_quantized_weights_take_a_fraction_of_the_bytes(tiny_model: Callable[..., str], quantization: Quantization,
                                                        dtype_name: str) -> None:
    path = tiny_model("llama")
    full = ModelRunner(path, dtype=dtype_name, num_blocks=8, model_impl="carpool")
    quantized = ModelRunner(path, dtype=dtype_name, num_blocks=8, model_impl="carpool",
                            quantization=quantization.value)
    layer = quantized.model.layers[0]  # type: ignore[attr-defined]
    assert all(isinstance(w, QuantizedWeight) for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    ratio = _linear_bytes(quantized) / _linear_bytes(full)
    # One byte per weight plus one scale per row: 0.51 of bf16, 0.26 of fp32 at the tiny model's widths.
    assert ratio <= MAX_BYTES_RATIO if dtype_name == "bfloat16" else ratio <= 0.3, ratio
    assert quantized.k_caches[0].dtype == full.dtype, "the KV cache stays in the model's dtype"
    assert quantized.model.lm_head.dtype == full.dtype  # type: ignore[attr-defined]


@pytest.mark.parametrize("quantization", list(Quantization), ids=_name)
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_stay_near_full_precision(tmp_path_factory: pytest.TempPathFactory, variant: str, dtype_name: str,
                                         quantization: Quantization) -> None:
    from worker.engine.default_model import create_tiny_model

    arch, overrides = VARIANTS[variant]
    path = str(create_tiny_model(tmp_path_factory.mktemp(variant) / "model", arch=arch, **overrides))
    rng = random.Random(3)
    batch = [StepSeq([rng.randrange(262) for _ in range(n)], 0, [2 * i, 2 * i + 1], True, f"s{i}")
             for i, n in enumerate([1, 6, 13, 16])]
    full = ModelRunner(path, dtype=dtype_name, block_size=8, num_blocks=8, model_impl="carpool")
    quantized = ModelRunner(path, dtype=dtype_name, block_size=8, num_blocks=8, model_impl="carpool",
                            quantization=quantization.value)
    expected, got = full.execute(batch), quantized.execute(batch)
    relative_error = (got - expected).abs().max().item() / expected.abs().max().item()
    assert 0 < relative_error <= LOGIT_TOLERANCES[quantization], relative_error


@pytest.mark.parametrize(("variant", "quantization"), [(v, Quantization.INT8) for v in sorted(VARIANTS)]
                         + [("llama-gqa", Quantization.FP8)], ids=_name)
def test_greedy_tokens_match_the_dequantized_reference_in_every_regime(
        tmp_path_factory: pytest.TempPathFactory, variant: str, quantization: Quantization) -> None:
    from worker.engine.default_model import create_tiny_model

    arch, overrides = VARIANTS[variant]
    path = str(create_tiny_model(tmp_path_factory.mktemp(variant) / "model", arch=arch, **overrides))
    prompts = _prompts(262)
    expected = _reference_greedy(path, quantization, prompts)
    assert expected != _reference_greedy(path, None, prompts), "quantization changes some prompts' tokens"
    assert_greedy_in_every_regime(path, prompts, GREEDY, expected, preemption_blocks=10,
                                  quantization=quantization.value)


def test_the_start_up_log_names_the_weights(tiny_model: Callable[..., str], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="worker.engine.model_runner"):
        ModelRunner(tiny_model("llama"), num_blocks=8, quantization="int8")
        ModelRunner(tiny_model("llama"), dtype="bfloat16", num_blocks=8)
    assert "carpool implementation (LlamaForCausalLM is in the Llama family), int8 weights" in caplog.text
    assert "bfloat16 weights" in caplog.text


def _hf_linear_bytes(runner: ModelRunner) -> tuple[int, int]:
    """(bytes of the layers' weights, linear or quantized, but the output projection; how many are quantized)."""
    model = runner.model.model  # type: ignore[attr-defined]
    output = model.get_output_embeddings()
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    plain = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not output]
    return sum(m.weight.nbytes for m in quantized) + sum(m.weight.nbytes for m in plain), len(quantized)


@pytest.mark.parametrize("quantization", list(Quantization), ids=_name)
@pytest.mark.parametrize("arch", ["phi", "llama"])
def test_the_transformers_path_holds_its_linear_layers_quantized(tiny_model: Callable[..., str], arch: str,
                                                                 quantization: Quantization) -> None:
    path = tiny_model(arch)
    full = ModelRunner(path, dtype="bfloat16", num_blocks=8, model_impl="transformers")
    quantized = ModelRunner(path, dtype="bfloat16", num_blocks=8, model_impl="transformers",
                            quantization=quantization.value)
    (full_bytes, none), (quantized_bytes, count) = _hf_linear_bytes(full), _hf_linear_bytes(quantized)
    assert none == 0 and count > 0
    assert quantized_bytes / full_bytes <= MAX_BYTES_RATIO, quantized_bytes / full_bytes
    output = quantized.model.model.get_output_embeddings()  # type: ignore[attr-defined]
    assert isinstance(output, torch.nn.Linear) and output.weight.dtype == torch.bfloat16, "the logits stay in dtype"
    assert quantized.k_caches[0].dtype == torch.bfloat16, "the KV cache stays in the model's dtype"
    rng = random.Random(5)
    batch = [StepSeq([rng.randrange(262) for _ in range(n)], 0, [2 * i, 2 * i + 1], True, f"s{i}")
             for i, n in enumerate([1, 6, 13, 16])]
    expected_logits, logits = full.execute(batch), quantized.execute(batch)
    relative_error = (logits - expected_logits).abs().max().item() / expected_logits.abs().max().item()
    assert 0 < relative_error <= LOGIT_TOLERANCES[quantization], relative_error

    # In fp32 the greedy tokens are those of transformers with the dequantized weights, over queueing and chunks.
    prompts = _prompts(262)
    expected = _reference_greedy(path, quantization, prompts)
    engine = Engine(model=path, model_impl="transformers", quantization=quantization.value, block_size=8,
                    num_blocks=128, max_num_seqs=3, max_num_batched_tokens=10)
    actual = [r.token_ids for r in engine.generate(prompts, GREEDY)]
    mismatched = [i for i, (e, a) in enumerate(zip(expected, actual, strict=True)) if e != a]
    assert not mismatched, f"prompts {mismatched} differ: {expected[mismatched[0]]} vs {actual[mismatched[0]]}"


def test_bad_settings_are_refused(tiny_model: Callable[..., str]) -> None:
    with pytest.raises(ValueError, match="quantization: must be one of int8, fp8"):
        ModelRunner(tiny_model("llama"), num_blocks=8, quantization="int4")
    with pytest.raises(ValueError, match="quantization: must be one of"):
        WorkerConfig.of(quantization="int4")
    assert WorkerConfig.of(quantization="fp8").engine.quantization == "fp8"


def test_fp8_is_refused_on_gpus_without_fp8() -> None:
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"fp8 weights need a GPU with fp8 support .* has 8.0"):
        check_device_supports(Quantization.FP8, cuda, capability=(8, 0))
    check_device_supports(Quantization.FP8, cuda, capability=(8, 9))
    check_device_supports(Quantization.INT8, cuda, capability=(7, 0))
    check_device_supports(Quantization.FP8, torch.device("cpu"))


def test_weights_held_outside_linear_layers_are_said_to_stay_unquantized(tmp_path, tiny_model: Callable[..., str],
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A mixture of experts whose transformers code holds its experts as fused tensors, not `nn.Linear` layers:
    those stay in the model's dtype, and the start-up log says so with their share of the weights, rather than
    calling the whole model int8; a model of linear layers alone says nothing of it."""
    from transformers import MixtralConfig

    from tests.harness.checkpoints import save_checkpoint, small_config

    moe = save_checkpoint(tmp_path / "mixtral", small_config(MixtralConfig, intermediate_size=64,
                                                             max_position_embeddings=64, num_local_experts=4,
                                                             num_key_value_heads=1))
    with caplog.at_level(logging.WARNING, logger="worker.engine.models"):
        ModelRunner(tiny_model("phi"), num_blocks=8, quantization="int8")
        assert not caplog.records, caplog.text
        ModelRunner(moe, num_blocks=8, quantization="int8")
    [said] = [r.getMessage() for r in caplog.records]
    assert said.startswith("quantization: MixtralForCausalLM holds ") and "MixtralExperts.gate_up_proj" in said, said
    assert said.endswith("which stay in float32, not int8"), said
