"""Commits of decided job outcomes, each on its own task, owned until it ends."""

from __future__ import annotations

import asyncio
import logging
import time

from scheduler.telemetry.log_format import job_context
from scheduler.telemetry.otel import span_of_traceparent
from worker.job_store import EntryRef, JobStore, Outcome
from worker.metrics import WorkerMetrics
from worker.redis_errors import RetryDelay, is_redis_down, outage_log

log = logging.getLogger(__name__)


class CommitTasks:
    def __init__(self, store: JobStore, metrics: WorkerMetrics) -> None:
        self.store = store
        self.metrics = metrics
        self.num_finished = 0
        self._commits: set[asyncio.Task[None]] = set()
        self._outages = outage_log(log)
        self.retrying: set[EntryRef] = set()
        """Entries of the commits not written yet: their leases are renewed with the running jobs', and this
        worker's own reclaim leaves them alone (the job is done; only its result waits for Redis)."""
        self.give_up_at: float | None = None
        """Set at shutdown (monotonic seconds): commits waiting for Redis stop trying then."""
        self.num_given_up = 0
        """Commits that stopped trying at `give_up_at`: their entries are left to the lease, and run again."""

    def spawn(self, outcome: Outcome) -> None:
        if outcome.entry is not None:
            self.retrying.add(outcome.entry)  # from now, not from a first failure: the job left `jobs` already
        task = asyncio.get_running_loop().create_task(self._commit(outcome), name=f"commit {outcome.job_id}")
        self._commits.add(task)
        task.add_done_callback(self._reap)

    async def _commit(self, outcome: Outcome) -> None:
        span = outcome.trace.span if outcome.trace is not None else span_of_traceparent(outcome.traceparent)
        with job_context(outcome.job_id, span):
            with self.metrics.publish_span(outcome.trace):
                won = await self._write(outcome)
            self.num_finished += 1
            if outcome.trace is not None:
                self.metrics.job_committed(outcome, won)
            log.info("job %s: %s%s", outcome.job_id, outcome.status.value, "" if won else " (already decided elsewhere)")

    async def _write(self, outcome: Outcome) -> bool:
        """Commit, trying again while Redis is unavailable, the entry's lease renewed meanwhile: a commit is safe
        to repeat (only the first terminal write decides; a repeat only acknowledges the entry), and a finished
        job is then neither run again from its last checkpoint nor counted as redelivered. It goes on even if
        another worker took the entry while Redis was away: whichever result is written first decides the job,
        and the other worker drops its run at its next renewal."""
        entry = outcome.entry
        delay = RetryDelay()
        try:
            while True:
                try:
                    won = await self.store.commit(outcome)  # shielded inside
                    self._outages.recovered()
                    return won
                except Exception as e:
                    if not is_redis_down(e) or entry is None:
                        raise
                    if self.give_up_at is not None and time.monotonic() >= self.give_up_at:
                        self.num_given_up += 1
                        raise
                    self._outages.warn("commits", e, f"job {outcome.job_id} waits to be written")
                    wait_s = delay.after(e)
                    if self.give_up_at is not None:  # not past the shutdown's deadline for commits
                        wait_s = min(wait_s, max(self.give_up_at - time.monotonic(), 0.0))
                await asyncio.sleep(wait_s)
        finally:
            if entry is not None:
                self.retrying.discard(entry)

    def _reap(self, task: asyncio.Task[None]) -> None:
        self._commits.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # The entry stays pending: after the lease it is redelivered and the job committed then.
            log.error("commit failed; the job will be redelivered", exc_info=task.exception())

    async def wait(self) -> None:
        while self._commits:
            await asyncio.gather(*list(self._commits), return_exceptions=True)
