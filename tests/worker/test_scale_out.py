"""Scale-out: several `carpool worker` processes on one Redis share the lanes fairly and safely.

Each worker is a real subprocess (`python -m worker.cli worker`) on a tiny
model, started the way a container starts it, and ready once its `/readyz`
says so. Jobs are XADDed straight onto the lane streams, as a direct producer
would.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
import redis

from gateway.cli.embedded_redis import EmbeddedRedis, free_port
from scheduler.protocol.job_record import job_view
from scheduler.protocol.keys import CONSUMER_GROUP, Keys
from tests.harness.child_env import child_pythonpath

REPO = Path(__file__).resolve().parents[2]
KEYS = Keys()
STARTUP_TIMEOUT_S = 240.0
WAIT_S = 240.0
"""Waits are on conditions; the limit only turns a hang into a failure with the workers' logs."""


@dataclass
class WorkerProcess:
    name: str
    proc: subprocess.Popen[bytes]
    metrics_port: int
    log_path: Path

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


def _is_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def worker_processes(redis_url: str, model: str, tmp_path: Path, count: int, **flags: object) -> Iterator[list[WorkerProcess]]:
    """Start `count` workers, wait for every `/readyz`, and stop them (SIGTERM, then SIGKILL) at the end."""
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
    workers: list[WorkerProcess] = []
    try:
        for i in range(count):
            name, port = f"w{i}", free_port()
            args = [sys.executable, "-m", "worker.cli", "worker", "--redis-url", redis_url, "--model", model,
                    "--device", "cpu", "--worker-name", name, "--metrics-host", "127.0.0.1",
                    "--metrics-port", str(port), "--log-level", "WARNING"]
            for key, value in flags.items():
                args += [f"--{key.replace('_', '-')}", str(value)]
            log_path = tmp_path / f"{name}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            workers.append(WorkerProcess(name, proc, port, log_path))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for worker in workers:
            while not _is_ready(worker.metrics_port):
                assert worker.proc.poll() is None, f"{worker.name} exited:\n{worker.log_tail()}"
                assert time.monotonic() < deadline, f"{worker.name} not ready:\n{worker.log_tail()}"
                time.sleep(0.1)
        yield workers
    finally:
        for worker in workers:
            if worker.proc.poll() is None:
                worker.proc.send_signal(signal.SIGTERM)
        for worker in workers:
            try:
                worker.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()


def enqueue(client: redis.Redis, job_id: str, lane: str, max_tokens: int, reply_to: str) -> None:
    job = {"v": 1, "id": job_id, "prompt": f"job {job_id} says hello", "lane": lane, "reply_to": reply_to,
           "params": {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}}
    client.xadd(KEYS.lane(lane), {"job": msgpack.packb(job, use_bin_type=True)})


def records(client: redis.Redis, ids: list[str]) -> dict[str, dict[bytes, bytes]]:
    """Every record in one round trip, so a snapshot is never tens of milliseconds old."""
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        pipe.hgetall(KEYS.job(job_id))
    return dict(zip(ids, pipe.execute()))


def wait_until(condition: Callable[[], bool], what: str, workers: list[WorkerProcess]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {w.name}\n{w.log_tail()}" for w in workers)
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.01)


def count_finished(client: redis.Redis, ids: list[str]) -> int:
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        pipe.hget(KEYS.job(job_id), "status")
    return sum(s in (b"succeeded", b"failed", b"cancelled", b"expired") for s in pipe.execute())


