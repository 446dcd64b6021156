"""The engine in its own process: same tokens as in-process, failures reach the worker, no child outlives its worker."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from scheduler.params import SamplingParams
from scheduler.protocol.job import JobSpec
from tests.harness.child_env import child_pythonpath
from tests.harness.worker_harness import KEYS, WAIT_S, running_worker, wait_terminal, wait_until, xadd_job
from worker.engine.config import EngineConfig
from worker.engine.process import EngineProcess, EngineStartError
from worker.engine.wire import EngineFailed

ROOT = Path(__file__).resolve().parents[3]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return out


def _is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _accumulate(ticks: list[Any]) -> dict[str, dict[str, Any]]:
    """Each request's output, put together from the steps' additions (replies carry only those)."""
    out: dict[str, dict[str, Any]] = {}
    for tick in ticks:
        for step in tick.outputs:
            acc = out.setdefault(step.request_id, {"token_ids": [], "text": "", "logprobs": []})
            acc["token_ids"] += step.new_token_ids
            acc["text"] += step.new_text
            acc["logprobs"] += step.new_logprobs or []
    return out


async def test_ticks_match_the_in_process_engine_and_a_failing_tick_reports_its_traceback(tiny_model):
    from worker.engine.engine import Engine

    model = tiny_model()
    prompts = ["the engine process", "runs its own steps", "in order"]
    with_logprobs = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    completions = Engine(model=model, max_num_seqs=4).generate(prompts, with_logprobs)
    expected = [c.token_ids for c in completions]
    engine = await EngineProcess.start(EngineConfig(model=model, max_num_seqs=4), 1)
    try:
        assert engine.max_num_seqs == 4
        adds = [(f"r{i}", JobSpec(id=f"r{i}", prompt=p, params=with_logprobs), 0, []) for i, p in enumerate(prompts)]
        ticks = [await engine.tick(adds, [], True)]
        while ticks[-1].num_unfinished:
            ticks.append(await engine.tick([], [], True))
        tick = ticks[-1]
        outputs = _accumulate(ticks)
        for i, completion in enumerate(completions):
            got = outputs[f"r{i}"]
            assert got["token_ids"] == completion.token_ids and got["text"] == completion.text
            assert completion.logprobs is not None and len(got["logprobs"]) == len(completion.logprobs) == 8
            for mine, theirs in zip(got["logprobs"], completion.logprobs):
                assert mine["token_id"] == theirs["token_id"]
                assert mine["logprob"] == pytest.approx(theirs["logprob"], abs=1e-4)
        # A reply carries only the step's additions: never more tokens than the step made.
        assert all(len(out.new_token_ids) <= 1 for t in ticks for out in t.outputs)
        assert tick.stats.num_running == 0 and tick.stats.num_steps >= 8
        # Nothing in a reply may need torch to unpickle: the worker process never imports it.
        assert {type(out).__module__ for out in tick.outputs} == {"worker.engine.wire"}
        assert type(tick.stats).__module__ == "worker.engine.records"
        probe = "import sys, worker.engine.wire, worker.engine.records; assert 'torch' not in sys.modules"
        assert subprocess.run([sys.executable, "-c", probe], cwd=ROOT).returncode == 0

        # Ticks asked for ahead of their replies run in order; a request far larger than the socket's buffers
        # goes out while replies come back.
        again = [(f"p{i}", JobSpec(id=f"p{i}", prompt=p, params=GREEDY), 0, []) for i, p in enumerate(prompts)]
        huge = ("huge", JobSpec(id="huge", prompt_token_ids=[7] * 1_000_000, params=GREEDY), 0, [])
        ahead = [engine.tick(again, [], True)] + [engine.tick([huge] if i == 3 else [], [], True) for i in range(12)]
        ticks = await asyncio.gather(*ahead)
        steps = [t.stats.num_steps for t in ticks]
        assert steps[:8] == list(range(steps[0], steps[0] + 8)) and set(steps[8:]) == {steps[7]}  # then idle
        piped = _accumulate(ticks)
        assert [piped[f"p{i}"]["token_ids"] for i in range(3)] == expected
        # Sent with the fifth tick, it is refused with the reply of the step it was taken into: that one or,
        # when the child read it while earlier ticks were still queued, an earlier one.
        assert [i for i, t in enumerate(ticks) if "huge" in t.rejected] in ([1], [2], [3], [4])
        assert "huge" not in piped

        with pytest.raises(EngineFailed) as failed:
            await engine.tick([("bad", None, 0, [])], [], True)  # type: ignore[list-item]
        assert "AttributeError" in str(failed.value) and "Traceback" in str(failed.value)
        after = await engine.tick([], [], True)  # the child survives a failed tick
        assert after.num_unfinished == 0
    finally:
        await engine.aclose()
    assert engine.process.exitcode == 0


async def test_a_killed_engine_process_fails_the_worker_and_its_jobs_finish_elsewhere(redis_url, tiny_model):
    from worker.engine.engine import Engine

    model = tiny_model()
    # Far more tokens than pass between a job's fourth token and the kill, so none can finish first.
    params = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)
    specs = [JobSpec(id=f"ep-{i}", prompt=f"engine process job {i}", params=params) for i in range(4)]
    client = aioredis.Redis.from_url(redis_url)
    engine = await EngineProcess.start(EngineConfig(model=model, max_num_seqs=4), 1)
    async with running_worker(redis_url, engine, lease_s=1.0, checkpoint_tokens=4) as service:
        for spec in specs:
            await xadd_job(client, spec)
        await wait_until(lambda: any(len(job.token_ids) >= 4 for job in service.job_loop.jobs.values()),
                         "a job with 4 tokens")
        os.kill(engine.pid, signal.SIGKILL)
        await asyncio.wait_for(service.stopped.wait(), WAIT_S)
        assert service.has_failed
        statuses = [await client.hget(KEYS.job(s.id), "status") for s in specs]
        assert b"succeeded" not in statuses
    assert engine.process.exitcode == -signal.SIGKILL
    # A worker stopped by its engine's failure is no clean stop: its hand-back is not counted on the records,
    # so the delivery counts against --max-deliveries, as a crash's would, and a crash loop ends.
    assert {await client.hget(KEYS.job(s.id), "handbacks") for s in specs} <= {None, b"0"}
    rescuer = Engine(model=model, max_num_seqs=4)
    async with running_worker(redis_url, rescuer, lease_s=1.0):
        views = await wait_terminal(client, [s.id for s in specs])
    assert {v["status"] for v in views.values()} == {"succeeded"}
    assert all(len(v["output"]["token_ids"]) == params.max_tokens for v in views.values())
    await client.aclose()


async def test_an_idle_worker_finds_its_killed_engine_process_at_once(redis_url, tiny_model, caplog):
    """No job runs, so no tick waits on the engine: the worker still notices within a second or so, and the
    death is said once (the loop's failure), not again for each tick it failed."""
    engine = await EngineProcess.start(EngineConfig(model=tiny_model(), max_num_seqs=2), 1)
    with caplog.at_level("ERROR"):
        async with running_worker(redis_url, engine) as service:
            os.kill(engine.pid, signal.SIGKILL)
            await asyncio.wait_for(service.stopped.wait(), 30)
            assert service.has_failed
    said = [r for r in caplog.records if r.exc_info and "exited with code -9" in str(r.exc_info[1])]
    assert len(said) == 1, [r.getMessage() for r in said]


def _worker(redis_url: str, model: str, name: str) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "worker.cli", "worker", "--redis-url", redis_url, "--model", model,
            "--worker-name", name, "--metrics-port", "0", "--max-num-seqs", "4"]
    env = {**os.environ, "PYTHONPATH": child_pythonpath(ROOT)}
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def _wait_ready(client: aioredis.Redis, worker: subprocess.Popen[bytes], name: str) -> None:
    """Until worker `name` (a `_worker` process) has written its first heartbeat; fails, with its stderr, if it
    exits first."""
    async def is_ready() -> bool:
        assert worker.poll() is None, worker.stderr.read().decode() if worker.stderr else ""
        return bool(await client.hexists(KEYS.workers, name))

    await wait_until(is_ready, f"worker {name} ready")


