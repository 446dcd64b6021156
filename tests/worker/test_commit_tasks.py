"""A job's commit against a Redis that cannot be reached: its entry is held from the moment the job ends, and a
commit still waiting when the worker gives up is counted, so the worker can say its job will run again."""

from __future__ import annotations

import asyncio
import socket
import time

import redis.asyncio as aioredis

from scheduler.protocol.job import JobStatus
from scheduler.protocol.keys import Keys
from scheduler.protocol.redis_client import connect
from worker.commit_tasks import CommitTasks
from worker.job_store import EntryRef, JobStore, Outcome
from worker.metrics import WorkerMetrics


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_commit_holds_its_entry_until_written_or_given_up() -> None:
    client: aioredis.Redis = connect(f"redis://127.0.0.1:{closed_port()}/0")  # nothing listens there
    store = JobStore(client, Keys(), worker="w1", result_ttl_s=60, reply_maxlen=10, dead_maxlen=10)
    commits = CommitTasks(store, WorkerMetrics())
    entry = EntryRef("carpool:lane:standard", "1-0")
    commits.spawn(Outcome("j1", JobStatus.SUCCEEDED, entry, output={"text": "x", "token_ids": [1]}))
    # Before any attempt has failed: the job has left the running set, and its entry must not look free.
    assert entry in commits.retrying
    await asyncio.sleep(1.2)  # a few attempts, each refused
    assert entry in commits.retrying and commits.num_given_up == 0
    commits.give_up_at = time.monotonic()
    await commits.wait()
    assert entry not in commits.retrying and commits.num_given_up == 1
    await client.aclose()
