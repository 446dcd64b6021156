"""The engine thread: ticks in step order, adds and aborts in queue order, bounded lead, clean stops, failures."""

from __future__ import annotations

import asyncio
import queue
import time
from typing import Any

import redis.asyncio as aioredis

from scheduler.job import JobSpec, JobStatus
from scheduler.params import SamplingParams
from tests.worker_harness import KEYS, running_worker, status_of, xadd_job
from worker.engine import Engine
from worker.engine_thread import EngineAdd, EngineFailed, EngineThread, Tick


def _add(job_id: str, prompt: str, max_tokens: int) -> EngineAdd:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineAdd(job_id, JobSpec(id=job_id, prompt=prompt, params=params), 0, [])


class _Receiver:
    """Collects deliveries from the engine thread; acknowledges each tick unless told to hold them."""

    def __init__(self, thread: EngineThread, *, acknowledge: bool = True) -> None:
        self.thread = thread
        self.acknowledge = acknowledge
        self.items: queue.SimpleQueue[Tick | EngineFailed] = queue.SimpleQueue()

    def __call__(self, item: Tick | EngineFailed) -> None:
        self.items.put(item)
        if self.acknowledge and isinstance(item, Tick):
            self.thread.handled()

    def get(self, timeout_s: float = 30.0) -> Tick | EngineFailed:
        return self.items.get(timeout=timeout_s)

    def ticks_until_idle(self, timeout_s: float = 60.0) -> list[Tick]:
        ticks: list[Tick] = []
        deadline = time.monotonic() + timeout_s
        while not ticks or ticks[-1].num_unfinished:
            item = self.get(max(0.1, deadline - time.monotonic()))
            assert isinstance(item, Tick), item
            ticks.append(item)
        return ticks


def test_ticks_come_in_step_order_with_the_offline_engines_tokens(tiny_model: Any) -> None:
    model = tiny_model()
    prompts = {"a": ("first prompt", 12), "b": ("second", 5), "c": ("the third one", 9)}
    expected = Engine(model=model, max_num_seqs=4).generate(
        [p for p, _ in prompts.values()],
        [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in prompts.values()])
    thread = EngineThread(Engine(model=model, max_num_seqs=4))
    receiver = _Receiver(thread)
    for job_id, (prompt, n) in prompts.items():
        thread.add(_add(job_id, prompt, n))
    thread.start(receiver)
    try:
        ticks = receiver.ticks_until_idle()
    finally:
        thread.stop()
        assert thread.join(10)
    steps = [t.stats.num_steps for t in ticks]
    assert steps == list(range(steps[0], steps[0] + len(ticks)))
    tokens: dict[str, list[int]] = {job_id: [] for job_id in prompts}
    finished: list[str] = []
    for tick in ticks:
        for out in tick.outputs:
            assert out.request_id not in finished
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished.append(out.request_id)
    assert finished == ["b", "c", "a"]  # the shortest first
    assert [tokens[job_id] for job_id in prompts] == [c.token_ids for c in expected]


def test_an_abort_queued_after_the_add_removes_the_request_before_it_runs(tiny_model: Any) -> None:
    thread = EngineThread(Engine(model=tiny_model(), max_num_seqs=4))
    receiver = _Receiver(thread)
    thread.add(_add("gone", "never runs", 50))
    thread.abort("gone")
    thread.add(_add("kept", "runs", 3))
    thread.start(receiver)
    try:
        ticks = receiver.ticks_until_idle()
    finally:
        thread.stop()
        assert thread.join(10)
    gone = [out for tick in ticks for out in tick.outputs if out.request_id == "gone"]
    assert [(out.finished, out.finish_reason, out.token_ids) for out in gone] == [(True, "abort", [])]
    kept = [tok for tick in ticks for out in tick.outputs if out.request_id == "kept" for tok in out.new_token_ids]
    assert len(kept) == 3
    assert ticks[-1].num_unfinished == 0 and not ticks[-1].rejected


