"""Greedy exactness with the Triton attention backend: compiled on a CUDA GPU, else under the interpreter on CPU.

A handful of requests through the whole engine — a long prompt prefilled in
chunks, prompts sharing a cached prefix — must give transformers' greedy tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.harness.child_env import child_pythonpath
from tests.worker.engine.test_engine_exact import BLOCK_SIZE, GREEDY, MAX_NEW_TOKENS, assert_same, make_prompts
from worker import Engine

# The interpreter runs the kernels on CPU tensors; with a GPU they are compiled, and need CUDA tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[3]


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


def test_a_worker_with_triton_on_a_cpu_is_refused_at_start_up(tiny_model: Callable[..., str]) -> None:
    """Compiled (not interpreted), the Triton kernels cannot take CPU tensors: the worker says so in one line and
    exits before it takes a job, rather than serving until its first step fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = child_pythonpath(ROOT)
    # Nothing listens on the Redis URL: the engine is started, and refused, before Redis is reached.
    model = tiny_model("llama")
    args = [sys.executable, "-m", "worker.cli", "worker", "--redis-url", "redis://127.0.0.1:1/0",
            "--model", model, "--device", "cpu", "--attention-backend", "triton",
            "--metrics-port", "0", "--no-engine-process"]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("carpool worker:")]
    assert lines == [
        f"carpool worker: cannot start the engine on {model}: ValueError: attention_backend: the Triton kernels "
        "were compiled "
        "for CUDA and cannot run on cpu; use the torch backend there (or set TRITON_INTERPRET=1 to interpret them)"
    ], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels are compiled; the test needs the "
                    "interpreter")
def test_interpreted_triton_on_a_cpu_is_accepted(tiny_model: Callable[..., str]) -> None:
    engine = Engine(model=tiny_model("llama"), num_blocks=8, attention_backend="triton", device="cpu")
    assert engine.runner.backend.name == "triton"
