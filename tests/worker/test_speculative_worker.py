"""A worker that speculates: jobs over the queue get the tokens they get without it, one job may opt out,
and /metrics counts proposed and accepted tokens per proposer."""

from __future__ import annotations

import msgpack
import redis.asyncio as aioredis

from bench.repetitive import successors
from scheduler.params import SamplingParams
from scheduler.protocol.lanes import Lane
from scheduler.telemetry import metric_schema
from tests.harness.telemetry_support import sample_names, value
from tests.harness.worker_harness import KEYS, running_worker, wait_terminal


def cycle_text(start: int, length: int) -> str:
    nxt = successors()
    tokens = [start]
    while len(tokens) < length:
        tokens.append(nxt[tokens[-1]])
    return bytes(tokens).decode("latin-1")


async def test_speculating_worker_jobs_and_metrics(redis_url: str, cycling_model: str) -> None:
    from worker.engine import Engine

    prompts = [cycle_text(40 + 3 * i, 30) for i in range(4)]
    expected = Engine(model=cycling_model, max_num_seqs=4).generate(
        prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine = Engine(model=cycling_model, max_num_seqs=4, speculative="ngram", num_speculative_tokens=3)
    client = aioredis.Redis.from_url(redis_url)
    async with running_worker(redis_url, engine) as worker:
        for i, prompt in enumerate(prompts):
            params = {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True, "speculative": i != 0}
            await client.xadd(KEYS.lane(Lane.STANDARD), {"job": msgpack.packb(
                {"v": 1, "id": f"spec-{i}", "prompt": prompt, "params": params})})
        views = await wait_terminal(client, [f"spec-{i}" for i in range(4)])
        text = worker.metrics.render().decode()
    await client.aclose()
    for i, completion in enumerate(expected):
        assert views[f"spec-{i}"]["status"] == "succeeded"
        assert views[f"spec-{i}"]["output"]["token_ids"] == completion.token_ids
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0
    # The job that opted out proposed nothing: at most 3 proposals of up to 3 tokens per step for the others.
    assert stats.spec_proposed_tokens <= 3 * 3 * 40
    labels = {"carpool_spec_decode_proposer": "ngram"}
    assert value(text, "carpool_engine_spec_decode_proposed_total", **labels) == stats.spec_proposed_tokens
    assert value(text, "carpool_engine_spec_decode_accepted_total", **labels) == stats.spec_accepted_tokens
    assert value(text, "carpool_engine_spec_decode_drafts_total", **labels) == stats.spec_num_drafts
    assert value(text, "carpool_engine_spec_decode_mean_accepted_length", **labels) == (
        1 + stats.spec_accepted_tokens / stats.spec_num_drafts)
    names = sample_names(text)
    for spec in metric_schema.SPEC_DECODE_METRICS:
        assert set(spec.prometheus_names) <= names, spec.name
