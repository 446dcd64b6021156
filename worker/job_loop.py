"""The bridge between jobs and the engine.

The engine's steps are long, so they run off the event loop: in a child
process (``worker.engine.process``) or on one dedicated thread
(``worker.engine.tick.EngineThread``). The event loop keeps Redis I/O and
lease renewal going meanwhile; it hands each tick the requests to add and
abort, and gets back the outputs of one step. After each step: token events
and due checkpoints go out in one pipeline, then finished jobs are committed;
the next step already runs in the engine meanwhile, and the one after it is
already asked for.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import deque
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from scheduler.protocol.job import JobSpec, JobStatus, WebhookEvent
from scheduler.protocol.job_record import EventType, job_view
from scheduler.protocol.keys import Keys
from scheduler.protocol.lanes import Lane, engine_priority
from scheduler.protocol.redis_replies import read_hash
from scheduler.protocol.webhooks import OutputThrottle, delivery_fields, running_view
from scheduler.runtime.outage_log import describe
from scheduler.runtime.tasks import raise_if_cancelled
from scheduler.telemetry.log_format import job_context
from worker.commit_tasks import CommitTasks
from worker.config import WorkerConfig
from worker.engine.records import EngineStats
from worker.engine.wire import EngineFailed, EngineRunner, Tick
from worker.job_store import EntryRef, JobStore, pack
from worker.metrics import WorkerMetrics
from worker.redis_errors import is_redis_down, outage_log
from worker.running_job import RunningJob, outcome_of, output_of
from worker.step_writes import (CHECKPOINT_CANCEL_FLAGGED, CHECKPOINT_NO_RECORD, CHECKPOINT_NOT_OURS, StepWriter,
                                StepWrites)

log = logging.getLogger(__name__)

IDLE_STEP_SLEEP_S = 0.002
TICKS_IN_FLIGHT = 2
"""Ticks handed to the engine before the oldest one's reply is read (see ``JobLoop.run``)."""
ENGINE_CHECK_S = 1.0
"""How often an idle loop looks whether its engine (process) is still there."""
ABORT_WAIT_S = 5.0
"""How long a shutdown waits for the engine to drop the jobs it hands back."""



