"""A new interactive job goes to a busy engine at once, in a tick of its own, not after the replies in flight.

A real worker on a real redis-server and a tiny model. The engine runner
holds back its replies while the test says so, so the worker has its two
stepping ticks out and none answered when the interactive job arrives: what
the worker sends then is fixed by construction, whatever the engine's speed.
"""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from scheduler.params import SamplingParams
from scheduler.protocol.job import JobSpec
from scheduler.protocol.lanes import Lane
from tests.harness.worker_harness import HeldReplies, running_worker, wait_terminal, wait_until, xadd_job

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


async def test_an_interactive_job_is_sent_while_the_ticks_in_flight_are_unanswered(redis_url, tiny_model):
    from worker.engine.engine import Engine

    model = tiny_model()
    batch = JobSpec(id="batch-1", prompt="a long batch job", params=LONG, lane=Lane.BATCH)
    chat = JobSpec(id="chat-1", prompt="a quick question", params=GREEDY, lane=Lane.INTERACTIVE)
    client = aioredis.Redis.from_url(redis_url)
    runner = HeldReplies(Engine(model=model, max_num_seqs=4, policy="priority"))
    async with running_worker(redis_url, runner) as service:
        await xadd_job(client, batch)
        await wait_until(lambda: bool(service.job_loop.jobs.get(batch.id) and service.job_loop.jobs[batch.id].token_ids),
                         "the batch job decoding")
        await runner.hold()
        await wait_until(lambda: runner.unanswered == 2, "two stepping ticks out, neither answered")
        num_sent = len(runner.sent)
        await xadd_job(client, chat)
        await wait_until(lambda: any(chat.id in adds for adds, _, _ in runner.sent), "the chat sent to the engine")
        # Sent at once with no reply read in between: a tick that only adds it, the two stepping ones still out.
        assert runner.sent[num_sent:] == [([chat.id], False, 2)], runner.sent[num_sent:]
        await runner.release()
        views = await wait_terminal(client, [batch.id, chat.id])

    expected = Engine(model=model, max_num_seqs=4).generate([batch.prompt, chat.prompt], [LONG, GREEDY])
    for spec, completion in zip([batch, chat], expected):
        assert views[spec.id]["status"] == "succeeded", views[spec.id]
        assert views[spec.id]["output"]["token_ids"] == completion.token_ids, spec.id
        assert views[spec.id]["attempts"] == 1
    # Lower lanes wait for a reply as before: every tick but the chat's steps.
    assert [do_step for adds, do_step, _ in runner.sent if chat.id not in adds] == [True] * (len(runner.sent) - 1)
    await client.aclose()


def test_the_lower_lane_prefill_cap_defaults_by_device() -> None:
    from worker.config import CPU_LOWER_LANE_PREFILL_TOKENS, WorkerConfig

    assert WorkerConfig.of().engine.lower_prefill_tokens == CPU_LOWER_LANE_PREFILL_TOKENS
    assert WorkerConfig.of(device="cuda").engine.lower_prefill_tokens is None
    assert WorkerConfig.of(lower_lane_prefill_tokens=0).engine.lower_prefill_tokens is None
    assert WorkerConfig.of(device="cuda", lower_lane_prefill_tokens=512).engine.lower_prefill_tokens == 512
    with pytest.raises(ValueError, match="lower_lane_prefill_tokens"):
        WorkerConfig.of(lower_lane_prefill_tokens=-1)
