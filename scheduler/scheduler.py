"""The step scheduler: which sequences compute which tokens in the next forward.

Each step first keeps the running sequences going (a decode token each, or
the next chunk of an unfinished prefill), then admits waiting sequences in
policy order while there is a free slot (``max_num_seqs``) and token budget
(``max_num_batched_tokens``); the last one admitted has its prompt chunked to
fit the budget. When a running sequence needs a block and none is left, the
lowest-priority, most recently admitted running sequence (possibly itself) is
preempted by recompute: its blocks go back, its outputs stay, and it waits to
be prefilled again.

Under the ``priority`` policy in continuous batching, a waiting sequence
that finds no free slot or not enough blocks also preempts running ones of
strictly lower priority (least urgent, latest admitted first), by the same
recompute, and is admitted in that step. Nobody is preempted unless that
makes room. The preempted sequences' full blocks stay in the prefix cache as
evictable, so their re-prefill is mostly cache hits; and since they sort
after the one that displaced them, they cannot displace it in turn.

With ``prefill_alone_priority`` set, a step in which an urgent waiting
sequence (priority number at most that) is admitted leaves out the running
sequences less urgent than the cutoff: the urgent prefill does not share
its step with, say, 63 batch decodes, and those decodes wait one step.
When no urgent sequence can be admitted, the step is an ordinary one.
With ``lower_prefill_tokens`` set too, the less urgent sequences prefill at
most that many prompt tokens per step (a new admission is chunked to fit, a
long prompt continues over several steps; their decodes are not counted):
when many batch requests finish at once and as many new ones are admitted,
their prefills are spread over several steps instead of one long one, and an
urgent request arriving meanwhile waits for a short step, not that long one.

Batching modes:

- ``continuous``: the above, every step.
- ``static``: a new group of up to ``max_num_seqs`` is admitted only when the
  running set is empty, and runs until its longest member finishes.
- ``dynamic``: like static, but a group is admitted once ``max_num_seqs``
  requests are waiting or ``max_wait_ms`` has passed since the oldest waiting
  one arrived.

In static and dynamic mode a member that finishes early keeps its slot as
padding until the whole group is done: it goes on computing a token per step
whose result is discarded and never reported. That waste is what padded
batching costs, and these modes exist to measure it against ``continuous``.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from scheduler.block_manager import BlockManager, CachedPrefix
from scheduler.scheduler_config import BatchingMode, Policy, SchedulerConfig
from scheduler.scheduler_output import ScheduledSeq, SchedulerOutput
from scheduler.sequence import PENDING_TOKEN, FinishReason, Sequence, SequenceStatus


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._lower_prefill_left: int | None = None
        """What the current step may still prefill of the less urgent sequences (``_lower_prefill_tokens``)."""
        self.block_manager = block_manager
        self.clock = clock
        self.waiting: list[Sequence] = []
        """Kept sorted by the policy's key."""
        self.running: list[Sequence] = []
        """Kept sorted by preemption order: the last one is preempted first."""
        self.num_preemptions = 0
        """Every preemption by recompute, for lack of blocks or for priority."""
        self.num_priority_preemptions = 0
        """Those made only to admit a more urgent waiting sequence."""
        self._num_arrivals = 0
        self._num_admissions = 0

    # ---- ordering -------------------------------------------------------

    def _waiting_key(self, seq: Sequence) -> tuple[int, int]:
        if self.config.policy is Policy.PRIORITY:
            return (seq.priority, seq.arrival_order)
        if self.config.policy is Policy.SJF:
            # The job's size as far as it is known up front: prompt plus the output it may ask for.
            return (seq.num_prompt_tokens + seq.max_tokens, seq.arrival_order)
        return (0, seq.arrival_order)

    def _running_key(self, seq: Sequence) -> tuple[int, int, int]:
        # Padding sorts last so it is always the first to give its blocks up.
        priority = seq.priority if self.config.policy is Policy.PRIORITY else 0
        return (int(seq.is_padding), priority, seq.admit_order)

    # ---- requests -------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        bm = self.block_manager
        if bm.num_blocks_for(seq.num_tokens) > bm.num_blocks:
            raise ValueError(
                f"prompt: {seq.num_tokens} tokens can never fit in the KV cache "
                f"({bm.num_blocks} blocks of {bm.block_size} tokens)"
            )
        if seq.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt: {seq.num_tokens} tokens exceed max_model_len {self.config.max_model_len}"
            )
        assert seq.status is SequenceStatus.WAITING and not seq.block_table
        seq.arrival_order = self._num_arrivals
        self._num_arrivals += 1
        seq.arrival_time = self.clock()
        bisect.insort(self.waiting, seq, key=self._waiting_key)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish an unfinished request as aborted; None when there is none by that id."""
        for seq in self.waiting + self.running:
            if seq.request_id == request_id and not seq.is_finished:
                self.finish(seq, FinishReason.ABORT)
                return seq
        return None

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        assert not seq.is_finished
        seq.drop_pending_tokens()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq in self.waiting:
            self.waiting.remove(seq)
            self.block_manager.free(seq)
            return
        if self.config.batching is not BatchingMode.CONTINUOUS and any(
            not s.is_finished for s in self.running if s is not seq
        ):
            self.running.remove(seq)
            seq.is_padding = True
            bisect.insort(self.running, seq, key=self._running_key)
            return
        self.running.remove(seq)
        self.block_manager.free(seq)
        # The last real member of a static/dynamic group is done: release its padding.
        for pad in [s for s in self.running if s.is_padding]:
            self.running.remove(pad)
            self.block_manager.free(pad)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(not s.is_padding for s in self.running)

    @property
    def num_running(self) -> int:
        return sum(1 for s in self.running if not s.is_padding)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- the step -------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.config.batching is not BatchingMode.CONTINUOUS:
            if not self.running and self._group_is_ready():
                self._start_group()
            self._schedule_running(out, budget)
            return out
        self._lower_prefill_left = self._lower_prefill_tokens()
        cutoff = self._prefill_alone_cutoff()
        if cutoff is None:
            budget = self._schedule_running(out, budget)
        else:
            budget = self._schedule_running(out, budget, up_to_priority=cutoff)
            started = self._start_waiting(out, budget, up_to_priority=cutoff)
            if started or any(s.start_pos < s.seq.num_tokens - 1 for s in out.scheduled):
                return out
            # No urgent prefill could run after all: the less urgent sequences run in this step too.
            budget = self.config.max_num_batched_tokens - out.num_batched_tokens
            budget = self._schedule_running(out, budget, skip={s.seq for s in out.scheduled})
        self._start_waiting(out, budget)
        return out

    def _lower_prefill_tokens(self) -> int | None:
        """This step's allowance of prompt tokens for the less urgent sequences (``lower_prefill_tokens``);
        None: no allowance but the step's budget."""
        if self.config.prefill_alone_priority is None or self.config.policy is not Policy.PRIORITY:
            return None
        return self.config.lower_prefill_tokens

    def _capped_prefill(self, seq: Sequence, num_new: int) -> int:
        """``num_new`` prompt tokens of ``seq``, cut to what is left of the less urgent sequences' allowance
        when ``seq`` is one of them and prefills (a decode's one token is never cut); the allowance shrinks."""
        left, cutoff = self._lower_prefill_left, self.config.prefill_alone_priority
        if left is None or cutoff is None or seq.priority <= cutoff or num_new <= 1:
            return num_new
        num_new = min(num_new, left)
        self._lower_prefill_left = left - num_new
        return num_new

    def _prefill_alone_cutoff(self) -> int | None:
        """``prefill_alone_priority`` when this step should prefill urgent sequences without the less urgent
        running ones: an urgent one waits or is part-way through its prefill, and someone less urgent runs."""
        cutoff = self.config.prefill_alone_priority
        if cutoff is None or self.config.policy is not Policy.PRIORITY:
            return None
        if not any(s.priority > cutoff and not s.is_padding for s in self.running):
            return None  # nobody would be left out: an ordinary step
        urgent_waits = bool(self.waiting) and self.waiting[0].priority <= cutoff
        urgent_prefills = any(s.priority <= cutoff and s.num_uncomputed_tokens > 1 for s in self.running)
        return cutoff if urgent_waits or urgent_prefills else None

    def _schedule_running(self, out: SchedulerOutput, budget: int, up_to_priority: int | None = None,
                          skip: set[Sequence] | None = None) -> int:
        """Schedule the running sequences' next tokens, all of them or only those whose priority number is at
        most ``up_to_priority``, less any in ``skip``; returns the budget left."""
        bm = self.block_manager
        block_size = bm.block_size
        preempted: set[Sequence] = set()  # a set: a scan of `running` per sequence made a step O(n^2)
        for seq in list(self.running):
            if budget == 0:
                break
            if seq in preempted:  # earlier in this loop
                continue
            if (up_to_priority is not None and seq.priority > up_to_priority) or (skip and seq in skip):
                continue
            num_output = len(seq.output_token_ids)
            if seq.is_padding:
                # Padding stops once it would run past the context length.
                num_new = 1 if seq.num_computed_tokens < self.config.max_model_len else 0
            elif num_output >= seq.max_tokens:
                # Its last token is sampled (its stop check not run yet, or its value still on the device): it
                # finishes when that is read, and computing that token's KV would serve no one.
                continue
            else:
                num_new = min(len(seq.prompt_token_ids) + num_output - seq.num_computed_tokens, budget)
                if self._lower_prefill_left is not None:
                    num_new = self._capped_prefill(seq, num_new)
            if num_new == 0:
                continue
            spec = self._fitting_spec_tokens(seq, num_new, budget) if seq.spec_token_ids else []
            if not spec and seq.num_computed_tokens + num_new <= len(seq.block_table) * block_size:
                # Its tables' blocks hold the new tokens (a decode inside its last block, the usual case).
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                continue
            while not bm.can_allocate(seq, num_new):
                victim = self.running[-1]
                budget += self._preempt(victim, out)
                preempted.add(victim)
                if victim is seq:
                    break
            if seq in preempted:
                continue
            bm.allocate_for(seq, num_new + len(spec))
            out.scheduled.append(ScheduledSeq(seq, num_new + len(spec), spec))
            budget -= num_new + len(spec)
        return budget

    def _fitting_spec_tokens(self, seq: Sequence, num_new: int, budget: int) -> list[int]:
        """The proposed tokens ``seq`` verifies this step: only after its last known token, only as many as the
        budget, the context and the free blocks allow; nobody is preempted to make room for a proposal."""
        spec, seq.spec_token_ids = seq.spec_token_ids, []
        if not spec or seq.is_padding or num_new != seq.num_uncomputed_tokens:
            return []
        spec = spec[: max(0, min(budget - num_new, self.config.max_model_len - seq.num_tokens))]
        while spec and not self.block_manager.can_allocate(seq, num_new + len(spec)):
            spec = spec[:-1]
        return spec

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Preempt ``seq`` by recompute; returns the token budget it gives back."""
        refund = 0
        for i, s in enumerate(out.scheduled):
            if s.seq is seq:
                refund = s.num_new_tokens
                del out.scheduled[i]
                break
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.spec_token_ids = []
        if seq.is_padding:
            # Padding holds nothing anyone will read; dropping it just shrinks the group.
            return refund
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=self._waiting_key)
        out.preempted.append(seq)
        return refund

    def _start_waiting(self, out: SchedulerOutput, budget: int, up_to_priority: int | None = None) -> int:
        """Admit waiting sequences in policy order (only those whose priority number is at most
        ``up_to_priority``, when given) while slots, blocks and budget allow; returns how many started."""
        bm = self.block_manager
        started = 0
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if up_to_priority is not None and seq.priority > up_to_priority:
                break
            if seq.num_pending_tokens:
                break  # preempted while its last token was on its way: its prompt is known next step
            prefix = bm.lookup_prefix(seq.token_ids, seq.token_hashes)
            num_new = self._capped_prefill(seq, min(seq.num_tokens - prefix.num_blocks * bm.block_size, budget))
            if num_new == 0:
                break  # the less urgent ones' allowance is spent; everyone behind is less urgent still
            if len(self.running) >= self.config.max_num_seqs or not bm.can_allocate(seq, num_new, prefix):
                victims = self._priority_victims(seq, num_new, prefix)
                if not victims:
                    break
                for victim in victims:
                    budget += self._preempt(victim, out)
                    self.num_priority_preemptions += 1
                # The victims sort after ``seq`` in the waiting order, so it is still first.
                assert self.waiting[0] is seq
            self._start_running(seq)
            bm.take_prefix(seq, prefix)
            bm.allocate_for(seq, num_new)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            started += 1
        return started

    def _priority_victims(self, seq: Sequence, num_new: int, prefix: CachedPrefix) -> list[Sequence]:
        """The running sequences to preempt so that ``seq`` is admitted now; [] when none will do.

        Only under the ``priority`` policy, and only sequences of strictly
        lower priority (higher number), least urgent and latest admitted
        first. All or nothing: nobody is preempted unless ``seq`` then fits.
        """
        if self.config.policy is not Policy.PRIORITY:
            return []
        candidates: list[Sequence] = []
        for running in reversed(self.running):
            if running.is_padding:
                continue
            if running.priority <= seq.priority:
                break  # running is sorted by priority: everyone left is at least as urgent
            candidates.append(running)

        def makes_room(victims: list[Sequence]) -> bool:
            return len(self.running) - len(victims) < self.config.max_num_seqs and self.block_manager.can_allocate(
                seq, num_new, prefix, released=victims)

        # Releasing more never frees less, so one check over all of them rules out the hopeless case cheaply.
        if not candidates or not makes_room(candidates):
            return []
        return next(candidates[:n] for n in range(1, len(candidates) + 1) if makes_room(candidates[:n]))

    def _group_is_ready(self) -> bool:
        if not self.waiting:
            return False
        if self.config.batching is BatchingMode.STATIC or len(self.waiting) >= self.config.max_num_seqs:
            return True
        oldest = min(s.arrival_time for s in self.waiting)
        return (self.clock() - oldest) * 1000.0 >= self.config.max_wait_ms

    def _start_group(self) -> None:
        """Admit up to max_num_seqs waiting sequences whose whole known tokens fit in blocks now.

        Only the prefix-cache hits are attached here; the prefill itself runs
        through the running path, chunked by the token budget.
        """
        bm = self.block_manager
        num_reserved = 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending_tokens:
                break  # preempted while its last token was on its way: its prompt is known next step
            prefix = bm.lookup_prefix(seq.token_ids, seq.token_hashes)
            # Taking an evictable hit block takes it out of the pool too: can_allocate counts that.
            num_new = seq.num_tokens - prefix.num_blocks * bm.block_size
            if self.running and not bm.can_allocate(seq, num_new, prefix, num_reserved=num_reserved):
                break
            self._start_running(seq)
            bm.take_prefix(seq, prefix)
            num_reserved += bm.num_new_blocks_needed(seq, num_new)

    def _start_running(self, seq: Sequence) -> None:
        self.waiting.pop(0)
        seq.status = SequenceStatus.RUNNING
        seq.admit_order = self._num_admissions
        self._num_admissions += 1
        bisect.insort(self.running, seq, key=self._running_key)

    def advance_launched(self, output: SchedulerOutput) -> None:
        """Record a launched forward whose tokens are still on the device: computed tokens move on and each
        sampling sequence gets a ``PENDING_TOKEN``, so the next step can be scheduled now; ``resolve`` fills the
        value in. Without proposed tokens only (how many of those are accepted is not known yet)."""
        for s in output.scheduled:
            seq = s.seq
            assert seq.num_computed_tokens == s.start_pos and not s.num_spec_tokens
            seq.num_computed_tokens += s.num_new_tokens
            if seq.is_padding:
                continue
            if s.is_sampling:
                seq.output_token_ids.append(PENDING_TOKEN)
                seq.num_pending_tokens += 1
            self._cache_known_blocks(seq)

    def resolve(self, seq: Sequence, index: int, token_id: int) -> None:
        """The value of ``seq``'s pending output token ``index`` is now known."""
        assert seq.output_token_ids[index] == PENDING_TOKEN and index == seq.num_known_output_tokens, index
        seq.output_token_ids[index] = token_id
        seq.num_pending_tokens -= 1
        self._cache_known_blocks(seq)

    def _cache_known_blocks(self, seq: Sequence) -> None:
        """Hash ``seq``'s full computed blocks once no pending token is among their tokens."""
        num_computed = seq.num_computed_tokens
        if (num_computed <= len(seq.prompt_token_ids) + len(seq.output_token_ids) - seq.num_pending_tokens
                and len(seq.block_hashes) < num_computed // self.block_manager.block_size):
            self.block_manager.cache_computed_blocks(seq)

    def advance(self, output: SchedulerOutput, sampled_tokens_by_request: dict[str, list[int]]) -> None:
        """Record a finished forward: computed tokens move on and sampled tokens are appended.

        A sampling sequence gets one token, or, when it verified proposed tokens, the accepted ones and the
        token after them: only the accepted proposals count as computed, and the blocks past its computed
        tokens (written for rejected proposals) go back to the pool.
        """
        for s in output.scheduled:
            seq = s.seq
            assert seq.num_computed_tokens == s.start_pos
            if seq.is_padding:
                seq.num_computed_tokens += s.num_new_tokens
                continue
            seq.num_computed_tokens += s.num_new_tokens - s.num_spec_tokens
            if s.is_sampling:
                tokens = sampled_tokens_by_request[seq.request_id]
                assert 1 <= len(tokens) <= s.num_spec_tokens + 1, (len(tokens), s.num_spec_tokens)
                assert tokens[:-1] == s.spec_token_ids[: len(tokens) - 1], "only a prefix of the proposal is accepted"
                seq.num_computed_tokens += len(tokens) - 1
                seq.output_token_ids.extend(tokens)
                if s.num_spec_tokens:
                    self.block_manager.trim_to_computed(seq)
            self.block_manager.cache_computed_blocks(seq)
