"""Checkpoints carpool would serve wrong are refused when the engine starts, in one line naming the fault.

Each of these once loaded and then generated the wrong tokens without a word, or crashed the engine at its
first job; each is a real checkpoint built in the test and loaded from disk.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.checkpoints import save_checkpoint, small_config
from worker import Engine


def _refusal(path: str, **settings: object) -> str:
    with pytest.raises(ValueError) as refused:
        Engine(model=path, num_blocks=8, **settings)  # type: ignore[arg-type]
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
