"""What carpool accepts as `--model`: a local Hugging Face checkpoint directory, never a hub id.

Checked where configuration is read, before anything imports transformers, so a hub id or a
missing path fails at once with one line instead of a network attempt and a traceback.
`offline_environ` names the variables that keep transformers and huggingface_hub off the network
for a process that loads a model anyway.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN_MODEL_NOTICE = ("served by the built-in random-weight model: its text is meaningless bytes "
                        "(give --model PATH for a real checkpoint)")
"""The one line `up`, `submit` and `generate` print when no `--model` was given."""

OFFLINE_ENV: dict[str, str] = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
"""Set by the CLI before transformers is imported (it reads them at import) and inherited by its children: no
network, and no progress bars (transformers draws one per checkpoint it loads) in a worker's log."""


def check_local_checkpoint(model: str, setting: str = "model") -> None:
    """Raise ``ValueError``, naming `setting`, unless ``model`` is a directory holding a transformers
    ``config.json``."""
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        why = "no config.json in it" if path.is_dir() else "no such directory"
        raise ValueError(f"{setting}: not a local checkpoint directory: {model} ({why}); carpool never downloads "
                         "models")
