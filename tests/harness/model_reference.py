"""The reference the engine's greedy outputs are held to: transformers' `generate`, one prompt at a time, and
the check that holds carpool's own models to a reference in each of the engine's regimes."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM

from scheduler import SamplingParams


def transformers_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy tokens of each prompt alone, without padding; EOS off, so each runs to `max_new_tokens`."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def assert_greedy_in_every_regime(path: str, prompts: list[list[int]], params: SamplingParams,
                                  expected: list[list[int]], *, preemption_blocks: int, **engine_settings: Any) -> None:
    """carpool's own model (``model_impl="carpool"``) gives ``expected`` in each of the engine's regimes:
    queueing for slots, chunked prefill, preemption (``preemption_blocks`` KV blocks of 8 tokens for all the
    prompts at once) and prefix-cache hits; ``engine_settings`` (a quantization, say) go to every engine."""
    from worker import Engine
    from worker.engine.models import ModelImpl

    regimes: dict[str, dict[str, Any]] = {
        "queueing": {"max_num_seqs": 3, "enable_prefix_caching": False},
        "chunked prefill": {"max_num_batched_tokens": 10},
        "preemption": {"num_blocks": preemption_blocks, "max_num_seqs": len(prompts)},
        "prefix hits": {"max_num_seqs": 2},
    }
    for regime, settings in regimes.items():
        engine = Engine(model=path, model_impl="carpool", **{"block_size": 8, "num_blocks": 128,
                                                                **engine_settings, **settings})
        assert engine.runner.model_choice.impl is ModelImpl.CARPOOL
        actual = [r.token_ids for r in engine.generate(prompts, params)]
        mismatched = [i for i, (e, a) in enumerate(zip(expected, actual, strict=True)) if e != a]
        assert not mismatched, f"{regime}: prompts {mismatched} differ: {expected[mismatched[0]]} vs {actual[mismatched[0]]}"
        stats = engine.stats()
        if regime == "preemption":
            assert stats.num_preemptions > 0
        if regime == "prefix hits":
            assert stats.prefix_cache_hit_tokens > 0
