"""The name a worker's model is served under: what clients send as an OpenAI request's `model`."""

from __future__ import annotations

import pytest

from worker.config import WorkerConfig
from worker.engine.config import EngineConfig


@pytest.mark.parametrize(("model", "name"), [("/models/llama/", "/models/llama"), ("llama//", "llama"),
                                             ("/models/llama", "/models/llama")])
def test_the_model_is_served_under_its_path_without_a_trailing_slash(model: str, name: str) -> None:
    """`--model dir/` (as a shell completes it) is served as `dir`: the name clients send has no slash to match."""
    assert WorkerConfig(engine=EngineConfig(model=model)).model_name == name
    assert WorkerConfig(engine=EngineConfig(model=model), served_model_name="mine").model_name == "mine"
