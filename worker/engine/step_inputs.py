"""A step's inputs in persistent device buffers, filled through one pinned staging buffer.

Every tensor the forward reads (token ids, positions, cache slots, context
lengths, query offsets, logit rows, the block table) lives at a fixed
address for the runner's whole life, so a CUDA graph recorded over them
replays correctly, and a step allocates no tensors to feed the model. The
host fills one pinned int64 buffer and one copy moves it to the device.

The block table is fixed-width (`max_blocks_per_seq`) and kept on the
device: each running sequence owns a row, and a step sends only the
entries that changed since that row was last sent (usually none, one when
a sequence enters a new block), then gathers the step's rows in batch order.

A step a recorded graph replays is laid out for that graph: every sequence
gets the same number of token rows (1 for a decode graph, 1 + k for a
verify graph), its own tokens last and padding before them, and the batch
is padded with whole sequences to the graph's size; `logit_rows` then lists
the rows the step's logits come from, so the graph gathers them itself.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class StepSeq:
    """One sequence's share of a step: tokens at positions `start_pos ..` get their KV computed.

    `block_table` is read, never changed. `key` names the sequence across
    steps (its request id) so its device row is reused; `None` sends the
    whole table for this step only. With `needs_logits`, the step returns
    the logits of the last `1 + num_spec_tokens` tokens (the last known
    token's and each proposed token's, when speculating), else of none.
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    needs_logits: bool
    key: str | None = None
    num_spec_tokens: int = 0


@dataclass
class TokenFeed:
    """Input tokens of a step that are on the device only: entry `positions[i]` of the step's input ids (its
    sequences' tokens in batch order) is `tokens[rows[i]]`."""

    positions: list[int]
    tokens: torch.Tensor
    rows: list[int]


@dataclass(frozen=True)
class StepShape:
    """A step's sizes, known on the host without reading the device."""

    num_seqs: int
    num_tokens: int
    num_logits: int
    max_query_len: int
    max_seq_len: int

    @property
    def is_decode(self) -> bool:
        """Every sequence brings one token and samples from it: the steps a decode graph replays."""
        return self.num_tokens == self.num_seqs == self.num_logits


@dataclass
class _Row:
    index: int
    table: list[int]
    """The sequence's own block-table list; a new list (re-admission) means a new table."""
    num_sent: int
    last_step: int


