"""Sampling through the engine: seeded determinism, stop rules, step API behaviour."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from scheduler import SamplingParams
from worker import Engine

# Its greedy continuation holds no EOS within 24 tokens, so EOS tests pick their own.
PROMPT = list(b"Once upon a time")
FULL = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tiny_model: Callable[..., str]) -> str:
    return tiny_model("llama")


@pytest.fixture
def engine(model_path: str) -> Engine:
    return Engine(model=model_path, block_size=8, num_blocks=128)


@pytest.fixture(scope="module")
def full_run(model_path: str) -> tuple[list[int], str]:
    """Greedy tokens and text for PROMPT with nothing stopping it early."""
    result = Engine(model=model_path, block_size=8, num_blocks=64).generate([PROMPT], FULL)[0]
    assert len(result.token_ids) == 24
    return result.token_ids, result.text


def drain(engine: Engine) -> dict[str, list]:
    """Run to completion; every RequestOutput per request, in order."""
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_seeded_request_same_tokens_alone_and_in_a_crowd(engine: Engine) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=2024, ignore_eos=True)
    alone = engine.generate([PROMPT], params)[0].token_ids
    rng = random.Random(7)
    prompts: list[list[int]] = []
    per_prompt: list[SamplingParams] = []
    for i in range(31):
        prompts.append([rng.randrange(256) for _ in range(rng.randint(1, 30))])
        seed = None if i % 2 else i
        per_prompt.append(SamplingParams(max_tokens=rng.randint(4, 16), temperature=1.0, seed=seed))
    prompts.insert(13, PROMPT)
    per_prompt.insert(13, params)
    crowd = engine.generate(prompts, per_prompt)
    assert crowd[13].token_ids == alone
    # The draws are really random: another seed gives other tokens.
    other = engine.generate([PROMPT], SamplingParams(**{**params.to_dict(), "seed": 99}))[0]
    assert other.token_ids != alone


def test_max_tokens_ends_with_length(engine: Engine, full_run: tuple[list[int], str]) -> None:
    result = engine.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert result.finish_reason == "length" and result.stop_reason is None
    assert result.token_ids == full_run[0][:5]


def test_stop_token_ids_stop_and_stay_out_of_the_text(engine: Engine, full_run: tuple[list[int], str]) -> None:
    tokens = full_run[0]
    stop_token = tokens[4]
    cut = tokens.index(stop_token) + 1
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_token], ignore_eos=True)
    result = engine.generate([PROMPT], params)[0]
    assert result.token_ids == tokens[:cut]
    assert result.finish_reason == "stop" and result.stop_reason == stop_token
    assert result.text == engine.tokenizer.decode(tokens[: cut - 1], skip_special_tokens=True)


def test_min_tokens_suppresses_stop_ids(engine: Engine, full_run: tuple[list[int], str]) -> None:
    tokens = full_run[0]
    stop_token = tokens[1]
    params = SamplingParams(
        max_tokens=24, min_tokens=6, temperature=0.0, stop_token_ids=[stop_token], ignore_eos=True
    )
    result = engine.generate([PROMPT], params)[0]
    assert len(result.token_ids) >= 6
    assert stop_token not in result.token_ids[:6]
    assert result.token_ids[:1] == tokens[:1]


def pick_stop_string(text: str) -> str:
    for start in range(3, len(text) - 2):
        stop = text[start:start + 2]
        if "\ufffd" not in stop and stop.strip():
            return stop
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_trimmed_or_included(engine: Engine, full_run: tuple[list[int], str], include: bool) -> None:
    text = full_run[1]
    stop = pick_stop_string(text)
    index = text.index(stop)
    params = SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop, "never-produced"],
        include_stop_str_in_output=include,
    )
    engine.add_request("s", PROMPT, params)
    outputs = drain(engine)["s"]
    final = outputs[-1]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == (text[: index + len(stop)] if include else text[:index])
    assert full_run[0][: len(final.token_ids)] == final.token_ids
    # Streamed text only grows, never shows the stop string, and ends in the final text.
    for before, after in zip(outputs, outputs[1:]):
        assert after.text.startswith(before.text)
    assert all(stop not in out.text for out in outputs[:-1])


def test_eos_stops_unless_ignored(tiny_model: Callable[..., str], full_run: tuple[list[int], str]) -> None:
    tokens = full_run[0]
    eos = tokens[3]
    # Same weights (same seed), but this model's config names that token as EOS.
    engine = Engine(model=tiny_model("llama", eos_token_id=eos), block_size=8, num_blocks=64)
    assert eos in engine.runner.eos_token_ids
    stopped = engine.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0))[0]
    assert stopped.token_ids == tokens[: tokens.index(eos) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    ignored = engine.generate([PROMPT], FULL)[0]
    assert ignored.token_ids == tokens and ignored.finish_reason == "length"
    held = engine.generate([PROMPT], SamplingParams(max_tokens=24, min_tokens=8, temperature=0.0))[0]
    assert len(held.token_ids) >= 8 and eos not in held.token_ids[:8]


def test_resume_continues_with_the_same_tokens(engine: Engine, full_run: tuple[list[int], str]) -> None:
    tokens, text = full_run
    engine.add_request("r", PROMPT, FULL, resume_token_ids=tokens[:9])
    final = drain(engine)["r"][-1]
    assert final.token_ids == tokens and final.text == text
    # Seeded sampling resumes identically too: draws are keyed by position.
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    sampled = engine.generate([PROMPT], params)[0].token_ids
    engine.add_request("r2", PROMPT, params, resume_token_ids=sampled[:4])
    assert drain(engine)["r2"][-1].token_ids == sampled


def test_resumed_tokens_that_already_end_the_request_finish_it_as_the_steps_would_have(
    engine: Engine, full_run: tuple[list[int], str]
) -> None:
    """A checkpoint taken after the stopping token (its worker died before writing the result): the request
    ends at once, with the output an uninterrupted run gives, not generating past its stop."""
    tokens, text = full_run
    stop_text = pick_stop_string(text)
    cases = [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[tokens[3]]),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop_text]),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    ]
    for i, params in enumerate(cases):
        (alone,) = engine.generate([PROMPT], params)
        # Resumed from the whole output, and from it and a few tokens the next step drew before the crash.
        for extra in (0, 2):
            resumed = alone.token_ids + tokens[len(alone.token_ids):len(alone.token_ids) + extra]
            engine.add_request(f"r{i}-{extra}", PROMPT, params, resume_token_ids=resumed)
            (final,) = [o for o in drain(engine)[f"r{i}-{extra}"] if o.finished]
            assert (final.token_ids, final.text, final.finish_reason, final.stop_reason) == (
                alone.token_ids, alone.text, alone.finish_reason, alone.stop_reason), params
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_priority_policy_runs_urgent_requests_first(model_path: str) -> None:
    engine = Engine(model=model_path, block_size=8, num_blocks=64, max_num_seqs=1, policy="priority")
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for request_id, priority in (("batch", 2), ("interactive", 0), ("standard", 1)):
        engine.add_request(request_id, PROMPT, params, priority=priority)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["interactive", "standard", "batch"]


def test_abort_frees_blocks_and_reports_abort(engine: Engine) -> None:
    engine.add_request("a", PROMPT, FULL)
    engine.add_request("b", PROMPT[:3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.step()
    assert engine.abort_request("a") is True
    assert engine.abort_request("a") is False
    outputs = drain(engine)
    assert outputs["a"][-1].finish_reason == "abort" and outputs["a"][-1].finished
    assert outputs["b"][-1].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_an_id_re_added_after_its_abort_gets_only_its_own_outputs(
    engine: Engine, full_run: tuple[list[int], str]
) -> None:
    """A worker that aborts a job and is handed it back before the next step must not see the old abort."""
    tokens, text = full_run
    engine.add_request("a", PROMPT, FULL)
    engine.step()
    engine.step()
    assert engine.abort_request("a") is True
    engine.add_request("a", PROMPT, FULL, resume_token_ids=tokens[:1])
    outputs = drain(engine)["a"]
    assert [o.finish_reason for o in outputs if o.finished] == ["length"]
    assert outputs[-1].token_ids == tokens and outputs[-1].text == text
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_bad_requests_are_rejected_clearly(engine: Engine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("x", [], FULL)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("x", [1, 10**6], FULL)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("x", PROMPT, SamplingParams(max_tokens=engine.max_model_len))
    # Text far longer than the context is refused before the tokenizer reads it.
    huge = "a" * (engine.max_prompt_chars + 1)
    with pytest.raises(ValueError, match=rf"prompt: {len(huge)} characters cannot fit"):
        engine.add_request("x", huge, FULL)
    with pytest.raises(ValueError, match=rf"messages: {len(huge)} characters of content cannot fit"):
        engine.add_request("x", messages=[{"role": "user", "content": huge}], params=FULL)
    engine.add_request("x", PROMPT, FULL)
    with pytest.raises(ValueError, match="already"):
        engine.add_request("x", PROMPT, FULL)
    assert engine.num_unfinished_requests() == 1


def test_the_prompt_character_limit_only_refuses_what_cannot_fit(engine: Engine) -> None:
    """The limit lies above what the context can hold, whatever the text: at the limit, the longest tokens of
    the vocabulary repeated still make more tokens than the context has."""
    longest = max(engine.tokenizer.get_vocab(), key=len)
    text = engine.tokenizer.convert_tokens_to_string([longest]) * (engine.max_prompt_chars // max(len(longest), 1))
    assert len(text) <= engine.max_prompt_chars
    with pytest.raises(ValueError, match="max_model_len"):  # tokenized, then refused by its token count
        engine.add_request("y", text[: engine.max_prompt_chars], FULL)


def test_messages_use_the_chat_template(engine: Engine) -> None:
    messages = [{"role": "user", "content": "hi"}]
    num_prompt = engine.add_request("chat", messages=messages, params=FULL)
    expected = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert expected.endswith("assistant\n")
    assert num_prompt == len(engine.tokenizer(expected, add_special_tokens=False)["input_ids"])
    final = drain(engine)["chat"][-1]
    assert final.num_prompt_tokens == num_prompt and len(final.token_ids) == 24


def test_logprobs_are_reported_per_token(engine: Engine) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    result = engine.generate([PROMPT], params)[0]
    assert result.logprobs is not None and len(result.logprobs) == 4
    for entry, token in zip(result.logprobs, result.token_ids):
        assert entry["token_id"] == token and entry["logprob"] <= 0.0
        assert len(entry["top_logprobs"]) == 3
        # Greedy: the sampled token is the most likely one.
        assert entry["top_logprobs"][0]["token_id"] == token


@pytest.mark.parametrize("batching", ["static", "dynamic"])
def test_padded_modes_match_continuous_with_uneven_lengths(model_path: str, batching: str) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 20))] for _ in range(10)]
    params = [SamplingParams(max_tokens=rng.randint(1, 9), temperature=0.0, ignore_eos=True) for _ in prompts]
    continuous = Engine(model=model_path, block_size=8, num_blocks=64, max_num_seqs=4).generate(prompts, params)
    padded = Engine(model=model_path, block_size=8, num_blocks=64, max_num_seqs=4, batching=batching, max_wait_ms=1.0)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        padded.add_request(str(i), prompt, p)
    tokens: dict[str, list[int]] = {}
    num_seq_steps = 0
    while padded.has_unfinished_requests():
        for out in padded.step():
            tokens[out.request_id] = out.token_ids
            assert len(out.token_ids) <= params[int(out.request_id)].max_tokens
        num_seq_steps += padded.stats().last_step_num_seqs
    assert [tokens[str(i)] for i in range(len(prompts))] == [r.token_ids for r in continuous]
    # Unpadded, each request is scheduled once per token it gets; finished
    # members kept computing as padding, so the groups took more.
    assert num_seq_steps > sum(p.max_tokens for p in params)
    assert padded.block_manager.num_free_blocks == padded.block_manager.num_blocks
    assert not padded.has_unfinished_requests()


def test_a_special_token_in_the_output_is_marked_in_its_logprobs(tiny_model: Callable[..., str],
                                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    """A special token sampled mid-output shows its piece in the logprobs but is left out of the text: its entry
    says so (`special`), so that the text offsets computed from the entries' bytes skip it."""
    from bench.repetitive import make_cycling_model

    bos = 256  # `<|bos|>` in the byte-level tokenizer of the tiny models
    path = make_cycling_model(tiny_model(), tmp_path_factory.mktemp("special") / "m",
                              successor_of={ord("a"): bos, bos: ord("b"), ord("b"): ord("a")})
    engine = Engine(model=str(path), num_blocks=32)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    result = engine.generate([[ord("a")]], params)[0]
    assert result.token_ids == [bos, ord("b"), ord("a"), bos]
    assert result.text == "ba"
    assert result.logprobs is not None
    assert [entry.get("special", False) for entry in result.logprobs] == [True, False, False, True]
    assert result.logprobs[0]["token"] == "<|bos|>" and bytes(result.logprobs[0]["bytes"]) == b"<|bos|>"


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_in_the_ends_replacement_character_stops(tiny_model: Callable[..., str],
                                                               tmp_path_factory: pytest.TempPathFactory,
                                                               include: bool) -> None:
    """The bytes of a character cut short by max_tokens come out as U+FFFD at the end: a stop string ending in it
    stops the request there, as anywhere else in the text, and the text never holds the stop string."""
    from bench.repetitive import make_cycling_model

    path = make_cycling_model(tiny_model(), tmp_path_factory.mktemp("cut") / "m",
                              successor_of={ord("a"): ord("b"), ord("b"): 0xE4, 0xE4: ord("a")})
    engine = Engine(model=str(path), num_blocks=32)
    plain = engine.generate([[ord("a")]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
    assert (plain.text, plain.finish_reason) == ("b\ufffd", "length")
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, stop=["b\ufffd"],
                            include_stop_str_in_output=include)
    stopped = engine.generate([[ord("a")]], params)[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", "b\ufffd")
    assert stopped.text == ("b\ufffd" if include else "")