class JobLoop:
    def __init__(self, engine: EngineRunner, store: JobStore, client: aioredis.Redis, keys: Keys,
                 config: WorkerConfig, metrics: WorkerMetrics | None = None) -> None:
        self.engine = engine
        """The engine, wherever it runs (its process, or a thread here): ticked, never called directly."""
        self.metrics = metrics or WorkerMetrics(max_num_seqs=engine.max_num_seqs)
        self.store = store
        self.client = client
        self.keys = keys
        self.config = config
        self.step_writer = StepWriter(client, keys, store.worker)
        self.jobs: dict[str, RunningJob] = {}
        self.stats: EngineStats | None = None
        self._reserved = 0
        self._adds: list[tuple[RunningJob, int]] = []
        self._aborts: list[str] = []
        self._in_flight: deque[tuple[asyncio.Future[Tick], bool]] = deque()
        """Ticks handed to the engine whose replies are not read yet, in order, each with whether it steps."""
        self._work = asyncio.Event()
        self.slot_freed = asyncio.Event()
        self.commits = CommitTasks(store, self.metrics)
        self._outages = outage_log(log)

    # --- capacity ----------------------------------------------------------------

    @property
    def free(self) -> int:
        return max(0, self.config.capacity - len(self.jobs) - self._reserved)

    @property
    def interactive_free(self) -> int:
        """Interactive jobs that may still be taken beyond the free slots (``WorkerConfig.reserve``)."""
        return max(0, self.config.capacity + self.config.reserve - len(self.jobs) - self._reserved)

    def reserve(self, n: int) -> None:
        """Slots held for entries being admitted, so a concurrent read cannot overfill."""
        self._reserved += n

    def release(self, n: int) -> None:
        self._reserved -= n
        assert self._reserved >= 0
        self.slot_freed.set()

    def entries(self) -> list[EntryRef]:
        return [job.entry for job in self.jobs.values()]

    # --- intake --------------------------------------------------------------------

    def start(self, spec: JobSpec, entry: EntryRef, checkpoint: list[int], enqueued_s: float,
              record: dict[bytes, bytes] | None = None,
              checkpoint_logprobs: list[dict[str, Any]] | None = None, attempt: int = 1) -> None:
        """Queue a job for the engine; it is added at the start of the next tick. `enqueued_s` is the Unix time of
        its entry's first XADD (the intake's reading, which follows an entry moved into its tenant's stream)."""
        assert spec.id not in self.jobs
        job = RunningJob(spec=spec, entry=entry, resumed_from=len(checkpoint), token_ids=list(checkpoint),
                         checkpointed=len(checkpoint), record=record or {}, attempt=attempt)
        if checkpoint_logprobs is not None and len(checkpoint_logprobs) == len(checkpoint):
            job.resumed_logprobs = list(checkpoint_logprobs)
        if spec.webhook is not None and spec.webhook.wants(WebhookEvent.OUTPUT):
            job.throttle = OutputThrottle(self.config.webhook_output_interval_s)
        job.trace = self.metrics.job_started(spec, enqueued_s, resumed_from=len(checkpoint))
        self.jobs[spec.id] = job
        priority = engine_priority(spec.lane, spec.priority)
        self._adds.append((job, priority))
        self._work.set()
        if spec.lane is Lane.INTERACTIVE and self._in_flight:
            # The engine is busy with ticks already sent: hand it this job now, in a tick of its own that does
            # not step. The engine process takes in ticks sent ahead before its next step (see
            # ``worker.engine.process``), so the job joins the step after the one running, not the one after
            # the ticks in flight.
            self._in_flight.append((self._send_tick(do_step=False), False))

    def cancel(self, job_id: str) -> bool:
        """Stop a job we run at the next step and commit it as cancelled."""
        job = self.jobs.get(job_id)
        if job is None:
            return False
        with job_context(job_id, job.trace.span if job.trace is not None else None):
            log.info("job %s: cancelled while running, after %d output tokens", job_id, len(job.token_ids))
        self._abort(job_id)
        # The text and tokens produced until now stay on the record (the finish_reason of an aborted request).
        self.commits.spawn(outcome_of(job, JobStatus.CANCELLED, output=output_of(job, "abort"), error={
            "type": "cancelled", "message": "cancelled while running"}))
        return True

    def drop(self, job_id: str, why: str) -> None:
        """Forget a job without committing anything (it is not ours to finish any more: `why`)."""
        job = self.jobs.get(job_id)
        if job is not None:
            with job_context(job_id, job.trace.span if job.trace is not None else None):
                log.warning("job %s: %s; stopping our copy", job_id, why)
            self._abort(job_id)

    def _abort(self, job_id: str) -> None:
        del self.jobs[job_id]
        self._aborts.append(job_id)
        self._work.set()
        self.slot_freed.set()

    # --- engine ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Step the engine while it has work; wait for work otherwise. Cancelled at shutdown.

        ``TICKS_IN_FLIGHT`` ticks are handed to the engine ahead of their replies, so it starts
        step N+1 as soon as step N is done, without waiting for this loop to read step N. Step N's
        events are written while step N+1 runs. Step N's handling always ends before step N+1's
        begins: events stay in order per job and finished jobs are committed after their last token
        events. What a step's handling decides (new jobs in freed slots, a checkpoint reply saying
        "drop" or "cancel") goes out with the tick after the one already in flight (the engine
        process takes it in before its next step, see ``worker.engine.process``); the output of a
        job that is no longer ours is ignored. A new interactive job does not wait for a reply: it goes
        out at once, in a tick that does not step (``start``), and joins the next step.
        """
        loop = asyncio.get_running_loop()
        num_unfinished = 0
        handling: asyncio.Task[None] | None = None
        in_flight = self._in_flight
        try:
            while True:
                raise_if_cancelled()
                if not in_flight and num_unfinished == 0 and not self._adds and not self._aborts:
                    if handling is not None:
                        # The last step's handling may still queue aborts; settle it before going idle.
                        pending, handling = handling, None
                        await pending
                        continue
                    self._work.clear()
                    await self._idle()
                    # Admission window: an idle engine waits briefly so jobs arriving together start together.
                    if self.config.engine.max_wait_ms > 0 and self.free > 0:
                        await asyncio.sleep(self.config.engine.max_wait_ms / 1000)
                while sum(does_step for _, does_step in in_flight) < TICKS_IN_FLIGHT and (
                        not in_flight or num_unfinished or self._adds or self._aborts):
                    in_flight.append((self._send_tick(), True))
                if handling is not None:
                    pending, handling = handling, None
                    await pending
                future, did_step = in_flight[0]
                tick = await self._answer(future)
                in_flight.popleft()
                num_unfinished = tick.num_unfinished
                self.stats = tick.stats
                self.metrics.record_step(tick.stats)
                handling = loop.create_task(self._handle(tick), name="step events")
                if did_step and num_unfinished and not tick.outputs and tick.stats.last_step_num_seqs == 0:
                    await asyncio.sleep(IDLE_STEP_SLEEP_S)  # the engine holds work back (dynamic batching window)
        finally:
            # Cancelling a tick only stops the wait for it; one that already failed is reported here, once for each
            # failure (a dead engine process fails every tick out with one error), none for the one being raised.
            said = {id(sys.exc_info()[1])}
            for future, _ in in_flight:
                if not future.cancel() and not future.cancelled() and future.exception() is not None:
                    if id(future.exception()) not in said:
                        said.add(id(future.exception()))
                        log.error("an engine tick failed", exc_info=future.exception())
            in_flight.clear()
            # Only a step's handling not yet awaited is left here (cancelled in the idle sleep).
            if handling is not None:
                handling.cancel()
                [result] = await asyncio.gather(handling, return_exceptions=True)
                if isinstance(result, Exception):
                    log.error("handling the last engine step failed", exc_info=result)

    async def _idle(self) -> None:
        """Wait for work; an engine that dies meanwhile (its process killed) fails the loop now, not at the next job."""
        while not self._work.is_set():
            if self.engine.failure is not None:
                raise self.engine.failure
            try:
                await asyncio.wait_for(self._work.wait(), timeout=ENGINE_CHECK_S)
            except TimeoutError:
                pass

    async def _answer(self, future: asyncio.Future[Tick]) -> Tick:
        """A tick's answer; an engine that gives none for ``--engine-stall-s`` is hung, and fails the loop."""
        stall_s = self.config.engine_stall_s
        try:
            async with asyncio.timeout(stall_s):  # one timer per step; the tick is given up with the engine
                return await future
        except TimeoutError:
            raise EngineFailed(f"the engine answered no step for {stall_s:g}s (--engine-stall-s): hung, or its process "
                               "stopped") from None

    def _send_tick(self, do_step: bool = True) -> asyncio.Future[Tick]:
        """Hand the engine the jobs queued since the last tick, the aborts, and one step (unless not ``do_step``)."""
        adds = [(job.spec.id, job.spec, priority, job.token_ids) for job, priority in self._adds]
        now = time.time()
        for job, _ in self._adds:
            if job.trace is not None:
                job.trace.admitted(now)
        self._adds, aborts, self._aborts = [], self._aborts, []
        return self.engine.tick(adds, aborts, do_step)

    async def _handle(self, tick: Tick) -> None:
        for job_id, rejection in tick.rejected.items():
            job = self.jobs.pop(job_id, None)
            if job is not None:
                self.slot_freed.set()
                job.num_prompt_tokens = rejection.num_prompt_tokens
                error = rejection.error
                if error.get("field") == "prompt" and job.spec.prompt_token_ids is not None:
                    # The engine's `prompt` is the job message's `prompt_token_ids` here: name the field it sent.
                    error = {**error, "field": "prompt_token_ids",
                             "message": "prompt_token_ids" + error["message"].removeprefix("prompt")}
                self.commits.spawn(outcome_of(job, JobStatus.FAILED, error=error, is_refused=True))
        now, mono = time.time(), time.monotonic()
        writes = StepWrites()
        checkpointed: list[tuple[int, RunningJob, int]] = []
        finished: list[tuple[RunningJob, Any]] = []
        for out in tick.outputs:
            job = self.jobs.get(out.request_id)
            if job is None:
                continue  # aborted while the step ran
            job.num_prompt_tokens = out.num_prompt_tokens
            job.num_cached_tokens = out.num_cached_tokens or 0
            # Outputs carry only what the step added (a reply's size must not grow with the output); the
            # lists here are extended in place, and every reader packs them at once.
            new_ids = list(out.new_token_ids)
            job.token_ids += new_ids
            # The engine's text only grows while a job runs (a possible stop string is held back), so the
            # event carries just what is new; the final record holds the whole text.
            job.text_buffer.append(out.new_text)
            if out.new_logprobs is not None:
                job.engine_logprobs += out.new_logprobs
            if new_ids:
                if job.first_token_at is None:
                    job.first_token_at = now
                gap_s = None if job.last_token_mono is None else mono - job.last_token_mono
                self.metrics.tokens_emitted(job.spec.lane.value, gap_s, len(new_ids))
                job.last_token_mono = mono
                # `index` and `text_index` place the event in the output: a resumed job's first event starts at
                # its checkpoint's tokens but carries the text from the start, so subscribers de-duplicate each.
                writes.publish(job.spec.id, pack({
                    "type": EventType.TOKEN, "id": job.spec.id, "text": out.new_text, "token_ids": new_ids,
                    "index": len(job.token_ids) - len(new_ids), "text_index": job.text_buffer.length - len(out.new_text),
                    "attempt": job.attempt}))
                if job.throttle is not None and not out.finished and job.throttle.should_emit(mono):
                    partial = running_view(job.record, job.text, job.token_ids,
                                           first_token_at=job.first_token_at, resumed_from=job.resumed_from)
                    assert job.spec.webhook is not None
                    writes.deliver(job.spec.id, delivery_fields(
                        job.spec.id, WebhookEvent.OUTPUT, job.spec.webhook.url, partial,
                        traceparent=job.trace.traceparent if job.trace is not None else job.spec.traceparent))
            if out.finished:
                finished.append((job, out))
            elif self._checkpoint_due(job, mono):
                checkpointed.append((writes.checkpoint(job.spec.id, job.token_ids, job.first_token_at, job.logprobs,
                                                       job.text, job.num_prompt_tokens),
                                     job, len(job.token_ids)))
        replies: list[int] = []
        try:
            replies = await self.step_writer.write(writes)
        except (RedisError, OSError) as e:
            # Token events are best effort; a checkpoint is only late: its job stays due, so the next step
            # writes it again (the first one included, which live views and cancels over the record wait on).
            if is_redis_down(e):  # then every step meets it: said once in a while, not once a step
                self._outages.warn(f"worker {self.store.worker} step writes", e,
                                   "token events and checkpoints wait for the next steps")
            else:
                log.warning("token events and checkpoints of this step not written: %s", describe(e))
            checkpointed = []
        else:
            if len(writes):  # a step with nothing to write asked Redis nothing: it says nothing of an outage's end
                self._outages.recovered()
        for index, job, num_tokens in checkpointed:
            job.checkpointed, job.checkpoint_at = num_tokens, mono
            if job.spec.id not in self.jobs:
                continue
            if replies[index] == CHECKPOINT_NOT_OURS:
                self.drop(job.spec.id, "its record says it is not running here (another worker took it over)")
            elif replies[index] == CHECKPOINT_NO_RECORD:
                self.drop(job.spec.id, "its record is gone (deleted, or lost by Redis: a restart without persistence?)")
            elif replies[index] == CHECKPOINT_CANCEL_FLAGGED:
                self.cancel(job.spec.id)
        for job, out in finished:
            if self.jobs.pop(job.spec.id, None) is None:
                continue
            self.slot_freed.set()
            self.commits.spawn(outcome_of(job, JobStatus.SUCCEEDED, output=output_of(job, out.finish_reason)))

    def _checkpoint_due(self, job: RunningJob, mono: float) -> bool:
        if job.first_token_at is not None and job.checkpointed == 0 and job.token_ids:
            return True  # the first token: records first_token_at for live views
        grown = len(job.token_ids) - job.checkpointed
        return grown >= self.config.checkpoint_tokens or (
            grown > 0 and mono - job.checkpoint_at >= self.config.checkpoint_interval_s)

    # --- outcomes -----------------------------------------------------------------------

    async def wait_commits(self) -> None:
        await self.commits.wait()

    # --- shutdown -------------------------------------------------------------------------

    async def checkpoint_all(self) -> dict[EntryRef, str]:
        """Write every running job's tokens, abort them in the engine, and return their entries and job ids."""
        writes = StepWrites()
        refs: dict[EntryRef, str] = {}
        for job in list(self.jobs.values()):
            writes.checkpoint(job.spec.id, job.token_ids, job.first_token_at, job.logprobs, job.text,
                              job.num_prompt_tokens)
            refs[job.entry] = job.spec.id
            self._abort(job.spec.id)
        await self.step_writer.write(writes)
        aborts, self._aborts = self._aborts, []
        try:
            # Best effort: the checkpoints are written, and a hung engine must not hold up the hand-back.
            await asyncio.wait_for(asyncio.shield(self.engine.tick([], aborts, False)), timeout=ABORT_WAIT_S)
        except TimeoutError:
            log.error("the engine did not answer the aborts of the handed-back jobs in %gs (hung?); they are handed "
                      "back all the same", ABORT_WAIT_S)
        except EngineFailed as e:
            # A dead engine runs nothing: the checkpoints are written, so the jobs are handed back all the same.
            log.error("aborting the handed-back jobs in the engine failed: %s", e)
        return refs

    async def aclose(self) -> None:
        await self.engine.aclose()

    async def view(self, job_id: str) -> dict[str, Any]:
        return job_view(await read_hash(self.client, self.keys.job(job_id)))
