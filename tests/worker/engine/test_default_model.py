"""Locally built checkpoints: deterministic, loadable by path, with a lossless byte-level tokenizer."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker.engine.default_model import (
    DEFAULT_MODEL_NAME,
    build_tokenizer,
    create_tiny_model,
    default_model_path,
    models_cache_dir,
)


def _files_digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def test_same_seed_gives_identical_files_and_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    first = create_tiny_model(tmp_path / "a", arch="qwen2", seed=5)
    second = create_tiny_model(tmp_path / "b", arch="qwen2", seed=5)
    other = create_tiny_model(tmp_path / "c", arch="qwen2", seed=6)
    assert torch.equal(torch.rand(3), expected_draw)
    digest = _files_digest(first)
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(digest)
    assert digest == _files_digest(second)
    assert digest["model.safetensors"] != _files_digest(other)["model.safetensors"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_loads_by_path_with_auto_classes(tiny_model, arch: str) -> None:
    path = tiny_model(arch)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert model.config.model_type == arch
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA is exercised
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == [
        tokenizer.eos_token_id,
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ]
    if arch == "mistral":
        assert model.config.sliding_window is None
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    ids = tokenizer("hello").input_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))
    # Spread-out logits keep greedy decoding away from near-ties.
    assert logits.std().item() > 0.5


def test_tokenizer_round_trips_arbitrary_utf8() -> None:
    tokenizer = build_tokenizer()
    rng = random.Random(0)
    samples = ["", " leading and  double spaces ", "tabs\tand\nnewlines\r\n", "emoji 😀🚀👩‍👩‍👧", "漢字かなカナ한국어", "é ü ß ø"]
    samples += ["".join(chr(rng.choice([rng.randrange(32, 0xD7FF), rng.randrange(0x10000, 0x10FFFF)])) for _ in range(40)) for _ in range(20)]
    for text in samples:
        ids = tokenizer(text).input_ids
        assert ids[0] == tokenizer.bos_token_id
        assert len(ids) == 1 + len(text.encode("utf-8"))
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_saved_tokenizer_round_trips_after_loading(tiny_model, arch: str) -> None:
    # Precomposed text only: transformers loads qwen2 tokenizers with its Qwen2
    # pipeline, which NFC-normalises (as real Qwen2 checkpoints do).
    tokenizer = AutoTokenizer.from_pretrained(tiny_model(arch), local_files_only=True)
    text = "naïve café 😀 漢字 — ok\n\tend "
    ids = tokenizer(text).input_ids
    assert len(ids) == 1 + len(text.encode("utf-8"))
    assert max(ids) < len(tokenizer)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_byte_tokens_have_byte_ids_and_special_tokens_follow() -> None:
    tokenizer = build_tokenizer()
    assert tokenizer("AZ", add_special_tokens=False).input_ids == [65, 90]
    assert tokenizer.convert_tokens_to_ids(["<|bos|>", "<|eos|>", "<|pad|>"]) == [256, 257, 258]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")


def test_chat_template_renders(tiny_model) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"), local_files_only=True)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi 👋"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi 👋<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids) == text


def test_default_model_is_built_once_into_the_cache(tmp_path: Path) -> None:
    # Staging folders of builds killed before their rename: an old one is cleared, a recent one (a build that
    # may still be running) is left alone.
    killed, running = tmp_path / f".{DEFAULT_MODEL_NAME}-killed", tmp_path / f".{DEFAULT_MODEL_NAME}-running"
    for leftover in (killed, running):
        leftover.mkdir()
        (leftover / "config.json").write_text("{}")
    os.utime(killed, (time.time() - 2 * 3600,) * 2)
    path = default_model_path(tmp_path)
    assert not killed.exists() and running.is_dir()
    shutil.rmtree(running)
    assert path == tmp_path / DEFAULT_MODEL_NAME
    config = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("llama", 256, 4)
    assert (config.num_attention_heads, config.num_key_value_heads, config.max_position_embeddings) == (8, 4, 4096)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_path(tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    # No staging folders are left behind.
    assert [p.name for p in tmp_path.iterdir()] == [DEFAULT_MODEL_NAME]


def test_models_cache_dir_follows_xdg(tmp_path: Path) -> None:
    assert models_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "carpool" / "models"
    assert models_cache_dir({}) == Path.home() / ".cache" / "carpool" / "models"


def test_an_engine_without_a_model_takes_the_default_from_xdg_cache_home(
        tmp_path: Path, tiny_model: Callable[..., str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the README says the default model lives: $XDG_CACHE_HOME/carpool/models when that is set. (A tiny
    checkpoint stands in for the built one there, so the test does not build the default model.)"""
    from worker import Engine

    models = tmp_path / "carpool" / "models"
    models.mkdir(parents=True)
    (models / DEFAULT_MODEL_NAME).symlink_to(tiny_model())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert Engine(num_blocks=8).config.model == str(models / DEFAULT_MODEL_NAME)
