"""Random-weight checkpoints built locally: tiny test models and the default model.

Nothing is downloaded. A checkpoint is a transformers config, deterministic
random weights, a generation config and a byte-level tokenizer, all written
with ``save_pretrained`` so any code loads it back by path like a real one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    GenerationConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PhiConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from worker.engine.config import DEFAULT_MODEL_NAME

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
TURN_START_TOKEN = "<|im_start|>"
TURN_END_TOKEN = "<|im_end|>"
# transformers loads a qwen2 checkpoint's tokenizer as its Qwen2 class, which
# adds this token when missing; having it in the vocabulary keeps every
# architecture's tokenizer exactly as large as its embedding.
END_OF_TEXT_TOKEN = "<|endoftext|>"
# Ids follow the 256 byte tokens in this order.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, TURN_START_TOKEN, TURN_END_TOKEN, END_OF_TEXT_TOKEN)
NUM_BYTE_TOKENS = 256

# The rendered text starts with the BOS token, so encode it with
# add_special_tokens=False (as apply_chat_template(tokenize=True) does).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "mistral": MistralConfig,
    "qwen3": Qwen3Config,
    # Outside the Llama family: runs through transformers (partial RoPE, LayerNorm, GELU).
    "phi": PhiConfig,
    # Learned positions, Conv1D projections, and a config that names no intermediate_size (its MLP width is
    # n_inner): through transformers too.
    "gpt2": GPT2Config,
}

# Big enough that the logits of a random model are spread out: with the usual
# 0.02 every next-token logit sits within ~1e-3 of the others and greedy
# decoding would hinge on float rounding.
TINY_INITIALIZER_RANGE = 0.25

TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
}

DEFAULT_SHAPE: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 688,
    "max_position_embeddings": 4096,
    "initializer_range": 0.1,
}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: one token per byte, no merges, so any UTF-8 round-trips."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # Order byte tokens by byte value so token id == byte value, which keeps ids readable.
    byte_to_char = _byte_level_chars()
    assert sorted(byte_to_char) == sorted(alphabet)
    vocab = {char: byte for byte, char in enumerate(byte_to_char)}
    for offset, token in enumerate(SPECIAL_TOKENS):
        vocab[token] = NUM_BYTE_TOKENS + offset
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    core.add_special_tokens(list(SPECIAL_TOKENS))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    bos_id = vocab[BOS_TOKEN]
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[TURN_START_TOKEN, TURN_END_TOKEN, END_OF_TEXT_TOKEN],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=TINY_SHAPE["max_position_embeddings"],
    )


def _byte_level_chars() -> list[str]:
    """The printable character the byte-level alphabet uses for each byte value (GPT-2 scheme)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: list[str] = []
    shift = 0
    for byte in range(NUM_BYTE_TOKENS):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(NUM_BYTE_TOKENS + shift))
            shift += 1
    return chars


def create_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0, **config_overrides: Any) -> Path:
    """Write a tiny random-weight checkpoint of `arch` into `path` and return the path.

    Same (arch, seed, overrides) → byte-identical files. The global torch RNG
    is left untouched.
    """
    shape = {**TINY_SHAPE, "initializer_range": TINY_INITIALIZER_RANGE, **config_overrides}
    return _create_model(Path(path), arch, seed, shape)


def _create_model(path: Path, arch: str, seed: int, shape: dict[str, Any]) -> Path:
    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"arch: unknown architecture {arch!r}, expected one of {sorted(_CONFIG_CLASSES)}")
    tokenizer = build_tokenizer()
    tokenizer.model_max_length = int(shape["max_position_embeddings"])
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    turn_end_id = tokenizer.convert_tokens_to_ids(TURN_END_TOKEN)
    settings: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": eos_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **shape,
    }
    if arch == "gpt2":  # multi-head attention only
        settings.pop("num_key_value_heads", None)
        settings["n_inner"] = settings.pop("intermediate_size", None)
    if arch == "mistral" and "sliding_window" not in shape:
        # No sliding window: the paged kernels attend to the whole context, and
        # so must the transformers reference they are compared against.
        settings["sliding_window"] = None
    config = _CONFIG_CLASSES[arch](**settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        from transformers import AutoModelForCausalLM  # seconds to import: only when a model is made

        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    # A chat reply ends with the turn-end token, plain text with EOS: both stop generation.
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[eos_id, turn_end_id],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def models_cache_dir(environ: Mapping[str, str]) -> Path:
    """`$XDG_CACHE_HOME/carpool/models` (or `~/.cache/...`); call at the edge with `os.environ`."""
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "carpool" / "models"


def default_model_path(cache_dir: Path | None = None) -> Path:
    """Path of the default model, building it on first use.

    `cache_dir` is the folder that holds models (default `~/.cache/carpool/models`;
    see `models_cache_dir`). The model is built in a temporary folder beside
    the final one and renamed into place, so concurrent first uses never see
    a half-written checkpoint.
    """
    root = Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "carpool" / "models"
    final = root / DEFAULT_MODEL_NAME
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(root)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=root))
    try:
        _create_model(staging, "llama", 0, dict(DEFAULT_SHAPE))
        try:
            os.rename(staging, final)
        except OSError:
            # Another process won the race; its copy is complete (rename is atomic).
            if not final.is_dir():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final


STALE_STAGING_S = 3600.0
"""A staging folder untouched this long was left by a build that was killed (building takes seconds)."""


def _remove_stale_staging(root: Path) -> None:
    """Remove the staging folders of builds killed before their rename, so they do not pile up in the cache."""
    cutoff = time.time() - STALE_STAGING_S
    for leftover in root.glob(f".{DEFAULT_MODEL_NAME}-*"):
        try:
            if leftover.is_dir() and leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            continue  # another process removed it first
