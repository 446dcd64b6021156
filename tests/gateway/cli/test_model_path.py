"""A `--model` that is not a local checkpoint directory fails at once, in one line, with no network attempt."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli.embedded_redis import free_port
from tests.harness.up_stack import REPO, carpool, carpool_env

ONE_LINE = "carpool never downloads models"


def _assert_one_line_refusal(done: subprocess.CompletedProcess[str], model: str, setting: str = "--model") -> None:
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr  # one line, no traceback
    assert f"{setting}: not a local checkpoint directory: {model}" in done.stderr and ONE_LINE in done.stderr


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-0.5B-Instruct", "/no/such/checkpoint"])
def test_generate_refuses_a_hub_id_or_missing_path(model: str) -> None:
    _assert_one_line_refusal(carpool("generate", "hi", "--model", model), model)


def test_a_missing_draft_model_is_named_as_the_draft(tiny_model) -> None:
    done = carpool("generate", "hi", "--model", tiny_model(), "--speculative", "draft", "--draft-model", "/no/draft")
    _assert_one_line_refusal(done, "/no/draft", "--draft-model")


def test_worker_refuses_a_directory_without_a_checkpoint(tmp_path: Path) -> None:
    done = carpool("worker", "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--model", str(tmp_path))
    _assert_one_line_refusal(done, str(tmp_path))


def test_up_refuses_a_hub_id_before_starting_anything(tmp_path: Path) -> None:
    done = carpool("up", "--model", "meta-llama/Llama-3.2-1B", "--redis-port", "0", "--data-dir", str(tmp_path / "data"))
    _assert_one_line_refusal(done, "meta-llama/Llama-3.2-1B")
    assert not (tmp_path / "data").exists()  # no Redis was started


def test_bench_refuses_a_hub_id(tmp_path: Path) -> None:
    done = carpool("bench", "--model", "gpt2", "--output", str(tmp_path / "out"))
    _assert_one_line_refusal(done, "gpt2")


def test_the_cli_runs_offline_before_transformers_loads() -> None:
    probe = ("import sys; from gateway.cli.main import main; main(['redis-cli', '--help']); "
             "import os, transformers.utils.hub as hub; "
             "print(os.environ['HF_HUB_OFFLINE'], os.environ['TRANSFORMERS_OFFLINE'], hub.is_offline_mode())")
    done = subprocess.run([sys.executable, "-c", probe], env=carpool_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-3:] == ["1", "1", "True"]


@pytest.mark.parametrize("verb", ["up", "generate"])
def test_a_device_this_machine_has_not_is_refused_before_starting_anything(verb: str, tmp_path: Path) -> None:
    """No machine has 100 GPUs: `up`, like `generate`, says so in one line (exit 2) before Redis, the gateway or
    a worker starts, whether torch sees no GPU or a few."""
    flags = ["--redis-port", "0", "--data-dir", str(tmp_path / "data")] if verb == "up" else ["hi"]
    done = carpool(verb, *flags, "--device", "cuda:99")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"carpool {verb}: --device: cuda:99 asked for, but torch sees "), done.stderr
    assert not (tmp_path / "data").exists()  # no Redis was started


@pytest.mark.parametrize("model", ["meta-llama/Llama-3.2-1B", "/path/to/hf-checkpoint"])
def test_the_python_engine_refuses_a_hub_id_or_missing_path_too(model: str) -> None:
    """`Engine(model=...)` in a program of the user's own (no CLI to set HF_HUB_OFFLINE): the same one line,
    raised before transformers is asked, so no network attempt and no hub error."""
    from worker import Engine

    with pytest.raises(ValueError) as refused:
        Engine(model=model, device="cpu")
    assert str(refused.value) == (f"model: not a local checkpoint directory: {model} (no such directory); {ONE_LINE}")
    with pytest.raises(ValueError, match=f"^draft_model: not a local checkpoint directory: {model} "):
        Engine(speculative="draft", draft_model=model, device="cpu")


def test_a_model_path_starting_with_a_tilde_loads_from_the_home_directory(tiny_model, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`~/m` as a deployment's variable or a quoted flag holds it (no shell expanded it): found, and loaded, there;
    the draft model's too."""
    from scheduler.params import SamplingParams
    from worker import Engine

    home = tmp_path / "home"
    home.mkdir()
    (home / "m").symlink_to(tiny_model())
    monkeypatch.setenv("HOME", str(home))
    engine = Engine(model="~/m", speculative="draft", draft_model="~/m", num_speculative_tokens=2, device="cpu")
    (completion,) = engine.generate(["hi"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(completion.token_ids) == 3
