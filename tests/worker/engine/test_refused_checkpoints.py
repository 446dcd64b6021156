"""Checkpoints carpool would serve wrong are refused when the engine starts, in one line naming the fault.

Each of these once loaded and then generated the wrong tokens without a word, or crashed the engine at its
first job; each is a real checkpoint built in the test and loaded from disk.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness.checkpoints import edited_copy, save_checkpoint, small_config
from tests.harness.child_env import child_pythonpath
from worker import Engine

ROOT = Path(__file__).resolve().parents[3]


def _refusal(path: str, **settings: Any) -> str:
    with pytest.raises(ValueError) as refused:
        Engine(model=path, num_blocks=8, **settings)
    message = str(refused.value)
    assert "\n" not in message, message
    return message


def test_attention_the_paged_kernels_do_not_compute_is_refused(tmp_path: Path) -> None:
    """Gemma 2's logit soft-capping and GPT-OSS's attention sinks reach carpool's attention as arguments it does
    not apply: served, they would give other tokens than the model's own attention."""
    from transformers import Gemma2Config, GptOssConfig

    gemma2 = save_checkpoint(tmp_path / "gemma2", small_config(
        Gemma2Config, intermediate_size=64, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
        attn_logit_softcapping=50.0))
    message = _refusal(gemma2)
    assert message.startswith("model: Gemma2ForCausalLM from "), message
    assert message.endswith("(transformers implementation): ValueError: Gemma2Attention asks for attention that "
                            "carpool's paged attention does not compute (softcap=50.0 (attention logit "
                            "soft-capping)): this architecture is not supported"), message
    gpt_oss = save_checkpoint(tmp_path / "gpt_oss", small_config(
        GptOssConfig, intermediate_size=32, num_key_value_heads=1, head_dim=16, num_local_experts=2,
        num_experts_per_tok=1, max_position_embeddings=64))
    assert "GptOssAttention asks for attention that carpool's paged attention does not compute (s_aux (attention " \
           "sinks))" in _refusal(gpt_oss)


def _fp8_blocks(weights: dict[str, torch.Tensor]) -> None:
    """The layer matrices as a block-quantized FP8 checkpoint keeps them: e4m3 values and a scale per 128x128."""
    for name in [n for n in weights if n.startswith("model.layers.") and n.endswith("proj.weight")]:
        weight = weights[name]
        scale = weight.abs().max() / 448.0
        weights[name] = (weight / scale).to(torch.float8_e4m3fn)
        weights[name.replace(".weight", ".weight_scale_inv")] = torch.full(
            ((weight.shape[0] + 127) // 128, (weight.shape[1] + 127) // 128), float(scale))


def test_a_pre_quantized_checkpoint_is_refused_naming_its_quant_method(tiny_model: Callable[..., str],
                                                                       tmp_path: Path) -> None:
    """Its scales and packed integers are no weights carpool reads: FP8 ones were cast without their scales (noise),
    GPTQ ones failed on a missing tensor."""
    def quantized(method: str) -> Callable[[dict[str, Any]], None]:
        return lambda config: config.update(quantization_config={"quant_method": method, "bits": 4})

    fp8 = edited_copy(tiny_model(), tmp_path / "fp8", config=quantized("fp8"), weights=_fp8_blocks)
    gptq = edited_copy(tiny_model(), tmp_path / "gptq", config=quantized("gptq"))
    for path, method in [(fp8, "fp8"), (gptq, "gptq")]:
        for impl in ("auto", "transformers"):
            assert _refusal(path, model_impl=impl) == (
                f"model: LlamaForCausalLM's weights are pre-quantized (quantization_config.quant_method {method}); "
                "carpool loads unquantized checkpoints (fp32, fp16 or bf16 weights) and quantizes them itself with "
                "--quantization int8|fp8")
    done = subprocess.run([sys.executable, "-m", "worker.cli", "generate", "hi", "--max-tokens", "2", "--model", fp8],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": child_pythonpath(ROOT)}, capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stderr.strip()) == (2, "carpool generate: --model: LlamaForCausalLM's weights are "
                                                         "pre-quantized (quantization_config.quant_method fp8); "
                                                         "carpool loads unquantized checkpoints (fp32, fp16 or bf16 "
                                                         "weights) and quantizes them itself with --quantization "
                                                         "int8|fp8"), done.stderr


def test_weights_whose_shapes_the_config_does_not_imply_are_refused_naming_tensor_and_fields(
        tiny_model: Callable[..., str], tmp_path: Path) -> None:
    """carpool's own model checks every tensor against its config before fusing any: a short matrix, or a config
    field left out and so taken at transformers' default, failed deep in a kernel or crashed the first job."""
    def short_q(weights: dict[str, torch.Tensor]) -> None:
        name = "model.layers.0.self_attn.q_proj.weight"
        weights[name] = weights[name][:32].contiguous()

    def without(field: str) -> Callable[[dict[str, Any]], None]:
        return lambda config: config.pop(field)

    cases = [
        (edited_copy(tiny_model(), tmp_path / "short_q", weights=short_q),
         "model: layers.0.self_attn.q_proj.weight has shape [32, 64] where the config implies [64, 64] "
         "(num_attention_heads 4 x head_dim 16, hidden_size 64)"),
        (edited_copy(tiny_model(), tmp_path / "no_heads", config=without("num_attention_heads")),
         "model: layers.0.self_attn.q_proj.weight has shape [64, 64] where the config implies [512, 64] "
         "(num_attention_heads 32 x head_dim 16, hidden_size 64)"),
        # transformers' default vocab_size, 32000, where the embedding has the tokenizer's 262 rows: the first
        # job's logits were narrower than the sampler's rows, and the engine crashed.
        (edited_copy(tiny_model(), tmp_path / "no_vocab", config=without("vocab_size")),
         "model: embed_tokens.weight has shape [262, 64] where the config implies [32000, 64] "
         "(vocab_size 32000, hidden_size 64)"),
    ]
    for path, refusal in cases:
        assert _refusal(path) == refusal


def test_a_missing_lm_head_is_refused_unless_the_config_ties_it(tiny_model: Callable[..., str],
                                                               tmp_path: Path) -> None:
    """Without `tie_word_embeddings` an absent lm_head was taken for the embedding table: other logits than the
    model's, without a word."""
    from scheduler.params import SamplingParams

    def no_lm_head(weights: dict[str, torch.Tensor]) -> None:
        del weights["lm_head.weight"]

    untied = edited_copy(tiny_model(), tmp_path / "untied", weights=no_lm_head)
    assert _refusal(untied) == ("model: the checkpoint has no lm_head.weight, which its config implies (vocab_size "
                                "262, hidden_size 64; tie_word_embeddings false)")
    tied = edited_copy(untied, tmp_path / "tied", config=lambda config: config.update(tie_word_embeddings=True))
    (out,) = Engine(model=tied, num_blocks=8).generate(["hi"], SamplingParams(max_tokens=3, temperature=0,
                                                                               ignore_eos=True))
    assert len(out.token_ids) == 3
