"""The reference the engine's greedy outputs are held to: transformers' `generate`, one prompt at a time."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


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
