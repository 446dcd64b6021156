"""OpenAI request bodies turned into job params: what OpenAI takes, carpool takes too."""

from __future__ import annotations

import pytest

from gateway.errors import OpenAIError
from gateway.openai.schema import Endpoint, parse_request
from scheduler.params import MAX_SEED
from scheduler.protocol.lanes import Lane


def _params(**body: object) -> dict[str, object]:
    request = parse_request(Endpoint.CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body},
                            default_lane=Lane.INTERACTIVE)
    return dict(request.jobs[0]["params"])


@pytest.mark.parametrize(("seed", "drawn_as"), [(7, 7), (-1, MAX_SEED), (-(MAX_SEED + 1), 0), (MAX_SEED, MAX_SEED)])
def test_any_64_bit_seed_is_taken(seed: int, drawn_as: int) -> None:
    assert _params(seed=seed)["seed"] == drawn_as


def test_a_seed_past_64_bits_is_refused() -> None:
    with pytest.raises(OpenAIError, match="seed"):
        _params(seed=-(MAX_SEED + 2))


def test_top_p_zero_is_taken() -> None:
    assert _params(top_p=0)["top_p"] == 0
