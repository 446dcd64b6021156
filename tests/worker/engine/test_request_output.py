"""Step outputs read the request's growing lists without copying them, yet each keeps its own step's view."""

from __future__ import annotations

from scheduler.params import SamplingParams
from worker.engine.engine import Engine


def test_each_output_keeps_the_tokens_and_logprobs_of_its_own_step(tiny_model) -> None:
    engine = Engine(tiny_model("llama"), max_num_seqs=2, num_blocks=16)
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [len(o.token_ids) for o in outputs] == [1, 2, 3, 4]
    assert [len(o.logprobs or []) for o in outputs] == [1, 2, 3, 4]
    final = outputs[-1]
    assert [o.new_token_ids[0] for o in outputs] == final.token_ids
    for i, out in enumerate(outputs):
        assert out.token_ids == final.token_ids[: i + 1]
        assert out.logprobs == (final.logprobs or [])[: i + 1]
    # Each read is a fresh list: a caller's edit does not reach the engine's sequence or later reads.
    final.token_ids.append(-1)
    assert len(final.token_ids) == 4
    assert [c.token_ids for c in engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0,
                                                                            ignore_eos=True))] == [final.token_ids]


def test_resumed_tokens_count_in_token_ids_but_not_in_logprobs(tiny_model) -> None:
    engine = Engine(tiny_model("llama"), max_num_seqs=2, num_blocks=16)
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=0, ignore_eos=True)
    engine.add_request("r", [5, 6, 7], params, resume_token_ids=[65])
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [len(o.token_ids) for o in outputs] == [2, 3]
    assert [len(o.logprobs or []) for o in outputs] == [1, 2]
    assert outputs[-1].token_ids[0] == 65 and outputs[-1].finish_reason == "length"
