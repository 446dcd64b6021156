"""The repetitive workload: prompts whose greedy continuation copies spans of the prompt.

Random-weight models do not copy: their greedy output wanders, so prompt
lookup would find nothing to propose. ``make_cycling_model`` therefore
rewrites a checkpoint's token embeddings and output head (and nothing else)
so that the model's greedy next token is the successor of the current token
in fixed cycles over the printable byte ids: scaled up, the embedding
dominates the residual stream, and each head row points at its predecessor's
embedding. Every layer still runs with its random weights, so a step costs
what the original model's does. ``repetitive`` prompts are spans of those
cycles longer than a cycle, so from the first output token the greedy
continuation repeats spans the prompt already holds: the case prompt lookup
is for (edits, extraction, quoting summaries), at its most predictable.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch

from bench.workloads import PRINTABLE_IDS, BenchRequest, Workload

CYCLE_LEN = 24
EMBEDDING_SCALE = 1000.0
HEAD_STRENGTH = 4.0


def successors(seed: int = 0, cycle_len: int = CYCLE_LEN) -> dict[int, int]:
    """The cycles: each printable id's successor."""
    ids = list(range(*PRINTABLE_IDS))
    random.Random(seed).shuffle(ids)
    nxt: dict[int, int] = {}
    for start in range(0, len(ids), cycle_len):
        cycle = ids[start:start + cycle_len]
        nxt.update(zip(cycle, cycle[1:] + cycle[:1]))
    return nxt


def make_cycling_model(source: str | Path, path: str | Path, seed: int = 0,
                       successor_of: dict[int, int] | None = None) -> Path:
    """A copy of the checkpoint at ``source`` whose greedy continuation follows ``successor_of`` (default:
    ``successors(seed)``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
        assert isinstance(inputs, torch.nn.Embedding) and isinstance(outputs, torch.nn.Linear)
        if model.config.tie_word_embeddings:  # the head is rewritten apart from the embedding
            model.config.tie_word_embeddings = False
            outputs.weight = torch.nn.Parameter(inputs.weight.clone())
        embedding, head = inputs.weight, outputs.weight
        embedding.mul_(EMBEDDING_SCALE)
        for token, successor in (successor_of or successors(seed)).items():
            head[successor] += HEAD_STRENGTH * embedding[token] / embedding[token].norm()
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    generation_config = Path(source) / "generation_config.json"
    if generation_config.exists():
        shutil.copy(generation_config, path / "generation_config.json")
    return path


def repetitive(num_requests: int, seed: int = 0, max_tokens: int = 200, prompt_len: int = 48) -> Workload:
    """Prompts that are spans of the cycles (each longer than a cycle), greedy, ``max_tokens`` each."""
    rng = random.Random(seed)
    nxt = successors(seed)
    requests = []
    for _ in range(num_requests):
        token = rng.randrange(*PRINTABLE_IDS)
        prompt = [token]
        while len(prompt) < prompt_len:
            prompt.append(nxt[prompt[-1]])
        requests.append(BenchRequest(prompt, max_tokens, temperature=0.0))
    return Workload("repetitive", requests)
