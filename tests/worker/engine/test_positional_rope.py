"""Dynamic and LongRoPE through transformers' code: a job's tokens follow its own positions, not its batch's.

transformers computes these frequencies from the largest position of its call; carpool calls the model once
per step over every sequence, so without `worker.engine.models.positional_rope` one sequence past the
original context would change every other sequence's frequencies, and its tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from scheduler.params import SamplingParams
from worker import Engine

ORIGINAL = 32
"""The checkpoints' original context: the long prompt passes it, the short one stays inside."""


def _checkpoint(path: Path, kind: str) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config

    from worker.engine.default_model import TINY_INITIALIZER_RANGE, build_tokenizer

    tokenizer = build_tokenizer()
    shape: dict[str, Any] = {"vocab_size": len(tokenizer), "hidden_size": 32, "num_hidden_layers": 2,
                             "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64,
                             "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                             "eos_token_id": tokenizer.eos_token_id,
                             # Weights large enough that attention, and so the positions, decide the tokens.
                             "initializer_range": TINY_INITIALIZER_RANGE}
    if kind == "dynamic":
        config = LlamaConfig(**shape, max_position_embeddings=ORIGINAL,
                             rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    else:
        rotary = shape["hidden_size"] // shape["num_attention_heads"] // 2
        config = Phi3Config(**shape, max_position_embeddings=4 * ORIGINAL, original_max_position_embeddings=ORIGINAL,
                            rope_scaling={"type": "longrope", "short_factor": [1.0] * rotary,
                                          "long_factor": [4.0 + i for i in range(rotary)]})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_a_jobs_tokens_do_not_follow_a_long_sequence_in_its_batch(tmp_path: Path, kind: str) -> None:
    from transformers import AutoModelForCausalLM

    path = _checkpoint(tmp_path / kind, kind)
    engine = Engine(model=path, model_impl="transformers", num_blocks=64, block_size=4)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    # The long prompt shares no prefix with the short one: each computes its own KV in the batched step.
    short, long = list(range(10, 20)), [100 + i % 150 for i in range(ORIGINAL + 20)]
    alone = engine.generate([short], params)[0].token_ids
    beside_long = engine.generate([short, long], params)[0].token_ids
    assert beside_long == alone
    # Inside the original context, each token's own frequencies are transformers' for the sequence alone.
    model = AutoModelForCausalLM.from_pretrained(path)
    expected = model.generate(torch.tensor([short]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert alone == expected[0, len(short):].tolist()
