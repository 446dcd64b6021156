"""Commits of decided job outcomes, each on its own task, owned until it ends."""

from __future__ import annotations

import asyncio
import logging

from scheduler.telemetry.log_format import job_context
from scheduler.telemetry.otel import span_of_traceparent
from worker.job_store import JobStore, Outcome
from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class CommitTasks:
    def __init__(self, store: JobStore, metrics: WorkerMetrics) -> None:
        self.store = store
        self.metrics = metrics
        self.num_finished = 0
        self._commits: set[asyncio.Task[None]] = set()

    def spawn(self, outcome: Outcome) -> None:
        task = asyncio.get_running_loop().create_task(self._commit(outcome), name=f"commit {outcome.job_id}")
        self._commits.add(task)
        task.add_done_callback(self._reap)

    async def _commit(self, outcome: Outcome) -> None:
        span = outcome.trace.span if outcome.trace is not None else span_of_traceparent(outcome.traceparent)
        with job_context(outcome.job_id, span):
            with self.metrics.publish_span(outcome.trace):
                won = await self.store.commit(outcome)  # shielded inside
            self.num_finished += 1
            if outcome.trace is not None:
                self.metrics.job_committed(outcome, won)
            log.info("job %s: %s%s", outcome.job_id, outcome.status.value, "" if won else " (already decided elsewhere)")

    def _reap(self, task: asyncio.Task[None]) -> None:
        self._commits.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # The entry stays pending: after the lease it is redelivered and the job committed then.
            log.error("commit failed; the job will be redelivered", exc_info=task.exception())

    async def wait(self) -> None:
        while self._commits:
            await asyncio.gather(*list(self._commits), return_exceptions=True)