@pytest.fixture(scope="module")
def three_workers(
    redis_server: EmbeddedRedis, tiny_model: Callable[..., str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[WorkerProcess]]:
    """Three workers shared by this module's tests (starting them is most of the cost).

    The tests run in file order; the last one kills `w0`. A short lease lets the
    killed worker's jobs be reclaimed within the test.
    """
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    with worker_processes(redis_server.url, tiny_model(), tmp_path_factory.mktemp("workers"), 3,
                          max_num_seqs=4, lease_s=2.0) as workers:
        yield workers


@pytest.mark.slow
def test_interactive_trickle_is_served_first_on_every_worker(
    three_workers: list[WorkerProcess], redis_server: EmbeddedRedis
) -> None:
    workers = three_workers
    client = redis.Redis.from_url(redis_server.url)
    batch_ids = [f"batch-{n:03d}" for n in range(120)]
    interactive_ids = [f"inter-{n:03d}" for n in range(24)]
    for job_id in batch_ids:
        enqueue(client, job_id, "batch", max_tokens=24, reply_to="scale-out:lanes:replies")
    # A trickle while the batch backlog is still queued: one interactive job each time another batch job ends,
    # paced by the workers' progress rather than the clock, so the backlog outlasts it at any engine speed.
    for n, job_id in enumerate(interactive_ids):
        wait_until(lambda: count_finished(client, batch_ids) >= 6 + n, f"{6 + n} batch jobs done", workers)
        enqueue(client, job_id, "interactive", max_tokens=4, reply_to="scale-out:lanes:replies")
    all_ids = batch_ids + interactive_ids
    wait_until(lambda: count_finished(client, all_ids) == len(all_ids), "all jobs", workers)
    final = records(client, all_ids)

    views = {job_id: job_view(record) for job_id, record in final.items()}
    assert {v["status"] for v in views.values()} == {"succeeded"}

    def wait_s(job_id: str) -> float:
        record = final[job_id]
        return float(record[b"started_at"]) - float(record[b"created_at"])

    last_interactive_created = max(float(final[i][b"created_at"]) for i in interactive_ids)
    still_queued = [b for b in batch_ids if float(final[b][b"started_at"]) > last_interactive_created]
    assert len(still_queued) >= 10, "the trickle must arrive while batch work is still waiting"
    for worker in ("w0", "w1", "w2"):
        mine_interactive = [wait_s(i) for i in interactive_ids if views[i]["worker"] == worker]
        mine_batch = [wait_s(b) for b in batch_ids if views[b]["worker"] == worker]
        assert mine_interactive and mine_batch, (worker, len(mine_interactive), len(mine_batch))
        assert statistics.mean(mine_interactive) < statistics.mean(mine_batch), (worker, mine_interactive, mine_batch)
        # Batch jobs queued for as long as the backlog lasted; interactive ones only until the next free slot.
        assert max(mine_interactive) < statistics.median(mine_batch), (worker, mine_interactive, mine_batch)
    client.close()


@pytest.mark.slow
def test_three_workers_share_150_jobs_and_a_killed_one_loses_nothing(
    three_workers: list[WorkerProcess], redis_server: EmbeddedRedis
) -> None:
    workers = three_workers
    client = redis.Redis.from_url(redis_server.url)
    ids = [f"share-{n:03d}" for n in range(150)]
    replies_stream = "scale-out:share:replies"
    # Long enough that the backlog lasts a while: w0 is frozen and killed holding jobs (below), whatever the speed.
    num_tokens = 64
    for job_id in ids:
        enqueue(client, job_id, "standard", max_tokens=num_tokens, reply_to=replies_stream)
    victim = workers[0]
    assert victim.proc.poll() is None, "this test kills w0, so it runs last"

    def victims() -> Counter[bytes | None]:
        return Counter(r.get(b"status") for r in records(client, ids).values()
                       if r.get(b"worker") == victim.name.encode())

    # Kill it mid-run: after it finished a few jobs, at a moment it holds some. It is frozen (SIGSTOP) before its
    # jobs are read, so what it holds cannot change between that read and the kill, at any engine speed; when it
    # happens to hold none at that moment (between two jobs), it goes on and we try again.
    while True:
        wait_until(lambda: (held := victims())[b"succeeded"] >= 3 and held[b"running"] > 0,
                   f"{victim.name} to finish 3 jobs and hold more", workers)
        victim.proc.send_signal(signal.SIGSTOP)
        running = [i for i, r in records(client, ids).items()
                   if r.get(b"status") == b"running" and r.get(b"worker") == victim.name.encode()]
        if running:
            break
        victim.proc.send_signal(signal.SIGCONT)
    victim.proc.send_signal(signal.SIGKILL)  # no drain, no hand-back: a crash
    victim.proc.wait(timeout=10)

    wait_until(lambda: count_finished(client, ids) == len(ids), "all 150 jobs to finish", workers)
    final = records(client, ids)
    replies = client.xrange(replies_stream)

    views = {job_id: job_view(record) for job_id, record in final.items()}
    assert Counter(v["status"] for v in views.values()) == {"succeeded": 150}
    assert all(len(v["output"]["token_ids"]) == num_tokens for v in views.values())
    by_worker = Counter(v["worker"] for v in views.values())
    assert set(by_worker) == {"w0", "w1", "w2"} and min(by_worker.values()) >= 3, by_worker
    # Exactly one result per job: each job committed once, however many workers touched it.
    reply_ids = [msgpack.unpackb(fields[b"result"], raw=False)["id"] for _, fields in replies]
    assert sorted(reply_ids) == ids
    # The jobs the killed worker held were finished by the others, after a reclaim.
    for job_id in running:
        assert views[job_id]["worker"] in ("w1", "w2"), job_id
        assert int(final[job_id][b"attempts"]) >= 2, job_id
    # Nothing left behind: every lane entry acknowledged and deleted, nothing dead-lettered.
    for stream in KEYS.lanes():
        assert client.xlen(stream) == 0, stream
        assert client.xpending(stream, CONSUMER_GROUP)["pending"] == 0, stream
    assert client.xlen(KEYS.dead) == 0
    client.close()
