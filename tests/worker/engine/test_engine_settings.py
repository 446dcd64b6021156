"""Engine settings that cannot work are refused when the engine is built, with one ValueError naming the setting.

``carpool generate`` and ``carpool worker`` print that error as their one line; a setting that slipped past
would fail deep in tensor code, or worse, be taken as something else (a string ``"no"`` is truthy).
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

from scheduler.params import SamplingParams
from tests.harness.checkpoints import save_checkpoint, small_config
from tests.harness.child_env import child_pythonpath
from worker import Engine
from worker.engine.config import EngineConfig

ROOT = Path(__file__).resolve().parents[3]

BAD_SETTINGS: list[tuple[dict[str, Any], str]] = [
    ({"block_size": 4.5}, "block_size: must be an integer, got 4.5"),
    ({"max_num_seqs": 2.5}, "max_num_seqs: must be an integer"),
    ({"num_blocks": 10.5}, "num_blocks: must be an integer"),
    ({"max_num_batched_tokens": "64"}, "max_num_batched_tokens: must be an integer, got '64'"),
    ({"speculative": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens: must be an integer"),
    ({"block_size": True}, "block_size: must be an integer, got True"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching: must be true or false, got 'no'"),
    ({"async_scheduling": 1}, "async_scheduling: must be true or false"),
    ({"kv_cache_memory_gb": float("nan")}, "kv_cache_memory_gb: must be a positive number of GiB, got nan"),
    ({"kv_cache_memory_gb": float("inf")}, "kv_cache_memory_gb: must be a positive number of GiB, got inf"),
    ({"kv_cache_memory_gb": 0.0}, "kv_cache_memory_gb: must be a positive number of GiB"),
    ({"kv_cache_memory_gb": -1.0}, "kv_cache_memory_gb: must be a positive number of GiB"),
    ({"max_wait_ms": float("nan")}, "max_wait_ms: must be >= 0 and finite, got nan"),
    ({"max_wait_ms": float("inf")}, "max_wait_ms: must be >= 0 and finite, got inf"),
    ({"dtype": "int8"}, "dtype: must be one of float32, .* got 'int8'"),
    ({"attention_backend": "flash"}, "attention_backend: must be one of torch, triton or unset, got 'flash'"),
    ({"device": "tpu"}, "device: must be cpu, cuda or cuda:N, got 'tpu'"),
]


@pytest.mark.parametrize("settings,message", BAD_SETTINGS, ids=[str(s) for s, _ in BAD_SETTINGS])
def test_bad_settings_are_refused_by_the_config(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**settings)


def test_a_kv_budget_too_small_for_one_block_names_the_budget(tiny_model: Callable[..., str]) -> None:
    with pytest.raises(ValueError, match=r"kv_cache_memory_gb: 1e-07 GiB holds no KV-cache block; one takes \d+ "
                                         r"bytes at block_size 16"):
        Engine(model=tiny_model("llama"), kv_cache_memory_gb=1e-7)


def test_a_kv_cache_too_large_to_allocate_names_its_size_and_the_settings(tiny_model: Callable[..., str]) -> None:
    with pytest.raises(ValueError) as refused:
        Engine(model=tiny_model(), kv_cache_memory_gb=1e6)  # a petabyte: no machine's allocator gives it
    message = str(refused.value)
    assert message.startswith("num_blocks: a KV cache of ") and "GiB) cannot be allocated on cpu" in message
    assert "--num-blocks" in message and "--kv-cache-memory-gb" in message


def test_a_sliding_window_shorter_than_the_positions_is_the_context_and_says_so(tiny_model: Callable[..., str]) -> None:
    model = tiny_model("mistral", sliding_window=32)
    assert Engine(model=model, num_blocks=16).max_model_len == 32
    with pytest.raises(ValueError, match=r"max_model_len: 40 exceeds the model's context length 32 \(its sliding "
                                         r"window: the context is served up to the window\)"):
        Engine(model=model, num_blocks=16, max_model_len=40)


def test_a_checkpoint_saved_for_another_task_is_refused_by_its_head(tmp_path: Path) -> None:
    """transformers would load a masked-LM encoder under a causal head it never had and generate noise."""
    from transformers import BertConfig, BertForMaskedLM

    from worker.engine.default_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    BertForMaskedLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="^model: BertForMaskedLM is not a causal language model"):
        Engine(model=str(tmp_path), num_blocks=8)


def test_a_model_type_transformers_does_not_know_is_refused_as_the_model(tmp_path: Path) -> None:
    from worker.engine.default_model import build_tokenizer

    build_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "foobar", "architectures": ["FoobarForCausalLM"]}')
    with pytest.raises(ValueError, match="^model: cannot load a checkpoint from .*model type `foobar`") as refused:
        Engine(model=str(tmp_path), num_blocks=8)
    assert "pip install" not in str(refused.value)  # the first paragraph, not transformers' advice


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_on_a_machine_without_one_is_refused(tiny_model: Callable[..., str]) -> None:
    with pytest.raises(ValueError, match="device: cuda asked for, but torch sees no CUDA GPU here"):
        Engine(model=tiny_model("llama"), device="cuda")


def test_the_generate_verb_refuses_bad_settings_in_one_line(tiny_model: Callable[..., str]) -> None:
    env = {**os.environ, "PYTHONPATH": child_pythonpath(ROOT)}
    for flags, line in [
        (["--kv-cache-memory-gb", "nan"], "carpool generate: --kv-cache-memory-gb: must be a positive number of GiB, "
                                          "got nan"),
        (["--max-wait-ms", "inf"], "carpool generate: --max-wait-ms: must be >= 0 and finite, got inf"),
        (["--dtype", "int8"], "carpool generate: --dtype: must be one of float32, fp32, float16, fp16, half, "
                              "bfloat16, bf16, auto or unset, got 'int8'"),
        # Refused by the engine as it is built, and by the prompt that cannot fit: the same one line.
        (["--max-model-len", "100000"], "carpool generate: --max-model-len: 100000 exceeds the model's context "
                                        "length 2048 (its max_position_embeddings)"),
        (["--max-tokens", "5000"], "carpool generate: --max-tokens: prompt (3 tokens) + max_tokens (5000) exceeds "
                                   "max_model_len 2048 (set by the model's context, its max_position_embeddings)"),
        (["--max-tokens", "100", "--num-blocks", "4", "--block-size", "8"],
         "carpool generate: --max-tokens: prompt (3 tokens) + max_tokens (100) exceeds max_model_len 32 (set by the "
         "KV cache's 4 blocks of 8 tokens)"),
    ]:
        args = [sys.executable, "-m", "worker.cli", "generate", "hi", "--max-tokens", "2",
                "--model", tiny_model("llama"), *flags]
        done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert (done.returncode, done.stderr.strip()) == (2, line), done.stderr


def test_checkpoints_that_cannot_run_here_are_refused_at_start_in_one_line(tmp_path: Path) -> None:
    """Refused when the engine starts, each in one line naming the checkpoint's fault, rather than failing the
    first job (and stopping the worker) or printing a traceback."""
    from transformers import BloomConfig, FalconConfig, StableLmConfig, T5Config

    cases = [
        # Its transformers code takes carpool's attention but does not pass it what a step needs.
        (save_checkpoint(tmp_path / "stablelm",
                         small_config(StableLmConfig, intermediate_size=64, max_position_embeddings=64)),
         r"^model: StableLmForCausalLM from .* cannot run here \(transformers implementation\): ValueError: "
         r"StableLmAttention calls attention without the arguments .* this architecture is not supported$"),
        # Its transformers code looks attention up in a table of its own.
        (save_checkpoint(tmp_path / "falcon", small_config(FalconConfig, max_position_embeddings=64)),
         r"^model: cannot load FalconForCausalLM .*: its transformers code looks attention up .* not supported$"),
        # Its config names no context length (ALiBi).
        (save_checkpoint(tmp_path / "bloom", small_config(BloomConfig, n_layer=1, n_head=2)),
         r"^model: BloomForCausalLM's config names no context length"),
    ]
    t5 = tmp_path / "t5"
    t5.mkdir()
    (t5 / "config.json").write_text('{"model_type": "t5", "d_model": 32}')  # no architectures listed
    cases.append((str(t5), r"^model: a t5 model is not a causal language model"))
    for path, refusal in cases:
        with pytest.raises(ValueError, match=refusal) as refused:
            Engine(model=path, num_blocks=8)
        assert "\n" not in str(refused.value), refused.value


def test_a_truncated_weights_file_or_missing_tokenizer_is_the_models_fault_in_one_line(
        tmp_path: Path, tiny_model: Callable[..., str]) -> None:
    import shutil

    broken = tmp_path / "truncated"
    shutil.copytree(tiny_model(), broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"^model: cannot load LlamaForCausalLM .*SafetensorError") as refused:
        Engine(model=str(broken), num_blocks=8)
    assert "\n" not in str(refused.value)
    untokenized = tmp_path / "untokenized"
    shutil.copytree(tiny_model(), untokenized)
    for file in untokenized.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            file.unlink()
    with pytest.raises(ValueError, match=r"^model: no tokenizer in .*untokenized"):
        Engine(model=str(untokenized), num_blocks=8)
    # As a draft model, the same faults are the draft's.
    with pytest.raises(ValueError, match=r"^draft_model: no tokenizer in .*untokenized"):
        Engine(model=tiny_model(), num_blocks=8, speculative="draft", draft_model=str(untokenized),
               num_speculative_tokens=2)


def test_a_llama_carpools_own_model_cannot_run_falls_back_to_transformers(tmp_path: Path,
                                                                          tiny_model: Callable[..., str]) -> None:
    """`--model-impl auto` runs a Llama checkpoint that carpool's own model does not cover (MLP biases, weights
    in a .bin file) with transformers' code, instead of refusing it."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from worker.engine.config import ModelImpl

    biased = save_checkpoint(tmp_path / "biased", small_config(LlamaConfig, intermediate_size=64,
                                                               max_position_embeddings=64, num_key_value_heads=1,
                                                               mlp_bias=True))
    binary = tmp_path / "binary"
    binary.mkdir()
    torch.save(AutoModelForCausalLM.from_pretrained(tiny_model()).state_dict(), binary / "pytorch_model.bin")
    for file in Path(tiny_model()).iterdir():
        if not file.name.startswith("model"):
            (binary / file.name).write_bytes(file.read_bytes())
    for path in (biased, str(binary)):
        engine = Engine(model=path, num_blocks=8)
        assert engine.runner.model_choice.impl is ModelImpl.TRANSFORMERS, path
        (out,) = engine.generate(["hi"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        assert len(out.token_ids) == 3
