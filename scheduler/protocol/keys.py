"""The whole Redis schema: every key name, group name and TTL carpool uses.

Nothing else in the code base spells a Redis key. Every name hangs off a
configurable prefix (default ``carpool``) so several deployments can share one
Redis server. Units are in the names: ``*_s`` seconds, ``*_ms`` milliseconds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from scheduler.protocol.lanes import LANES, Lane
from scheduler.protocol.tenants import DEFAULT_TENANT

DEFAULT_PREFIX = "carpool"

CONSUMER_GROUP = "carpool-workers"
"""Consumer group every worker joins on every lane stream."""

DEFAULT_RESULT_TTL_S = 24 * 3600
DEFAULT_QUEUED_TTL_S = 7 * 24 * 3600
"""How long a job's record and idempotency key may live from its submission while it waits or runs: a backstop
for a job that never ends (its entry deleted by hand, say); when it ends they get the result's time to live."""
"""How long a finished job record (and its idempotency key) lives."""

DEFAULT_DEAD_MAXLEN = 10_000
"""Approximate MAXLEN of the dead-letter streams."""

EVENTS_LOG_TTL_S = 600
"""How long a job's event log lives after its last event; once the job ends, its record replaces the log."""

DEFAULT_REPLY_MAXLEN = 10_000
"""Approximate MAXLEN applied to a job's ``reply_to`` stream on each result."""

DEFAULT_FILE_TTL_S = 7 * 24 * 3600
"""How long an uploaded file, a batch and the batch's output files live (OpenAI routes)."""

RATE_WINDOW_MS = 60_000
"""Length of a tenant's rate-limit window, from its first request in the window."""

WAKE_MAXLEN = 1_000
"""Approximate MAXLEN of the wake stream (its entries are deleted as they are read)."""

ROUTE_SCAN_COUNT = 500
"""Lane-stream entries a worker looks at per read for ones naming a tenant, to move to that tenant's stream."""


def check_key_prefix(prefix: str) -> None:
    """Raise ``ValueError`` unless ``prefix`` can start every key: non-empty, no whitespace."""
    if not prefix or any(c.isspace() for c in prefix):
        raise ValueError(f"key_prefix: must be non-empty without spaces, got {prefix!r}")