async def test_a_sigkilled_worker_leaves_no_engine_process_behind(redis_url, tiny_model):
    client = aioredis.Redis.from_url(redis_url)
    worker = _worker(redis_url, tiny_model(), "short-lived")
    try:
        await _wait_ready(client, worker, "short-lived")
        children = _children(worker.pid)  # the engine, and multiprocessing's resource tracker
        assert any(b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes() for c in children)
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        await wait_until(lambda: all(_is_gone(c) for c in children), f"child processes {children} gone with their worker")
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        await client.aclose()


async def test_the_engine_process_logs_json_lines_as_its_worker_does(redis_url, tiny_model):
    """Its start-up lines (which implementation serves the model, the draft model's warnings) are the worker's
    log too: JSON lines with the worker's service name, not lost nor printed bare."""
    client = aioredis.Redis.from_url(redis_url)
    worker = _worker(redis_url, tiny_model(), "logging")
    try:
        await _wait_ready(client, worker, "logging")
        worker.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.get_running_loop().run_in_executor(None, lambda: worker.communicate(timeout=WAIT_S))
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        await client.aclose()
    lines = [line for line in stderr.decode().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is JSON
    chosen = [r for r in records if r["logger"] == "worker.engine.model_runner" and "implementation" in r["message"]]
    assert chosen and chosen[0]["service"] == "carpool-worker" and chosen[0]["level"] == "info", records


async def test_a_bad_model_path_fails_startup_with_a_clear_error(redis_url, tmp_path):
    missing = tmp_path / "no-such-model"  # a directory with a config.json that names no model
    missing.mkdir()
    (missing / "config.json").write_text("{}")
    worker = _worker(redis_url, str(missing), "doomed")
    _, stderr = await asyncio.get_running_loop().run_in_executor(None, lambda: worker.communicate(timeout=WAIT_S))
    assert worker.returncode == 1
    assert "cannot start the engine" in stderr.decode() and str(missing) in stderr.decode()
    with pytest.raises(EngineStartError):
        await EngineProcess.start(EngineConfig(model=str(missing)), 1)


def test_jobs_and_aborts_sent_with_later_ticks_join_the_step_about_to_run(tiny_model):
    """Every tick is in the socket before the child reads one, so what it takes in ahead is fixed by
    construction: the third tick's job runs in the first step, and its abort of the first tick's job comes
    after that job's add, as it was sent."""
    import multiprocessing
    import socket

    from worker.engine.process import _receive, frame, serve_engine
    from worker.engine.wire import EngineReady, TickRequest

    ours, theirs = socket.socketpair()
    first = ("a", JobSpec(id="a", prompt="sent first", params=GREEDY), 0, [])
    later = ("b", JobSpec(id="b", prompt="sent two ticks later",
                          params=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)), 0, [])
    for request in (TickRequest([first], [], True), TickRequest([], [], True), TickRequest([later], ["a"], True), None):
        ours.sendall(frame(request))
    child = multiprocessing.get_context("spawn").Process(
        target=serve_engine, args=(theirs, EngineConfig(model=tiny_model(), max_num_seqs=4), 1, os.getpid()))
    child.start()
    theirs.close()
    try:
        assert isinstance(_receive(ours), EngineReady)  # type: ignore[arg-type]
        ticks = [_receive(ours) for _ in range(3)]
        with pytest.raises(EOFError):
            _receive(ours)  # the stop: the child has exited
    finally:
        child.join(WAIT_S)
        ours.close()
    assert child.exitcode == 0
    outputs = [{out.request_id: out for out in tick.outputs} for tick in ticks]  # type: ignore[union-attr]
    # "a" was aborted before any step ran: it ends with the first reply, having computed nothing.
    assert outputs[0]["a"].finished and outputs[0]["a"].finish_reason == "abort" and not outputs[0]["a"].new_token_ids
    # "b" took the first step (its prefill) and each tick after it a token: three tokens in three replies.
    assert [len(o["b"].new_token_ids) for o in outputs] == [1, 1, 1] and outputs[2]["b"].finished
    assert [tick.num_unfinished for tick in ticks] == [1, 1, 0]  # type: ignore[union-attr]


def test_a_step_output_crosses_the_socket_with_every_field() -> None:
    """`StepOutput` pickles as its fields in order: each field, whatever it is, comes back as it was."""
    import dataclasses
    import pickle

    from worker.engine.wire import StepOutput

    out = StepOutput("job-1", [5, 6], "text", [{"token_id": 5, "logprob": -0.5, "top_logprobs": []}], True,
                     "stop", 7, 3)
    assert len({repr(getattr(out, f.name)) for f in dataclasses.fields(out)}) == len(dataclasses.fields(out))
    assert pickle.loads(pickle.dumps(out)) == out
