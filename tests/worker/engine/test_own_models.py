"""carpool's own Llama-family models against transformers: logits at per-dtype tolerances, greedy tokens exactly.

Each variant is a tiny checkpoint built here: GQA and MQA, tied and untied
embeddings, every RoPE scaling type the family ships, Qwen2's biases,
Qwen3's q/k norms, Mistral's sliding window. Greedy tokens are compared in
the engine's regimes: queueing for slots, chunked prefill, preemption and
prefix-cache hits.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from scheduler import SamplingParams
from tests.harness.model_reference import assert_greedy_in_every_regime, transformers_greedy
from worker import Engine
from worker.engine.default_model import create_tiny_model
from worker.engine.model_runner import ModelRunner, StepSeq
from worker.engine.models import ModelImpl, choose_model_impl

MAX_NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
# Small original contexts, so the prompts plus outputs below cross them and the scaled RoPE types act.
ORIGINAL_CONTEXT = 32
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("llama", {}),
    "llama-mqa-tied": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "llama-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-dynamic": ("llama", {"max_position_embeddings": ORIGINAL_CONTEXT,
                                "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "llama3": ("llama", {"max_position_embeddings": 4 * ORIGINAL_CONTEXT, "rope_scaling": {
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL_CONTEXT}}),
    "llama-yarn": ("llama", {"max_position_embeddings": 4 * ORIGINAL_CONTEXT, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT}}),
    "qwen2-bias-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 32}),
    "mistral-window": ("mistral", {"sliding_window": 64}),
}
# Relative to the largest logit. fp32 differs from transformers only in summation order (fused matrices);
# bf16 rounds every product (on this CPU both paths round alike and agree exactly).
LOGIT_TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _checkpoint(tmp_path_factory: pytest.TempPathFactory, variant: str) -> str:
    arch, overrides = VARIANTS[variant]
    overrides = {**overrides}
    if "rope_scaling" in overrides:
        overrides["rope_scaling"] = dict(overrides["rope_scaling"])
    return str(create_tiny_model(tmp_path_factory.mktemp(variant) / "model", arch=arch, **overrides))


def _prompts(vocab_size: int, max_len: int) -> list[list[int]]:
    rng = random.Random(7)
    lengths = [1, 3, 8, 9, 17, max_len, rng.randint(2, max_len), rng.randint(2, max_len)]
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]
    shared = [rng.randrange(vocab_size) for _ in range(16)]
    prompts += [shared + [rng.randrange(vocab_size) for _ in range(i)] for i in range(4)]
    return prompts


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_tokens_match_transformers_in_every_regime(tmp_path_factory: pytest.TempPathFactory,
                                                          variant: str) -> None:
    path = _checkpoint(tmp_path_factory, variant)
    # Prompts plus outputs reach past the small original contexts (the scaled RoPE types act there). Dynamic
    # RoPE scales each token for its own position, as transformers does for a decode step; transformers scales
    # a longer prompt as a whole for its length (docs/internals.md), so its prompts stay within the original.
    longest = ORIGINAL_CONTEXT if variant == "llama-dynamic" else 2 * ORIGINAL_CONTEXT - MAX_NEW_TOKENS
    prompts = _prompts(262, longest)
    expected = transformers_greedy(path, prompts, MAX_NEW_TOKENS)
    assert_greedy_in_every_regime(path, prompts, GREEDY, expected, preemption_blocks=14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant", ["llama-gqa", "llama-mqa-tied", "qwen2-bias-tied", "qwen3-qk-norm", "llama-yarn"])
def test_logits_match_transformers(tmp_path_factory: pytest.TempPathFactory, variant: str,
                                   dtype: torch.dtype) -> None:
    path = _checkpoint(tmp_path_factory, variant)
    dtype_name = "float32" if dtype == torch.float32 else "bfloat16"
    runner = ModelRunner(path, dtype=dtype_name, block_size=8, num_blocks=16, model_impl="carpool")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    tokens = [random.Random(3).randrange(262) for _ in range(21)]
    table = [4, 9, 1]
    with torch.inference_mode():
        expected = reference(torch.tensor([tokens])).logits[0].float()
    got = runner.execute([StepSeq(tokens[:20], 0, table, True, "a")])[0]
    tolerance = LOGIT_TOLERANCES[dtype] * expected[19].abs().max().item()
    torch.testing.assert_close(got, expected[19], atol=tolerance, rtol=0)
    got = runner.execute([StepSeq(tokens[20:], 20, table, True, "a")])[0]
    torch.testing.assert_close(got, expected[20], atol=tolerance, rtol=0)


def test_auto_picks_by_architecture_and_says_so(tiny_model: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="worker.engine.model_runner"):
        llama = ModelRunner(tiny_model("llama"), num_blocks=8)
        phi = ModelRunner(tiny_model("phi"), num_blocks=8)
    assert llama.model_choice.impl is ModelImpl.CARPOOL
    assert phi.model_choice.impl is ModelImpl.TRANSFORMERS
    assert "carpool implementation (LlamaForCausalLM is in the Llama family)" in caplog.text
    assert "transformers implementation (not among carpool's own models: this model is PhiForCausalLM)" in caplog.text
    forced = ModelRunner(tiny_model("llama"), num_blocks=8, model_impl="transformers")
    assert forced.model_choice.impl is ModelImpl.TRANSFORMERS
    with pytest.raises(ValueError, match="model_impl: carpool's models cover .*; this model is PhiForCausalLM$"):
        ModelRunner(tiny_model("phi"), num_blocks=8, model_impl="carpool")
    with pytest.raises(ValueError, match="; this LlamaForCausalLM uses gelu, not SiLU$"):
        ModelRunner(tiny_model("llama", hidden_act="gelu"), num_blocks=8, model_impl="carpool")
    with pytest.raises(ValueError, match="model_impl: must be one of"):
        choose_model_impl(llama.config, "fastest")


def test_transformers_path_still_matches_for_the_family(tiny_model: Any, tmp_path: Path) -> None:
    path = tiny_model("qwen2")
    prompts = _prompts(262, 40)[:6]
    expected = transformers_greedy(path, prompts, MAX_NEW_TOKENS)
    engine = Engine(model=path, block_size=8, num_blocks=64, max_num_seqs=4, model_impl="transformers")
    assert [r.token_ids for r in engine.generate(prompts, GREEDY)] == expected


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen3-qk-norm"])
def test_fused_kernels_give_the_same_logits_and_tokens(tmp_path_factory: pytest.TempPathFactory, variant: str) -> None:
    """The CUDA path's kernels (fused add + RMSNorm, SiLU-and-multiply, RoPE with the KV write), run here under
    Triton's interpreter, against transformers."""
    path = _checkpoint(tmp_path_factory, variant)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernels = ModelRunner(path, device=device, block_size=8, num_blocks=16, model_impl="carpool", model_kernels=True)
    assert kernels.model.use_kernels, "the kernels passed their start-up check"  # type: ignore[attr-defined]
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = [random.Random(5).randrange(262) for _ in range(13)]
    expected_tokens = transformers_greedy(path, [tokens], MAX_NEW_TOKENS)[0]
    with torch.inference_mode():
        expected = reference(torch.tensor([tokens])).logits[0, -1].float()
    table = [6, 2, 11]
    logits = kernels.execute([StepSeq(tokens, 0, table, True, "a")])[0].cpu()
    torch.testing.assert_close(logits, expected, atol=LOGIT_TOLERANCES[torch.float32] * expected.abs().max().item(),
                               rtol=0)
    generated = [int(logits.argmax())]
    while len(generated) < MAX_NEW_TOKENS:
        position = len(tokens) + len(generated) - 1
        generated.append(int(kernels.execute([StepSeq([generated[-1]], position, table, True, "a")])[0].argmax()))
    assert generated == expected_tokens


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias-tied"])
def test_the_matmul_kernel_gives_the_same_logits_and_tokens(tmp_path_factory: pytest.TempPathFactory,
                                                            monkeypatch: pytest.MonkeyPatch, variant: str) -> None:
    """Every decode-sized product of an fp16 model through the matmul kernel, the down projections reading their
    activation in, as a timed choice on a GPU may send them (run here under Triton's interpreter), against the
    same model's torch products and activation kernel; Qwen2's q/k/v biases added inside the kernel. (fp16: the
    interpreter rounds fp32 to bf16 by truncation, which a GPU does not.)"""
    from kernels.decode_matmul import candidate_plans
    from worker.engine.models import quantization
    from worker.engine.models.matmul_choice import ROW_BUCKETS, MatmulChoices

    path = _checkpoint(tmp_path_factory, variant)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Eager steps: graphs recorded now would replay torch's products after the plans below are set.
    runner = ModelRunner(path, device=device, dtype="float16", block_size=8, num_blocks=16, model_impl="carpool",
                         model_kernels=True, matmul_tuning=False, cuda_graphs=False)
    model = runner.model
    assert model.matmuls is None, "not quantized and not timed: torch's products"  # type: ignore[attr-defined]
    kinds = list(model._matrix_groups())  # type: ignore[attr-defined]
    assert len(kinds) == 5, "qkv, o, gate_up, down and lm_head"
    # The last candidate of each: another block shape than the default; the down projection reads its
    # activation in.
    plans = {(bucket, kind): candidate_plans(bucket, kind[0], kind[1], 0)[-1] for bucket in ROW_BUCKETS
             for kind in kinds}
    down_kind = (model.config.hidden_size, model.config.intermediate_size, torch.float16)  # type: ignore[attr-defined]
    gated = {(bucket, kind): plan for (bucket, kind), plan in plans.items() if kind == down_kind}
    assert len(gated) == len(ROW_BUCKETS)
    tokens = [random.Random(7).randrange(262) for _ in range(13)]
    table = [6, 2, 11]
    rows: list[int] = []
    num_gated: list[int] = []
    kernel = quantization.decode_matmul

    def counted(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, plan: Any,
                gated: bool = False, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows.append(x.shape[0])
        num_gated.append(gated)
        return kernel(x, weight, scales, plan, gated, bias)

    monkeypatch.setattr(quantization, "decode_matmul", counted)

    def greedy() -> tuple[torch.Tensor, list[int]]:
        logits = runner.execute([StepSeq(tokens, 0, table, True, "a")])[0].float().cpu()
        generated = [int(logits.argmax())]
        while len(generated) < 6:
            step = [StepSeq([generated[-1]], len(tokens) + len(generated) - 1, table, True, "a")]
            generated.append(int(runner.execute(step)[0].argmax()))
        return logits, generated

    expected_logits, expected_tokens = greedy()
    assert rows == []
    model.matmuls = MatmulChoices(0, plans, gated)  # type: ignore[attr-defined]
    logits, generated = greedy()
    num_layers = len(model.layers)  # type: ignore[attr-defined]
    assert rows == [13] * 4 * num_layers + [1] + [1] * (4 * num_layers + 1) * 5, "every product ran the kernel"
    assert sum(num_gated) == num_layers * 6, "each down projection read its activation in, each of the 6 steps"
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-3 * expected_logits.abs().max().item())
    assert generated == expected_tokens
