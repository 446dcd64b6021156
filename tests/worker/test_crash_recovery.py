"""SIGKILL a worker process mid-generation; another worker finishes every job exactly once, resuming from checkpoints."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path

import msgpack
import pytest
import redis.asyncio as aioredis

from scheduler.params import SamplingParams
from scheduler.protocol.job import JobSpec
from scheduler.protocol.lanes import LANES
from tests.harness.worker_harness import (KEYS, WAIT_S, kill_holding, start_worker_process, wait_terminal, wait_until,
                                         xadd_job)

END_OF_EVENTS = "end-of-events"
"""A job id no worker runs: the test publishes on its channel once every worker has stopped."""


def start_worker(redis_url: str, model: str, name: str, log_path: Path,
                 extra_args: list[str] | None = None) -> subprocess.Popen[bytes]:
    return start_worker_process(redis_url, model, name, log_path, *(extra_args or []))


@pytest.fixture(scope="module")
def cycling_draft(tiny_model, tmp_path_factory) -> str:
    """A one-layer model with the cycling model's tokenizer and cycles: a draft whose proposals are accepted."""
    from bench.repetitive import make_cycling_model

    return str(make_cycling_model(tiny_model("llama", num_hidden_layers=1), tmp_path_factory.mktemp("draft") / "m"))


@pytest.mark.parametrize("speculative", [None, "ngram", "draft"], ids=["plain", "prompt-lookup", "draft-model"])
async def test_sigkill_mid_generation_every_job_succeeds_once(redis_url, tiny_model, cycling_model, cycling_draft,
                                                              tmp_path, speculative):
    """With speculative decoding the model is the cycling one, whose outputs repeat themselves: prompt lookup (or
    the draft model) proposes on nearly every step, so the kill lands mid-speculation, and the resumed outputs
    still match."""
    from worker.engine.engine import Engine

    model = tiny_model() if speculative is None else cycling_model
    draft = {"draft_model": cycling_draft} if speculative == "draft" else {}
    extra_args = [] if speculative is None else ["--speculative", speculative]
    if draft:
        extra_args += ["--draft-model", cycling_draft]
    # The worker is frozen before it is seen holding a checkpointed job and killed frozen, so that job is
    # mid-generation at the kill at any engine speed; 300 tokens keep several running at once.
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    specs = [JobSpec(id=f"crash-{i}", prompt=f"crash prompt {i}", params=params, lane=LANES[i % 3],
                     reply_to="replies:crash") for i in range(14)]
    expected = {s.id: c for s, c in zip(specs, Engine(model=model, max_num_seqs=16).generate(
        [s.prompt for s in specs], params))}
    if speculative is not None:
        speculating = Engine(model=model, max_num_seqs=8, speculative=speculative, **draft)
        assert [c.token_ids for c in speculating.generate([s.prompt for s in specs], params)] == [
            expected[s.id].token_ids for s in specs]
        assert speculating.stats().spec_accepted_tokens > 100 * len(specs)
    client = aioredis.Redis.from_url(redis_url)
    finals: dict[str, int] = {}
    pubsub = client.pubsub()
    await pubsub.psubscribe(KEYS.events("*"))

    async def count_finals() -> None:
        async for message in pubsub.listen():
            if message["type"] == "pmessage":
                event = msgpack.unpackb(message["data"], raw=False)
                if event["type"] == "end":
                    return
                if event["type"] == "final":
                    finals[event["id"]] = finals.get(event["id"], 0) + 1

    listener = asyncio.create_task(count_finals())
    first = start_worker(redis_url, model, "doomed", tmp_path / "doomed.log", extra_args)
    second = None
    try:
        for spec in specs:
            await xadd_job(client, spec)

        async def mid_generation() -> bool:  # at least 8 jobs mid-generation (checkpointed, unfinished), more queued
            assert first.poll() is None, (tmp_path / "doomed.log").read_text()
            async with client.pipeline(transaction=False) as pipe:
                for spec in specs:
                    pipe.hmget(KEYS.job(spec.id), ["status", "checkpoint"])
                records = await pipe.execute()
            mid = sum(1 for status, ckpt in records if status == b"running" and ckpt)
            queued = sum(1 for status, _ in records if status in (None, b"queued"))
            return mid >= 8 and queued > 0

        async def checkpointed() -> list[str]:  # running jobs with a checkpoint: each resumes from it
            async with client.pipeline(transaction=False) as pipe:
                for spec in specs:
                    pipe.hmget(KEYS.job(spec.id), ["status", "checkpoint"])
                records = await pipe.execute()
            return [spec.id for spec, (status, ckpt) in zip(specs, records, strict=True)
                    if status == b"running" and ckpt]

        await kill_holding(first, mid_generation, checkpointed, "8 jobs mid-generation and more queued")
        second = start_worker(redis_url, model, "rescuer", tmp_path / "rescuer.log", extra_args)
        views = await wait_terminal(client, [s.id for s in specs])
        # Every final event reaches the listener before a marker published after the rescuer stopped.
        second.send_signal(signal.SIGTERM)
        second.wait()
        await client.publish(KEYS.events(END_OF_EVENTS), msgpack.packb({"type": "end", "id": END_OF_EVENTS}))
        await asyncio.wait_for(listener, WAIT_S)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await pubsub.aclose()
    replies = [msgpack.unpackb(f[b"result"], raw=False)["id"] for _, f in await client.xrange("replies:crash")]
    for spec in specs:
        view = views[spec.id]
        assert view["status"] == "succeeded", view
        assert view["output"]["token_ids"] == expected[spec.id].token_ids  # resumed output is complete and identical
        assert finals.get(spec.id) == 1, f"{spec.id}: {finals.get(spec.id)} final events"
        assert replies.count(spec.id) == 1
    resumed = [v for v in views.values() if (v["resumed_from"] or 0) > 0]
    assert resumed, "no job resumed from its checkpoint"
    assert all(v["worker"] == "rescuer" and v["attempts"] == 2 for v in resumed)
    assert second is not None and second.returncode == 0  # clean two-phase exit on SIGTERM
    assert await client.hget(KEYS.workers, "rescuer") is None
    await client.aclose()