class StepInputs:
    def __init__(self, max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device) -> None:
        assert max_num_seqs > 0 and max_num_tokens > 0 and max_blocks_per_seq > 0
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = device
        seqs, tokens = max_num_seqs, max_num_tokens
        # Fixed offsets in one int64 buffer; the block-table changes come last, as (row, column, block)
        # triples, so a step copies only as many of them as it has.
        sizes = {"input_ids": tokens, "positions": tokens, "slot_mapping": tokens, "seq_lens": seqs,
                 "cu_seqlens_q": seqs + 1, "logit_rows": tokens, "rows": seqs}
        self._offsets = dict(zip(sizes, itertools.accumulate(sizes.values(), initial=0)))
        self._changes_at = sum(sizes.values())
        total = self._changes_at + 3 * seqs * max_blocks_per_seq
        self._host = torch.zeros(total, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._staged = self._host.numpy()
        # The copy out of the pinned buffer runs when the device gets to it, after the work queued before it: a step
        # that samples nothing (a prefill chunk) returns without waiting, so the next one must not overwrite the
        # buffer before that copy has read it.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._device = torch.zeros(total, dtype=torch.int64, device=device)
        self.table = torch.zeros((seqs, max_blocks_per_seq), dtype=torch.int64, device=device)
        """Every row's blocks, kept across steps."""
        self.step_table = torch.zeros((seqs, max_blocks_per_seq), dtype=torch.int64, device=device)
        """This step's rows of `table`, in batch order."""
        self._rows: dict[str, _Row] = {}
        self._free_rows = list(range(seqs - 1, -1, -1))
        self._num_steps = 0

    def view(self, name: str, n: int) -> torch.Tensor:
        """The first `n` entries of a device input: the same storage every step."""
        start = self._offsets[name]
        return self._device[start : start + n]

    def release(self, key: str) -> None:
        """The sequence left the batch (finished, aborted, preempted): its row is free again."""
        row = self._rows.pop(key, None)
        if row is not None:
            self._free_rows.append(row.index)

    def prepare(self, batch: list[StepSeq], pad_to: int | None = None, query_len: int = 1,
                gather_table: bool = True) -> StepShape:
        """Stage the batch, copy it to the device, apply its table changes; `gather_table` fills `step_table`.

        `pad_to` lays the step out for a recorded graph of `pad_to` sequences
        of `query_len` token rows each (the graph gathers the table itself):
        a sequence's tokens are the last of its rows, the rows before them
        and the sequences past the batch are padding (`_stage_padding`), and
        `logit_rows` holds the rows the logits are gathered from, in the
        order an eager step returns them, then row 0 up to `pad_to *
        query_len`. The shape returned is the batch's own.
        """
        assert batch, "a step runs at least one sequence"
        assert len(batch) <= self.max_num_seqs, (len(batch), self.max_num_seqs)
        if self._copied is not None:
            self._copied.synchronize()
        self._num_steps += 1
        staged, at, block_size = self._staged, self._offsets, self.block_size
        q_lens = [len(seq.token_ids) for seq in batch]
        num_tokens = sum(q_lens)
        num_seqs = len(batch)
        if pad_to is None:
            cu_seqlens = list(itertools.accumulate(q_lens, initial=0))
        else:
            assert num_seqs <= pad_to <= self.max_num_seqs and max(q_lens) <= query_len, (pad_to, query_len, q_lens)
            cu_seqlens = list(range(0, (pad_to + 1) * query_len, query_len))
        num_rows = cu_seqlens[-1]
        assert num_rows <= self.max_num_tokens, (num_rows, self.max_num_tokens)
        # Each sequence's tokens are the last rows of its share: all of it unless padded.
        ends = cu_seqlens[1 : num_seqs + 1]
        seq_lens = [seq.start_pos + n for seq, n in zip(batch, q_lens)]
        assert max(seq_lens) <= self.max_blocks_per_seq * block_size, "sequence longer than the block table's width"
        if ends[-1] == num_seqs:
            # Decode: one token each, row i is sequence i; no per-token arrays to build. A table too short for its
            # token fails its lookup here.
            positions = [seq.start_pos for seq in batch]
            staged[at["input_ids"] : at["input_ids"] + num_seqs] = [seq.token_ids[0] for seq in batch]
            staged[at["positions"] : at["positions"] + num_seqs] = positions
            staged[at["slot_mapping"] : at["slot_mapping"] + num_seqs] = [
                seq.block_table[p // block_size] * block_size + p % block_size for seq, p in zip(batch, positions)
            ]
            logit_rows = ([i for i, seq in enumerate(batch) if seq.needs_logits]
                          if not all(seq.needs_logits for seq in batch) else list(range(num_seqs)))
        else:
            for seq, end in zip(batch, seq_lens):
                assert end <= len(seq.block_table) * block_size, "block table too short for the scheduled tokens"
            logit_rows = [row for seq, end in zip(batch, ends) if seq.needs_logits
                          for row in range(end - 1 - seq.num_spec_tokens, end)]
            if pad_to is not None:
                self._stage_short_queries(batch, query_len)
            else:
                self._stage_tokens(batch, q_lens)
        num_logits = len(logit_rows)
        if pad_to is not None:
            self._stage_padding(num_seqs, pad_to, query_len)
            logit_rows += [0] * (num_rows - num_logits)
        staged[at["seq_lens"] : at["seq_lens"] + num_seqs] = seq_lens
        staged[at["cu_seqlens_q"] : at["cu_seqlens_q"] + len(cu_seqlens)] = cu_seqlens
        staged[at["logit_rows"] : at["logit_rows"] + len(logit_rows)] = logit_rows
        rows, num_changes = self._stage_rows(batch)
        staged[at["rows"] : at["rows"] + num_seqs] = rows
        end = self._changes_at + 3 * num_changes
        self._device[:end].copy_(self._host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        if num_changes:
            changes = self._device[self._changes_at : end].view(num_changes, 3)
            self.table.index_put_((changes[:, 0], changes[:, 1]), changes[:, 2])
        if gather_table:
            self.gather_table(num_seqs)
        return StepShape(num_seqs=num_seqs, num_tokens=num_tokens, num_logits=num_logits, max_query_len=max(q_lens),
                         max_seq_len=max(seq_lens))

    def prepare_padding(self, num_seqs: int, query_len: int) -> None:
        """Stage a step of `num_seqs` padding sequences of `query_len` rows each and copy it to the device: what a
        graph's warm-up and recording run over. Its rows ask for no cache slot and attend to nothing through
        valid query offsets, so the attention writes all of its output (offsets left at zero would leave it
        unwritten: garbage, NaN perhaps, that the next layer would store in the cache)."""
        assert 0 < num_seqs <= self.max_num_seqs and num_seqs * query_len <= self.max_num_tokens, (num_seqs, query_len)
        if self._copied is not None:
            self._copied.synchronize()
        staged, at = self._staged, self._offsets
        self._stage_padding(0, num_seqs, query_len)
        staged[at["cu_seqlens_q"] : at["cu_seqlens_q"] + num_seqs + 1] = np.arange(num_seqs + 1) * query_len
        staged[at["logit_rows"] : at["logit_rows"] + num_seqs * query_len] = 0
        self._device[: self._changes_at].copy_(self._host[: self._changes_at], non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))

    def feed_tokens(self, positions: list[int], tokens: torch.Tensor, rows: list[int]) -> None:
        """Input id `positions[i]` of the step just prepared is `tokens[rows[i]]`, on the device: tokens an
        earlier step drew whose values the host has not read (it staged a placeholder there)."""
        n = len(positions)
        ids = self.view("input_ids", self.max_num_tokens)
        if positions == rows and positions[-1] == n - 1:
            # Both are 0 .. n-1 (positions only increase): decodes of the same sequences in the same order as the
            # step before, the usual step. One copy, no index to send.
            ids[:n].copy_(tokens[:n])
            return
        index = torch.tensor(positions + rows, dtype=torch.int64)
        if self.device.type == "cuda":
            # A pinned block from the caching host allocator, held until its copy is done.
            index = index.pin_memory()
        index = index.to(self.device, non_blocking=True)
        ids.index_copy_(0, index[:n], tokens.index_select(0, index[n:]))

    def gather_table(self, num_seqs: int) -> None:
        """`step_table[i] = table[rows[i]]` for the step's sequences, on the device."""
        torch.index_select(self.table, 0, self.view("rows", num_seqs), out=self.step_table[:num_seqs])

    def _stage_tokens(self, batch: list[StepSeq], q_lens: list[int]) -> None:
        """Each sequence's tokens laid end to end, with their positions and cache slots."""
        staged, at, block_size = self._staged, self._offsets, self.block_size
        num_tokens = sum(q_lens)
        staged[at["input_ids"] : at["input_ids"] + num_tokens] = list(
            itertools.chain.from_iterable(seq.token_ids for seq in batch))
        offset = 0
        for seq, n in zip(batch, q_lens):
            positions = np.arange(seq.start_pos, seq.start_pos + n)
            blocks = np.asarray(seq.block_table, dtype=np.int64)[positions // block_size]
            staged[at["positions"] + offset : at["positions"] + offset + n] = positions
            staged[at["slot_mapping"] + offset : at["slot_mapping"] + offset + n] = (
                blocks * block_size + positions % block_size)
            offset += n

    def _stage_short_queries(self, batch: list[StepSeq], query_len: int) -> None:
        """Each sequence's tokens as the last of its `query_len` rows, the rows before them padding: token 0 at
        position 0, writing to no cache slot (-1). Built in Python: for a few tokens per sequence numpy's cost
        per call outweighs the arithmetic."""
        block_size = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq in batch:
            num_padding = query_len - len(seq.token_ids)
            span = range(seq.start_pos, seq.start_pos + len(seq.token_ids))
            table = seq.block_table
            token_ids += [0] * num_padding + seq.token_ids
            positions += [0] * num_padding
            positions += span
            slots += [-1] * num_padding
            slots += [table[p // block_size] * block_size + p % block_size for p in span]
        for name, values in (("input_ids", token_ids), ("positions", positions), ("slot_mapping", slots)):
            start = self._offsets[name]
            self._staged[start : start + len(values)] = values

    def _stage_padding(self, num_seqs: int, padded: int, query_len: int) -> None:
        """The sequences past `num_seqs`: their rows hold token 0 at position 0 and write to no cache slot (-1),
        and they attend to nothing (length 0) through row 0 of the table."""
        staged, at = self._staged, self._offsets
        first, end = num_seqs * query_len, padded * query_len
        for name, value in (("input_ids", 0), ("positions", 0), ("slot_mapping", -1)):
            staged[at[name] + first : at[name] + end] = value
        for name in ("seq_lens", "rows"):
            staged[at[name] + num_seqs : at[name] + padded] = 0

    def _stage_rows(self, batch: list[StepSeq]) -> tuple[list[int], int]:
        """Each sequence's row, and the table changes staged for the device; returns (rows, number of changes)."""
        staged, base, step = self._staged, self._changes_at, self._num_steps
        known = self._rows
        in_batch: set[str] | None = None  # the step's keys, made when a row is first taken (most steps take none)
        rows: list[int] = []
        transient: list[_Row] = []
        num_changes = 0
        for seq in batch:
            table = seq.block_table
            row = known.get(seq.key) if seq.key is not None else None
            if row is None or row.table is not table or len(table) < row.num_sent:
                if row is None:
                    if in_batch is None:
                        in_batch = {s.key for s in batch if s.key is not None}
                    row = _Row(self._take_row(in_batch), table, 0, step)
                    if seq.key is None:
                        transient.append(row)
                    else:
                        known[seq.key] = row
                row.table, row.num_sent = table, 0
            if len(table) > row.num_sent:
                new = table[row.num_sent :]
                n = len(new)
                triples = staged[base + 3 * num_changes : base + 3 * (num_changes + n)].reshape(n, 3)
                triples[:, 0] = row.index
                triples[:, 1] = np.arange(row.num_sent, row.num_sent + n)
                triples[:, 2] = new
                num_changes += n
                row.num_sent = len(table)
            row.last_step = step
            rows.append(row.index)
        # A sequence without a key has its row for this step only.
        self._free_rows.extend(row.index for row in transient)
        return rows, num_changes

    def _take_row(self, in_batch: set[str]) -> int:
        if not self._free_rows:
            # Rows of sequences that left without a release: the least recently used one not in this step.
            stale = min((r for k, r in self._rows.items() if k not in in_batch), key=lambda r: r.last_step,
                        default=None)
            assert stale is not None, "more sequences in a step than rows"
            key = next(k for k, r in self._rows.items() if r is stale)
            self.release(key)
        return self._free_rows.pop()
