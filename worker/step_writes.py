"""Everything one engine step writes to Redis, in one script call: one round trip, one command.

After each step the worker publishes a token event per job that got tokens,
queues throttled ``output`` webhook deliveries and stores the checkpoints that
are due. With a tiny model a step takes a few milliseconds, and the event loop
shares the GIL with the engine thread, so the client-side cost of many small
commands (encoding each, parsing each reply) slows every step down. One
EVALSHA carrying the whole step costs about what one command costs.

The script runs the writes in the order given: a job's token events stay in
order. Each write is made only while its job is still ours (running, held by
this worker): a worker that lost a job (paused past its lease, its job since
cancelled or run elsewhere) sends no event, webhook or checkpoint after the
job's end. The shutdown hand-back writes its final checkpoints through the
same script.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from scheduler.protocol import state_machine
from scheduler.protocol.keys import EVENTS_LOG_TTL_S, Keys
from worker.job_store import pack_checkpoint


CHECKPOINT_STORED, CHECKPOINT_NOT_OURS, CHECKPOINT_CANCEL_FLAGGED, CHECKPOINT_NO_RECORD = 1, 0, 2, 3


@dataclass
class StepWrites:
    """One step's writes, gathered while its outputs are handled."""

    events: list[tuple[str, bytes]] = field(default_factory=list)
    """(job id, packed event), in publishing order: published on the job's channel and logged."""
    deliveries: list[tuple[str, dict[FieldT, EncodableT]]] = field(default_factory=list)
    """(job id, fields of a webhook delivery to XADD)."""
    checkpoints: list[tuple[str, bytes, str]] = field(default_factory=list)
    """(job id, packed checkpoint, first_token_at or '')."""

    def __len__(self) -> int:
        return len(self.events) + len(self.deliveries) + len(self.checkpoints)

    def publish(self, job_id: str, message: bytes) -> None:
        self.events.append((job_id, message))

    def deliver(self, job_id: str, fields: dict[FieldT, EncodableT]) -> None:
        self.deliveries.append((job_id, fields))

    def checkpoint(self, job_id: str, token_ids: list[int], first_token_at: float | None,
                   logprobs: list[dict[str, Any]] | None = None, text: str | None = None,
                   prompt_tokens: int | None = None) -> int:
        """Queue a checkpoint; returns its index in the replies of ``StepWriter.write``."""
        self.checkpoints.append((job_id, pack_checkpoint(token_ids, logprobs, text, prompt_tokens),
                                 "" if first_token_at is None else repr(first_token_at)))
        return len(self.checkpoints) - 1


class StepWriter:
    """Writes a ``StepWrites`` with one script call (loaded once, reloaded if Redis forgot it)."""

    def __init__(self, client: aioredis.Redis, keys: Keys, worker: str) -> None:
        self.keys = keys
        self.worker = worker
        self.client = client
        self._script = client.register_script(state_machine.STEP)

    async def write(self, writes: StepWrites) -> list[int]:
        """Run the step's writes; returns one reply per checkpoint, in order."""
        if not len(writes):
            return []
        keys: list[str] = [self.keys.webhooks]
        places: dict[str, int] = {}

        def place(job_id: str) -> int:
            """The job's 1-based place among the step's jobs, whose record and cancel flag follow in KEYS."""
            if job_id not in places:
                places[job_id] = len(places) + 1
                keys.extend((self.keys.job(job_id), self.keys.cancel(job_id)))
            return places[job_id]

        writes_args: list[EncodableT] = []
        for job_id, message in writes.events:
            writes_args += [place(job_id), self.keys.events(job_id), self.keys.events_log(job_id), message]
        for job_id, fields in writes.deliveries:
            writes_args += [place(job_id), len(fields)]
            for name, value in fields.items():
                writes_args += [name, value]
        for job_id, checkpoint, first_token_at in writes.checkpoints:
            writes_args += [place(job_id), checkpoint, first_token_at]
        args: list[EncodableT] = [self.worker, len(places), len(writes.events), len(writes.deliveries),
                                  EVENTS_LOG_TTL_S, *writes_args]
        replies = await self._script(keys=keys, args=args)
        assert len(replies) == len(writes.checkpoints)
        return [int(r) for r in replies]
