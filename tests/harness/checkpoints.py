"""Random-weight checkpoints of any transformers config, saved to disk with the byte tokenizer, and copies of a
checkpoint with its config or weights edited: the checkpoints users bring, built in the test."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def save_checkpoint(path: Path, config: Any, *, tokenizer: bool = True) -> str:
    """A random-weight checkpoint of `config` (a transformers config) in `path`, with the byte tokenizer."""
    from transformers import AutoModelForCausalLM

    from worker.engine.default_model import build_tokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    if tokenizer:
        build_tokenizer().save_pretrained(path)
    return str(path)


def small_config(config_class: Any, **overrides: Any) -> Any:
    """`config_class` at a size that loads in moments, over the byte tokenizer's vocabulary."""
    from worker.engine.default_model import build_tokenizer

    return config_class(**{"vocab_size": len(build_tokenizer()), "hidden_size": 32, "num_hidden_layers": 1,
                           "num_attention_heads": 2, **overrides})


def edited_copy(source: str, path: Path, *, config: Callable[[dict[str, Any]], None] | None = None,
                weights: Callable[[dict[str, torch.Tensor]], None] | None = None) -> str:
    """A copy of the checkpoint `source` in `path`, its config.json edited in place by `config` and its (one)
    safetensors file's tensors by `weights`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, path)
    if config is not None:
        settings = json.loads((path / "config.json").read_text())
        config(settings)
        (path / "config.json").write_text(json.dumps(settings))
    if weights is not None:
        tensors = load_file(path / "model.safetensors")
        weights(tensors)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return str(path)
