"""Per-request sampling state kept on the device, one row per request.

A request's parameters are written to its row once, when the sampler first
sees it, instead of being rebuilt into tensors every step. Requests that use
penalties also get token counts: which ids the prompt holds (repetition
penalty) and how often each id was sampled (presence and frequency). The
counts grow by one scatter per step on the device with the tokens just
sampled, and are rebuilt from the request's token lists only when those no
longer match what the row has counted (a resume, or a row evicted and
re-made). Rows are freed by `release`; when none is free the least recently
used row goes, so a request that vanished without a release costs nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from scheduler.params import SamplingParams
from scheduler.sequence import PENDING_TOKEN

# Columns of the float parameter rows.
TEMPERATURE, TOP_P, MIN_P, REPETITION, PRESENCE, FREQUENCY = range(6)
# Columns of the int64 parameter rows; PENALISED is the host's has_penalties, so both sides count alike.
TOP_K, SEED, IS_PENALISED = range(3)
NUM_FLOATS, NUM_INTS = 6, 3


class RowRequest(Protocol):
    """What the rows read from a request (worker.engine.sampler.SampleRequest)."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class Row:
    """One request's row, from its assignment to its release (a re-assigned id gets a new one)."""

    index: int
    params: SamplingParams
    num_counted: int = -1
    """Output tokens in this row's counts; -1 until the counts are built."""
    last_token: int = -1
    """The last token counted, to tell a matching list from one that only has the same length."""


