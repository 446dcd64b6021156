"""The paged forward gives the same logits as transformers' own forward over the whole sequence."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from worker.engine.model_runner import GIB, ModelRunner, StepSeq

ATOL = 1e-4


def _reference_last_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0, -1].float()


class PagedSequence:
    """A sequence driven by hand: the test plays the scheduler."""

    def __init__(self, prompt: list[int], block_table: list[int]) -> None:
        self.token_ids = list(prompt)
        self.num_computed = 0
        self.block_table = block_table

    def chunk(self, num_tokens: int) -> StepSeq:
        start = self.num_computed
        new = self.token_ids[start : start + num_tokens]
        self.num_computed += len(new)
        return StepSeq(new, start, self.block_table, needs_logits=self.num_computed == len(self.token_ids))


def _shuffled_tables(num_blocks: int, sizes: list[int], seed: int) -> list[list[int]]:
    blocks = list(range(num_blocks))
    random.Random(seed).shuffle(blocks)
    tables, start = [], 0
    for size in sizes:
        tables.append(blocks[start : start + size])
        start += size
    return tables


def _run_mixed_schedule(runner: ModelRunner, reference: torch.nn.Module, seed: int) -> int:
    """Chunked prefills mixed with decodes; every returned row checked against the reference.

    Returns how many logit rows were compared.
    """
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (11, 23, 6)]
    tables = _shuffled_tables(runner.num_blocks, [10, 10, 10], seed)
    seqs = [PagedSequence(p, t) for p, t in zip(prompts, tables)]
    a, b, c = seqs
    # (sequence, number of new tokens) per step; chunks are cut when the step runs.
    steps = [
        [(a, 5), (b, 9)],  # two first chunks, no logits yet
        [(b, 14), (a, 6)],  # both finish prefill, out of order
        [(a, 1), (c, 6), (b, 1)],  # a decodes, c's whole prompt, b decodes
        [(c, 1), (a, 1), (b, 1)],
        [(c, 1), (a, 1), (b, 1)],
        [(c, 1), (a, 1), (b, 1)],
    ]
    num_checked = 0
    for plan in steps:
        batch = [seq.chunk(n) for seq, n in plan]
        asking = [next(s for s in seqs if s.block_table is step.block_table) for step in batch if step.needs_logits]
        logits = runner.execute(batch)
        assert logits.dtype == torch.float32
        assert logits.shape == (len(asking), runner.vocab_size)
        for row, seq in zip(logits, asking):
            expected = _reference_last_logits(reference, seq.token_ids[: seq.num_computed])
            torch.testing.assert_close(row, expected, atol=ATOL, rtol=0)
            # Feed the greedy token back so the next step decodes it.
            seq.token_ids.append(int(row.argmax()))
            num_checked += 1
    return num_checked


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_paged_forward_matches_transformers(tiny_model, arch: str) -> None:
    path = tiny_model(arch)
    runner = ModelRunner(path, block_size=4, num_blocks=40)
    reference = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    assert _run_mixed_schedule(runner, reference, seed=1) == 2 + 3 + 3 * 3


def test_two_runners_in_one_process_are_independent(tiny_model) -> None:
    llama_path, qwen_path = tiny_model("llama"), tiny_model("qwen2")
    first = ModelRunner(llama_path, block_size=4, num_blocks=8)
    second = ModelRunner(qwen_path, block_size=8, num_blocks=4)
    prompt = [72, 101, 108, 108, 111]
    # Same block ids in both: each must use its own cache.
    first.execute([StepSeq(prompt, 0, [3, 1], needs_logits=True)])
    second.execute([StepSeq(prompt[::-1], 0, [3], needs_logits=True)])
    out_first = first.execute([StepSeq([33], 5, [3, 1], needs_logits=True)])[0]
    out_second = second.execute([StepSeq([33], 5, [3], needs_logits=True)])[0]
    llama = AutoModelForCausalLM.from_pretrained(llama_path, local_files_only=True)
    qwen = AutoModelForCausalLM.from_pretrained(qwen_path, local_files_only=True)
    torch.testing.assert_close(out_first, _reference_last_logits(llama, prompt + [33]), atol=ATOL, rtol=0)
    torch.testing.assert_close(out_second, _reference_last_logits(qwen, prompt[::-1] + [33]), atol=ATOL, rtol=0)


def test_attributes_and_cache_sizing(tiny_model) -> None:
    runner = ModelRunner(tiny_model("llama"), block_size=16, kv_cache_memory_gb=0.001)
    # 2 layers x (K and V) x 16 slots x 2 kv heads x 16 dims x 4 bytes.
    assert runner.block_bytes == 2 * 2 * 16 * 2 * 16 * 4
    assert runner.num_blocks == int(0.001 * GIB) // runner.block_bytes
    assert runner.k_caches[0].shape == (runner.num_blocks, 16, 2, 16)
    assert len(runner.v_caches) == 2
    assert runner.max_model_len == 2048
    assert runner.vocab_size == len(runner.tokenizer)
    assert runner.eos_token_ids == {runner.tokenizer.eos_token_id, runner.tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert (runner.device, runner.dtype, runner.backend.name) == (torch.device("cpu"), torch.float32, "torch")
    default = ModelRunner(tiny_model("llama"))
    # CPU default: capped at 16 full-length sequences.
    assert default.num_blocks == 16 * 2048 // 16


def test_context_limit_respects_a_sliding_window(tiny_model) -> None:
    runner = ModelRunner(tiny_model("mistral", sliding_window=64), num_blocks=4)
    assert runner.max_model_len == 64


def test_bad_inputs_raise_clear_errors(tiny_model, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model"):
        ModelRunner(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="dtype"):
        ModelRunner(tiny_model("llama"), dtype="float8")
    with pytest.raises(ValueError, match="backend"):
        ModelRunner(tiny_model("llama"), num_blocks=4, attention_backend="cuda-magic")


def test_bf16_runner_stays_close_to_fp32(tiny_model) -> None:
    path = tiny_model("llama")
    runner = ModelRunner(path, dtype="bfloat16", num_blocks=4)
    assert runner.dtype == torch.bfloat16 and runner.k_caches[0].dtype == torch.bfloat16
    prompt = list(b"paged attention")
    logits = runner.execute([StepSeq(prompt, 0, [2], needs_logits=True)])[0]
    reference = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    expected = _reference_last_logits(reference, prompt)
    assert (logits - expected).abs().max().item() < 0.25 * expected.abs().max().item()


def test_triton_backend_matches_torch_backend(tiny_model) -> None:
    # On CPU the conftest switches the Triton interpreter on before `kernels` is imported.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = tiny_model("qwen2")
    runners = [
        ModelRunner(path, device=device, block_size=4, num_blocks=16, attention_backend=name)
        for name in ("torch", "triton")
    ]
    assert [runner.backend.name for runner in runners] == ["torch", "triton"]
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (9, 5)]
    tables = [[7, 2, 11], [0, 15]]
    prefill = [StepSeq(p, 0, t, needs_logits=True) for p, t in zip(prompts, tables)]
    decode = [StepSeq([42], len(p), t, needs_logits=True) for p, t in zip(prompts, tables)]
    for batch in (prefill, decode):
        expected, got = (runner.execute(batch) for runner in runners)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_a_checkpoint_whose_configs_name_no_eos_stops_at_its_tokenizers(tiny_model, tmp_path: Path) -> None:
    """No EOS in config.json and no generation_config.json: the tokenizer's EOS ends generation, as a serving user
    expects, instead of every answer running to its length."""
    from tests.harness.checkpoints import edited_copy

    path = edited_copy(tiny_model("llama"), tmp_path / "no-eos", config=lambda c: c.update(eos_token_id=None))
    (Path(path) / "generation_config.json").unlink()
    runner = ModelRunner(path, block_size=16, kv_cache_memory_gb=0.001)
    assert runner.eos_token_ids == {runner.tokenizer.eos_token_id} and runner.tokenizer.eos_token_id is not None