def _glob_escape(text: str) -> str:
    """`text` matched literally in a Redis glob pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix. Build once from config and pass it down."""

    prefix: str = DEFAULT_PREFIX

    def is_own(self, key: str) -> bool:
        """Whether `key` lies inside this prefix, where only carpool writes (a ``reply_to`` may not name one)."""
        return key == self.prefix or key.startswith(f"{self.prefix}:")

    def check_reply_to(self, reply_to: str | None, *, may_name_batch_results: bool = True) -> str | None:
        """Why `reply_to` may not be used (it names one of carpool's own keys), or None when it may.

        The one key of carpool's own a job may reply to is a batch's results stream: the Batch API's jobs do.
        The gateway allows it only to the batch's own jobs (`may_name_batch_results=False` for every other).
        """
        if reply_to is None or not self.is_own(reply_to):
            return None
        if may_name_batch_results and self.is_batch_results(reply_to):
            return None
        return f"must not name a key under carpool's prefix {self.prefix!r} (use a stream of your own)"

    def lane(self, lane: Lane | str) -> str:
        """Stream of queued jobs for one lane (field ``job`` = msgpack map)."""
        return f"{self.prefix}:lane:{Lane(lane).value}"

    def lanes(self) -> list[str]:
        """Every lane stream, highest priority first."""
        return [self.lane(lane) for lane in LANES]

    # --- tenants: fair share inside a lane, API keys, limits and usage ---

    def tenant_lane(self, lane: Lane | str, tenant: str) -> str:
        """Stream of one tenant's queued jobs in a lane (same entries as the lane stream, consumer group
        ``carpool-workers``). The default tenant's stream is the lane stream itself."""
        if tenant == DEFAULT_TENANT:
            return self.lane(lane)
        return f"{self.lane(lane)}:tenant:{tenant}"

    def tenant_lane_prefix(self, lane: Lane | str) -> str:
        """What every tenant stream of a lane starts with (the tenant's name follows)."""
        return f"{self.lane(lane)}:tenant:"

    def tenant_lanes_glob(self) -> str:
        """A SCAN pattern that every lane's tenant streams match (other keys may too: check each name against
        `tenant_lane_prefix`)."""
        return _glob_escape(f"{self.prefix}:lane:") + "*:tenant:*"

    def lane_tenants(self, lane: Lane | str) -> str:
        """Set of tenants whose stream in the lane may hold entries (waiting or running); workers read only
        these, and take a tenant out once its stream is empty."""
        return f"{self.lane(lane)}:tenants"

    def lane_route_cursor(self, lane: Lane | str) -> str:
        """String: the last lane-stream entry id already looked at for a ``tenant`` (entries up to it that
        are still undelivered belong to the default tenant)."""
        return f"{self.lane(lane)}:routed"

    @property
    def wake(self) -> str:
        """Stream (consumer group ``carpool-workers``) with one entry per tenant that became active in a
        lane: wakes a worker blocked on the streams it knew of. Entries are deleted as they are read."""
        return f"{self.prefix}:wake"

    @property
    def stray_scan(self) -> str:
        """Where the fleet's walk of the key space for tenant streams outside the active sets has got to (a SCAN
        cursor), shared by every worker."""
        return f"{self.prefix}:stray-scan"

    @property
    def stray_scan_turn(self) -> str:
        """Held (with a time to live of one sweep interval) by the worker whose turn it is to walk the next slice."""
        return f"{self.prefix}:stray-scan:turn"

    @property
    def tenant_weights(self) -> str:
        """Hash tenant -> weight (int) of its share inside a lane; a tenant not named weighs 1."""
        return f"{self.prefix}:tenant-weights"

    def api_key(self, digest: str) -> str:
        """Hash of one API key, by the SHA-256 hex of the key (the key itself is never stored):
        id, tenant, created_at and the limits (max_queued, requests_per_minute, tokens_per_minute, weight)."""
        return f"{self.prefix}:apikey:{digest}"

    @property
    def api_keys(self) -> str:
        """Hash key id -> SHA-256 hex of the key, for listing and revoking."""
        return f"{self.prefix}:apikeys"

    def tenant_window(self, tenant: str) -> str:
        """Hash of a tenant's current rate-limit window: id (its start, unix ms), requests, tokens;
        expires ``RATE_WINDOW_MS`` after the window's first request."""
        return f"{self.prefix}:tenant:{tenant}:window"

    def tenant_batch_lines(self, tenant: str) -> str:
        """Count of a tenant's Batch API lines waiting or running (in its streams, not held to ``max_queued``)."""
        return f"{self.prefix}:tenant:{tenant}:batch-lines"

    def tenant_usage(self, tenant: str) -> str:
        """Hash of a tenant's counts since it began: jobs, jobs_<status>, prompt_tokens, completion_tokens."""
        return f"{self.prefix}:tenant:{tenant}:usage"

    def job(self, job_id: str) -> str:
        """Hash holding one job's record (status, timestamps, result, error)."""
        return f"{self.prefix}:job:{job_id}"

    def events(self, job_id: str) -> str:
        """Pub/sub channel of one job's live events (started, tokens, final)."""
        return f"{self.prefix}:events:{job_id}"

    def idempotency(self, tenant: str, key: str) -> str:
        """String mapping one tenant's ``Idempotency-Key`` header to the job id it created. Each tenant has its
        own keys; the default tenant's (no API keys) are ``idem:{key}``, apart from every named tenant's."""
        if tenant == DEFAULT_TENANT:
            return f"{self.prefix}:idem:{key}"
        return f"{self.prefix}:tenant:{tenant}:idem:{key}"

    def events_log(self, job_id: str) -> str:
        """Stream of a running job's events (field ``e`` = the same msgpack as on ``events``), so a late
        SSE client catches up from the start; expires ``EVENTS_LOG_TTL_S`` after its last entry."""
        return f"{self.prefix}:events-log:{job_id}"

    def cancel(self, job_id: str) -> str:
        """Flag set when a job is cancelled; workers check it before and while running."""
        return f"{self.prefix}:cancel:{job_id}"

    @property
    def control(self) -> str:
        """Pub/sub channel of control messages to workers: ``cancel`` (a job) and ``handback`` (reclaim now)."""
        return f"{self.prefix}:control"

    @property
    def dead(self) -> str:
        """Stream of lane entries that could not be processed, with the reason."""
        return f"{self.prefix}:dead"

    @property
    def webhooks(self) -> str:
        """Stream of pending webhook deliveries (consumer group ``carpool-webhooks``)."""
        return f"{self.prefix}:webhooks"

    @property
    def webhooks_retry(self) -> str:
        """Sorted set of deliveries waiting for their next attempt, scored by due unix time."""
        return f"{self.prefix}:webhooks:retry"

    def webhook_delivery(self, delivery_id: str) -> str:
        """Hash holding one webhook delivery's state (payload, attempts, next attempt)."""
        return f"{self.prefix}:webhook:{delivery_id}"

    def webhook_chain(self, job_id: str) -> str:
        """List of one job's undelivered webhook delivery ids, oldest first; only the head is sent."""
        return f"{self.prefix}:webhook-chain:{job_id}"

    @property
    def webhooks_dead(self) -> str:
        """Stream of webhook deliveries that exhausted their retry schedule."""
        return f"{self.prefix}:webhooks:dead"

    @property
    def workers(self) -> str:
        """Hash of live workers: name -> msgpack heartbeat (time, running, capacity)."""
        return f"{self.prefix}:workers"

    def worker_claim(self, name: str) -> str:
        """String holding the token of the live worker that goes by `name`, set only where absent and renewed by
        its heartbeats: of two workers started under one name at the same moment, one has it."""
        return f"{self.prefix}:worker-claim:{name}"

    @property
    def models(self) -> str:
        """Hash of the models workers have served: name -> unix time of the last heartbeat naming it (kept after
        the workers stop, so requests for them wait while none is live and others are refused)."""
        return f"{self.prefix}:models"

    # --- OpenAI Batch API: files and batches. Large content is a list of lines, never one value. ---

    def file(self, file_id: str) -> str:
        """Hash of one file's metadata (id, bytes, filename, purpose, created_at, num_lines)."""
        return f"{self.prefix}:file:{file_id}"

    def file_lines(self, file_id: str) -> str:
        """List of the file's lines in order, one element per line with its line ending (joined: the file's bytes)."""
        return f"{self.prefix}:file:{file_id}:lines"

    def file_staging(self, file_id: str) -> str:
        """An upload's lines while they are written, renamed to ``file_lines`` once all are there."""
        return f"{self.prefix}:file:{file_id}:staging"

    def file_readers(self, file_id: str) -> str:
        """Set of the batches still to read the file's lines: a delete or expiry of the file leaves its lines to
        them, and the last one to finish reading drops them."""
        return f"{self.prefix}:file:{file_id}:readers"

    @property
    def files(self) -> str:
        """Sorted set of file ids, scored by creation unix time."""
        return f"{self.prefix}:files"

    @property
    def files_deleted(self) -> str:
        """Sorted set of deleted file ids, scored as they were in `files` until they would have expired: where a
        list page that ended with one continues."""
        return f"{self.prefix}:files:deleted"

    def batch(self, batch_id: str) -> str:
        """Hash of one batch: status, timestamps, request counts, file ids, the driver's cursors."""
        return f"{self.prefix}:batch:{batch_id}"

    @property
    def batches(self) -> str:
        """Sorted set of batch ids, scored by creation unix time (listing, newest first)."""
        return f"{self.prefix}:batches"

    @property
    def batches_active(self) -> str:
        """Set of batch ids not yet in a final status: what gateways drive."""
        return f"{self.prefix}:batches:active"

    def batch_custom_ids(self, batch_id: str) -> str:
        """List of the input lines' custom_id, by line number ('' where the line had none)."""
        return f"{self.prefix}:batch:{batch_id}:custom-ids"

    def batch_errors(self, batch_id: str) -> str:
        """Hash line number -> msgpack [code, message] of lines refused (and "<n>:answer" -> [param, status] of a
        refused request)."""
        return f"{self.prefix}:batch:{batch_id}:errors"

    def batch_settled(self, batch_id: str) -> str:
        """Bitmap, bit = line number: set once that line's request is counted (done, failed or dropped)."""
        return f"{self.prefix}:batch:{batch_id}:settled"

    def batch_results(self, batch_id: str) -> str:
        """Stream the batch's requests are ``reply_to``: one entry (field ``result``, the msgpack job record) per
        request as it ends, read and deleted by the batch driver."""
        return f"{self.prefix}:batch:{batch_id}:results"

    def is_batch_results(self, key: str) -> bool:
        head, tail = f"{self.prefix}:batch:", ":results"
        batch_id = key[len(head):-len(tail)]
        return key.startswith(head) and key.endswith(tail) and bool(batch_id) and ":" not in batch_id

    def batch_lock(self, batch_id: str) -> str:
        """String naming the gateway driving the batch now; expires unless renewed."""
        return f"{self.prefix}:batch:{batch_id}:lock"


WEBHOOK_GROUP = "carpool-webhooks"
"""Consumer group of webhook dispatchers on the webhook stream."""