def to_device(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values onto the device without waiting for the work queued there."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        # A copy from pageable memory would synchronize the stream (wait for the forward); a pinned block
        # from the caching host allocator is held until its copy is done, so it can't be reused too early.
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class SamplingRows:
    def __init__(self, vocab_size: int, num_rows: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._rows: OrderedDict[str, Row] = OrderedDict()
        """Least recently used first."""
        self._free: list[int] = []
        self.version = 0
        """Counts the rows assigned and freed: the sampler keeps a step's rows for the next while it is the same."""
        self.floats = torch.empty(0, NUM_FLOATS, device=device)
        self.ints = torch.empty(0, NUM_INTS, dtype=torch.int64, device=device)
        self.prompt_seen: torch.Tensor | None = None
        """`[rows, vocab]` bool: the id is in the prompt. Allocated with the first penalised request."""
        self.output_counts: torch.Tensor | None = None
        """`[rows, vocab]` int32: times the id was sampled."""
        self._grow(num_rows)

    @property
    def num_rows(self) -> int:
        return self.floats.shape[0]

    def assign(self, requests: Sequence[RowRequest]) -> list[Row]:
        """Each request's row, writing parameters and counts where a row is new or stale."""
        assert len({r.request_id for r in requests}) == len(requests), "one row per request in a step"
        # Touch the known rows first, so that eviction below never takes a row this step uses.
        for request in requests:
            row = self._rows.get(request.request_id)
            if row is not None:
                if row.params is not request.params:  # the id now names another request
                    self.release(request.request_id)
                else:
                    self._rows.move_to_end(request.request_id)
        new = [r for r in requests if r.request_id not in self._rows]
        if len(self._free) + len(self._rows) - (len(requests) - len(new)) < len(new):
            self._grow(max(2 * self.num_rows, len(requests)))
        for request in new:
            if not self._free:
                _, evicted = self._rows.popitem(last=False)
                self._free.append(evicted.index)
            self._rows[request.request_id] = Row(self._free.pop(), request.params)
        if new:
            self._write_params(new)
            self.version += 1
        self.refresh_counts([r for r in requests if r.params.has_penalties])
        return [self._rows[r.request_id] for r in requests]

    def refresh_counts(self, requests: Sequence[RowRequest]) -> None:
        """Rebuild the counts of those of the (penalised, assigned) requests whose token lists no longer match what
        their rows counted: a resume, or a row evicted and made again."""
        stale = [r for r in requests if not self._counts_match(r)]
        if stale:
            self._rebuild_counts(stale)

    def release(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free.append(row.index)
            self.version += 1

    def count_sampled(self, rows: torch.Tensor, token_ids: torch.Tensor, is_penalised: torch.Tensor) -> None:
        """Add this step's tokens to the counts of the penalised rows (on the device, no sync)."""
        if self.output_counts is not None:
            self.output_counts.index_put_((rows, token_ids), is_penalised.to(torch.int32), accumulate=True)

    def note_drawn(self, requests: Sequence[RowRequest]) -> list[Row]:
        """The host's record of what `count_sampled` added: one more token each, its value not known yet
        (`PENDING_TOKEN`, as the request's output list holds it until then). Returns the requests' rows, for
        `note_read`."""
        rows = [self._rows[request.request_id] for request in requests]
        for request, row in zip(requests, rows):
            if request.params.has_penalties and row.num_counted == len(request.output_token_ids):
                row.num_counted += 1
                row.last_token = PENDING_TOKEN
        return rows

    def note_read(self, request_id: str, row: Row, num_output: int, token_id: int) -> None:
        """The value of the request's output token `num_output - 1`, drawn earlier into `row`, is known; the
        row's record takes it when the request still has that row (the id may name another request by now) and
        that token is still the last it counted."""
        if self._rows.get(request_id) is row and row.num_counted == num_output:
            row.last_token = token_id

    def _counts_match(self, request: RowRequest) -> bool:
        row = self._rows[request.request_id]
        output = request.output_token_ids
        return row.num_counted == len(output) and (not output or output[-1] == row.last_token)

    def _write_params(self, requests: Sequence[RowRequest]) -> None:
        floats: list[float] = []
        ints: list[int] = []
        for request in requests:
            p = request.params
            floats += [p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty]
            # An unseeded request's noise comes from the Sampler's generator: its seed column is unused.
            ints += [p.top_k, p.seed if p.seed is not None else 0, int(p.has_penalties)]
        index = to_device([self._rows[r.request_id].index for r in requests], torch.int64, self.device)
        self.floats.index_copy_(0, index, to_device(floats, torch.float32, self.device).view(-1, NUM_FLOATS))
        self.ints.index_copy_(0, index, to_device(ints, torch.int64, self.device).view(-1, NUM_INTS))

    def _rebuild_counts(self, requests: Sequence[RowRequest]) -> None:
        if self.prompt_seen is None or self.output_counts is None:
            self.prompt_seen = torch.zeros(self.num_rows, self.vocab_size, dtype=torch.bool, device=self.device)
            self.output_counts = torch.zeros(self.num_rows, self.vocab_size, dtype=torch.int32, device=self.device)
        rows = [self._rows[r.request_id] for r in requests]
        assert all(PENDING_TOKEN not in r.output_token_ids for r in requests), "counts rebuilt over a pending token"
        # One transfer: the rows, then (row, id) pairs of the prompts, then of the outputs.
        prompt_rows = [row.index for row, r in zip(rows, requests) for _ in r.prompt_token_ids]
        output_rows = [row.index for row, r in zip(rows, requests) for _ in r.output_token_ids]
        prompt_ids = [t for r in requests for t in r.prompt_token_ids]
        output_ids = [t for r in requests for t in r.output_token_ids]
        parts = [[row.index for row in rows], prompt_rows, prompt_ids, output_rows, output_ids]
        flat = to_device([v for part in parts for v in part], torch.int64, self.device)
        index, prompt_rows_t, prompt_ids_t, output_rows_t, output_ids_t = flat.split([len(p) for p in parts])
        self.prompt_seen.index_fill_(0, index, False)
        self.output_counts.index_fill_(0, index, 0)
        self.prompt_seen.index_put_((prompt_rows_t, prompt_ids_t), torch.ones((), dtype=torch.bool, device=self.device))
        ones = torch.ones((), dtype=torch.int32, device=self.device).expand(len(output_ids))
        self.output_counts.index_put_((output_rows_t, output_ids_t), ones, accumulate=True)
        for row, request in zip(rows, requests):
            row.num_counted = len(request.output_token_ids)
            row.last_token = request.output_token_ids[-1] if request.output_token_ids else -1

    def _grow(self, num_rows: int) -> None:
        """Room for `num_rows` rows (a step bigger than the engine's max_num_seqs, e.g. in tests)."""
        old = self.num_rows
        self.version += 1
        self._free += range(num_rows - 1, old - 1, -1)
        self.floats = torch.cat([self.floats, torch.zeros(num_rows - old, NUM_FLOATS, device=self.device)])
        self.ints = torch.cat([self.ints, torch.zeros(num_rows - old, NUM_INTS, dtype=torch.int64, device=self.device)])
        if self.prompt_seen is not None and self.output_counts is not None:
            more = (num_rows - old, self.vocab_size)
            self.prompt_seen = torch.cat([self.prompt_seen, torch.zeros(more, dtype=torch.bool, device=self.device)])
            self.output_counts = torch.cat(
                [self.output_counts, torch.zeros(more, dtype=torch.int32, device=self.device)]
            )