def test_a_refused_add_is_reported_in_its_tick(tiny_model: Any) -> None:
    thread = EngineThread(Engine(model=tiny_model(), max_num_seqs=4, max_model_len=64))
    receiver = _Receiver(thread)
    thread.add(_add("huge", "x", 1000))
    thread.start(receiver)
    try:
        tick = receiver.get()
    finally:
        thread.stop()
        assert thread.join(10)
    assert isinstance(tick, Tick)
    assert set(tick.rejected) == {"huge"} and "max_tokens" in tick.rejected["huge"]
    assert tick.outputs == [] and tick.num_unfinished == 0


def test_the_engine_runs_at_most_max_ticks_ahead_of_the_receiver(tiny_model: Any) -> None:
    thread = EngineThread(Engine(model=tiny_model(), max_num_seqs=4), max_ticks_ahead=2)
    receiver = _Receiver(thread, acknowledge=False)
    thread.add(_add("long", "a long one", 40))
    thread.start(receiver)
    try:
        first, second = receiver.get(), receiver.get()
        time.sleep(0.3)  # many steps' worth: the thread must be waiting, not stepping
        assert receiver.items.empty()
        thread.handled()
        third = receiver.get()
        time.sleep(0.3)
        assert receiver.items.empty()
    finally:
        thread.stop()
        assert thread.join(10)
    assert [t.stats.num_steps for t in (first, second, third)] == [1, 2, 3]  # type: ignore[union-attr]


def test_stop_ends_the_thread_while_idle_and_while_busy(tiny_model: Any) -> None:
    engine = Engine(model=tiny_model(), max_num_seqs=4)
    idle = EngineThread(engine)
    idle.start(_Receiver(idle))
    time.sleep(0.05)
    assert idle.is_alive
    idle.stop()
    assert idle.join(5) and not idle.is_alive

    busy = EngineThread(engine)
    receiver = _Receiver(busy)
    busy.add(_add("long", "a long one", 200))
    busy.start(receiver)
    assert isinstance(receiver.get(), Tick)
    busy.stop()
    assert busy.join(5)
    delivered = 1
    while not receiver.items.empty():
        assert isinstance(receiver.get(), Tick)
        delivered += 1
    assert delivered < 200  # stopped mid-generation, not after it
    assert engine.has_unfinished_requests()


class _BrokenEngine(Engine):
    """A real engine whose third step fails, as a fault inside the model would."""

    def step(self) -> Any:
        if self.stats().num_steps == 2:
            raise RuntimeError("device lost")
        return super().step()


def test_an_engine_failure_reaches_the_receiver(tiny_model: Any) -> None:
    thread = EngineThread(_BrokenEngine(model=tiny_model(), max_num_seqs=4))
    receiver = _Receiver(thread)
    thread.add(_add("a", "some prompt", 20))
    thread.start(receiver)
    items = [receiver.get() for _ in range(3)]
    assert thread.join(5)
    assert [type(i) for i in items] == [Tick, Tick, EngineFailed]
    failure = items[2]
    assert isinstance(failure, EngineFailed) and isinstance(failure.__cause__, RuntimeError)
    assert "device lost" in str(failure)


async def test_an_engine_failure_fails_the_worker(redis_url: str, tiny_model: Any) -> None:
    client = aioredis.Redis.from_url(redis_url)
    spec = JobSpec(id="doomed", prompt="hello", params=SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    async with running_worker(redis_url, _BrokenEngine(model=tiny_model(), max_num_seqs=4),
                              shutdown_grace_s=0.5) as service:
        await xadd_job(client, spec)
        deadline = time.monotonic() + 30
        while not service.has_failed:
            assert time.monotonic() < deadline, "the engine failure never reached the worker's health"
            await asyncio.sleep(0.02)
        assert service.stopped.is_set()
    # Nothing queued is lost: the job was not committed and its entry is still in the lane for another worker.
    assert await status_of(client, spec.id) != JobStatus.SUCCEEDED.value
    assert await client.xlen(KEYS.lane(spec.lane)) == 1
    await client.aclose()
