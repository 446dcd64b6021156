"""Greedy exactness with the Triton attention backend: compiled on a CUDA GPU, else under the interpreter on CPU.

A handful of requests through the whole engine — a long prompt prefilled in
chunks, prompts sharing a cached prefix — must give transformers' greedy tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM

from tests.worker.engine.test_engine_exact import BLOCK_SIZE, GREEDY, MAX_NEW_TOKENS, assert_same, make_prompts
from worker import Engine

# The interpreter runs the kernels on CPU tensors; with a GPU they are compiled, and need CUDA tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_triton_backend_is_token_exact_with_chunked_prefill_and_prefix_hits(tiny_model: Callable[..., str]) -> None:
    path = tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE)
    model.eval()
    model.generation_config.eos_token_id = None
    prompts = make_prompts(model.config.vocab_size)
    # The longest prompt (5 blocks + 3) and three prompts sharing a 3-block prefix.
    chosen = [prompts[5], prompts[16 + 3], prompts[16 + 7], prompts[16 + 10]]
    expected = []
    with torch.inference_mode():
        for prompt in chosen:
            ids = torch.tensor([prompt], device=DEVICE)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
            expected.append(out[0, len(prompt):].tolist())

    budget = 2 * BLOCK_SIZE
    assert len(chosen[0]) > budget, "the long prompt must be chunked"
    engine = Engine(model=path, block_size=BLOCK_SIZE, num_blocks=64, max_num_seqs=2,
                    max_num_batched_tokens=budget, attention_backend="triton", device=DEVICE)
    assert engine.runner.backend.name == "triton"
    results = engine.generate(chosen, GREEDY)
    assert_same(expected, [r.token_ids for r in results])
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens >= 2 * 3 * BLOCK_SIZE, "the later shared-prefix prompts hit the cache"
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
