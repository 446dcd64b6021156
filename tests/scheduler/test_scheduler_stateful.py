"""The scheduler and the block manager driven through random operations, checked after every one.

A stand-in model makes each greedy token a function of every token before it, and a shadow KV cache
records, per block slot, the exact token prefix whose KV a step wrote there. The machine calls the
scheduler as ``worker/engine/engine.py`` does (proposals before each schedule; with async scheduling:
complete the previous step, schedule and launch the next, then the previous step's stop checks), so:

- every forward reads, through its block table, the KV of its own prefix (prefix-cache hits included),
  and every cached block holds the KV its chained hash names;
- every block's reference count is the number of live block tables holding it, and the pool returns to
  fully free once every request is done;
- steps respect the slots, the token budget, the policy's order and the preemption order;
- every request ends finished (with the reference model's tokens, through any number of preemptions)
  or aborted, or is still waiting or running; nothing is lost.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler import (
    BlockManager,
    FinishReason,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    ScheduledSeq,
    Sequence,
    SequenceStatus,
)
from scheduler.block_manager import ROOT_HASH, chain_hash
from scheduler.scheduler_config import BatchingMode, Policy

VOCAB_SIZE = 5
STOP_TOKEN = 0
"""Ends the output of a request asking for it (``stop_token_ids``)."""
GARBAGE = ()
"""What padding writes into the shadow cache: KV nobody may read."""


def next_token(tokens: list[int]) -> int:
    """The stand-in model's greedy token: it depends on every earlier token, as attention does."""
    return hash(tuple(tokens)) % VOCAB_SIZE


def reference_output(seq: Sequence) -> list[int]:
    tokens, output = list(seq.prompt_token_ids), []
    while len(output) < seq.max_tokens:
        token = next_token(tokens)
        tokens.append(token)
        output.append(token)
        if token in seq.params.stop_token_ids:
            break
    return output


@dataclass(frozen=True)
class Setup:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    batching: BatchingMode
    policy: Policy
    prefill_alone_priority: int | None
    lower_prefill_tokens: int | None
    async_scheduling: bool
    speculative: bool


SETUPS = st.builds(
    Setup,
    num_blocks=st.integers(2, 8),
    block_size=st.sampled_from([1, 2, 4]),
    enable_prefix_caching=st.booleans(),
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(1, 16),
    batching=st.sampled_from([BatchingMode.CONTINUOUS] * 3 + [BatchingMode.STATIC, BatchingMode.DYNAMIC]),
    policy=st.sampled_from([Policy.PRIORITY, Policy.PRIORITY, Policy.FCFS, Policy.SJF]),
    prefill_alone_priority=st.none() | st.integers(0, 1),
    lower_prefill_tokens=st.none() | st.integers(1, 4),
    async_scheduling=st.booleans(),
    speculative=st.booleans(),
)
# Prompts start with a slice of one of these, so that they share prefixes.
BASE_PROMPTS = [[random.Random(i).randrange(VOCAB_SIZE) for _ in range(24)] for i in range(2)]


@dataclass(frozen=True)
class Request:
    base: int
    num_shared: int
    suffix: list[int]
    priority: int
    max_tokens: int
    stops: bool
    num_resumed: int
    """Output tokens it brings from a checkpoint (``resume_token_ids``)."""


REQUESTS = st.builds(
    Request, base=st.integers(0, len(BASE_PROMPTS) - 1), num_shared=st.integers(0, 24),
    suffix=st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=6), priority=st.integers(0, 2),
    max_tokens=st.integers(1, 8), stops=st.booleans(), num_resumed=st.sampled_from([0, 0, 0, 1, 3]))


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(setup=SETUPS)
    def start(self, setup: Setup) -> None:
        self.setup = setup
        # As the engine sets it: one sequence of the whole context always fits alone.
        self.max_model_len = setup.num_blocks * setup.block_size
        self.config = SchedulerConfig(
            max_num_seqs=setup.max_num_seqs, max_num_batched_tokens=setup.max_num_batched_tokens,
            max_model_len=self.max_model_len, batching=setup.batching, policy=setup.policy, max_wait_ms=10.0,
            prefill_alone_priority=setup.prefill_alone_priority, lower_prefill_tokens=setup.lower_prefill_tokens)
        self.bm = BlockManager(setup.num_blocks, setup.block_size, setup.enable_prefix_caching)
        self.clock = Clock()
        self.sched = Scheduler(self.config, self.bm, self.clock)
        self.seqs: dict[str, Sequence] = {}
        self.in_flight: SchedulerOutput | None = None
        self.kv: list[list[tuple[int, ...] | None]] = [[None] * setup.block_size for _ in range(setup.num_blocks)]
        """Per block slot: the token prefix whose last token's KV was written there."""

    # ---- operations -----------------------------------------------------

    @rule(requests=st.lists(REQUESTS, min_size=1, max_size=4))
    def add(self, requests: list[Request]) -> None:
        for request in requests:
            prompt = (BASE_PROMPTS[request.base][: request.num_shared] + request.suffix)[: self.max_model_len - 1]
            # What the engine admits: the prompt and every token it may ask for fit the context.
            max_tokens = min(request.max_tokens, self.max_model_len - len(prompt))
            params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[STOP_TOKEN] if request.stops else [])
            seq = Sequence(f"r{len(self.seqs)}", prompt, params, priority=request.priority)
            # A resumed request's outputs so far; the engine admits it only while it has tokens left to make.
            resumed = reference_output(seq)[: request.num_resumed]
            if len(resumed) < max_tokens and STOP_TOKEN not in resumed:
                seq.output_token_ids = resumed
            self.sched.add(seq)
            self.seqs[seq.request_id] = seq

    @precondition(lambda self: any(not s.is_finished for s in self.seqs.values()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from([s for s in self.seqs.values() if not s.is_finished]))
        was_waiting = seq.status is SequenceStatus.WAITING
        assert self.sched.abort(seq.request_id) is seq
        assert seq.finish_reason is FinishReason.ABORT and seq not in self.sched.waiting
        if was_waiting or not seq.is_padding:
            assert not seq.block_table and seq not in self.sched.running
        assert self.sched.abort(seq.request_id) is None

    @rule(num_steps=st.integers(1, 4), wait_ms=st.sampled_from([0.0, 5.0, 20.0]), data=st.data())
    def step(self, num_steps: int, wait_ms: float, data: st.DataObject) -> None:
        self.clock.now_s += wait_ms / 1000.0
        for _ in range(num_steps):
            self._step(data)
            self.check_state()

    def teardown(self) -> None:
        if not hasattr(self, "sched") or sys.exc_info()[1] is not None:
            return  # a failed operation is the report: draining on top of it would only bury it
        # The oldest running sequence is never preempted for another's blocks, so some request gets a token or
        # finishes at least every max_model_len steps (a one-token budget prefilling a whole context).
        progress, num_idle_steps = self._progress(), 0
        while self.sched.has_unfinished() or self.in_flight is not None:
            self.clock.now_s += 1.0  # a dynamic group forms at once
            self._step(None)
            self.check_state()
            progress, last_progress = self._progress(), progress
            num_idle_steps = 0 if progress != last_progress else num_idle_steps + 1
            assert num_idle_steps <= 2 * self.max_model_len, "no progress"
        assert not self.sched.running and not self.sched.waiting
        assert all(s.is_finished for s in self.seqs.values())
        assert self.bm.num_free_blocks == self.bm.num_blocks, "every block is back in the pool"
        assert self.bm.num_used_blocks == 0

    def _progress(self) -> tuple[int, int]:
        return (sum(s.is_finished for s in self.seqs.values()), sum(s.num_output_tokens for s in self.seqs.values()))

    # ---- the engine's step ----------------------------------------------

    def _step(self, data: st.DataObject | None) -> None:
        if self.setup.async_scheduling:
            done = self._complete(self.in_flight) if self.in_flight is not None else []
            self.in_flight = None
            out = self._schedule(data)
            if not out.is_empty:
                self.in_flight = self._launch(out)
            self._postprocess(done)
        else:
            out = self._schedule(data)
            if not out.is_empty:
                self._postprocess(self._complete(self._launch(out)))

    def _propose(self, data: st.DataObject | None) -> None:
        """The engine's proposals: after a decoding sequence's last token, never past max_tokens or the context;
        the true continuation, up to a first wrong token."""
        for seq in self.sched.running:
            seq.spec_token_ids = []
            room = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
            if seq.is_padding or seq.num_uncomputed_tokens != 1 or room <= 0:
                continue
            k = data.draw(st.integers(0, min(3, room))) if data is not None else min(2, room)
            wrong_at = data.draw(st.integers(0, k)) if data is not None and k else k
            tokens = seq.token_ids
            for i in range(k):
                token = next_token(tokens)
                tokens.append((token + 1) % VOCAB_SIZE if i == wrong_at else token)
            seq.spec_token_ids = tokens[seq.num_tokens:]

    def _schedule(self, data: st.DataObject | None) -> SchedulerOutput:
        if self.setup.speculative:
            self._propose(data)
        before = {s: (s.admit_order, s.is_padding) for s in self.sched.running}
        cutoff_applies = self._prefill_alone_applies()
        out = self.sched.schedule()
        self.check_schedule(out, before, cutoff_applies)
        return out

    def _launch(self, out: SchedulerOutput) -> SchedulerOutput:
        """The forward: writes every scheduled token's KV, then each sequence reads its whole context."""
        bs = self.setup.block_size
        for s in out.scheduled:
            table, end = list(s.seq.block_table), s.start_pos + s.num_new_tokens
            if s.seq.is_padding:
                for pos in range(s.start_pos, end):
                    self.kv[table[pos // bs]][pos % bs] = GARBAGE
                continue
            tokens = s.seq.token_ids[: end - s.num_spec_tokens] + s.spec_token_ids
            assert len(tokens) == end
            for pos in range(s.start_pos, end):
                self.kv[table[pos // bs]][pos % bs] = tuple(tokens[: pos + 1])
            for pos in range(end):
                assert self.kv[table[pos // bs]][pos % bs] == tuple(tokens[: pos + 1]), (
                    f"{s.seq.request_id} reads wrong KV at position {pos}")
        return out

    def _complete(self, out: SchedulerOutput) -> list[tuple[Sequence, list[int]]]:
        """Greedy verification and sampling; sequences finished since the launch are left out."""
        sampling = [s for s in out.scheduled if s.is_sampling and not s.seq.is_finished]
        sampled: dict[str, list[int]] = {}
        for s in sampling:
            tokens = s.seq.token_ids
            accepted: list[int] = []
            for proposed in s.spec_token_ids:
                if proposed != next_token(tokens + accepted):
                    break
                accepted.append(proposed)
            sampled[s.seq.request_id] = accepted + [next_token(tokens + accepted)]
        live = [s for s in out.scheduled if not s.seq.is_finished or s.seq.is_padding]
        self.sched.advance(SchedulerOutput(scheduled=live), sampled)
        return [(s.seq, sampled[s.seq.request_id]) for s in sampling]

    def _postprocess(self, done: list[tuple[Sequence, list[int]]]) -> None:
        for seq, tokens in done:
            num_before = seq.num_output_tokens - len(tokens)
            for i, token in enumerate(tokens):
                num_output = num_before + i + 1
                reason = (FinishReason.STOP if token in seq.params.stop_token_ids
                          else FinishReason.LENGTH if num_output >= seq.max_tokens else None)
                if reason is not None:
                    del seq.output_token_ids[num_output:]
                    self.sched.finish(seq, reason)
                    assert seq.output_token_ids == reference_output(seq), seq.request_id
                    break

    # ---- checks ---------------------------------------------------------

    def _prefill_alone_applies(self) -> bool:
        cutoff, sched = self.config.prefill_alone_priority, self.sched
        if (cutoff is None or self.config.policy is not Policy.PRIORITY
                or self.config.batching is not BatchingMode.CONTINUOUS):
            return False
        if not any(s.priority > cutoff and not s.is_padding for s in sched.running):
            return False
        return (bool(sched.waiting) and sched.waiting[0].priority <= cutoff) or any(
            s.priority <= cutoff and s.num_uncomputed_tokens > 1 for s in sched.running)

    def check_schedule(self, out: SchedulerOutput, before: dict[Sequence, tuple[int, bool]],
                       cutoff_applies: bool) -> None:
        config, sched, bm = self.config, self.sched, self.bm
        seqs = [s.seq for s in out.scheduled]
        assert len(set(seqs)) == len(seqs), "a sequence scheduled twice"
        assert len(seqs) <= config.max_num_seqs and out.num_batched_tokens <= config.max_num_batched_tokens
        for s in out.scheduled:
            seq = s.seq
            assert seq in sched.running and s.num_new_tokens >= 1
            assert len(seq.block_table) == bm.num_blocks_for(s.start_pos + s.num_new_tokens), "table covers the step"
            assert s.start_pos + s.num_new_tokens <= config.max_model_len
            if not seq.is_padding:
                num_known = s.num_new_tokens - s.num_spec_tokens
                assert s.start_pos + num_known <= seq.num_tokens
                assert not s.spec_token_ids or s.start_pos + num_known == seq.num_tokens
        for seq in out.preempted:
            assert not seq.is_finished and seq in before, f"{seq.request_id} admitted and preempted in one step"
            if seq in sched.waiting:
                assert not seq.block_table and seq.num_computed_tokens == 0
        admitted = [s for s in seqs if s not in before]
        still_waiting = [s for s in out.preempted if s in sched.waiting]
        if config.batching is BatchingMode.CONTINUOUS:
            # Admission in policy order: nobody left waiting comes before anyone admitted.
            for seq in admitted:
                assert all(sched._waiting_key(seq) < sched._waiting_key(w) for w in sched.waiting), seq.request_id
        # Preemption order: the ones that stay running and run come before every one preempted.
        for victim in still_waiting:
            victim_key = self._running_key(victim, before[victim][0])
            for seq in seqs:
                if seq in before and not before[seq][1]:
                    assert self._running_key(seq, before[seq][0]) < victim_key, (seq.request_id, victim.request_id)
        cutoff = config.prefill_alone_priority
        if cutoff_applies and cutoff is not None:
            urgent_prefill = any(
                s.seq.priority <= cutoff and (s.seq not in before or s.start_pos < s.seq.num_tokens - 1)
                for s in out.scheduled)
            if urgent_prefill:
                assert all(s.priority <= cutoff for s in seqs), "the urgent prefill runs alone"
        if (cutoff is not None and config.lower_prefill_tokens is not None and config.policy is Policy.PRIORITY
                and config.batching is BatchingMode.CONTINUOUS):
            lower = sum(n for s in out.scheduled if s.seq.priority > cutoff and not s.seq.is_padding
                        and (n := s.num_new_tokens - s.num_spec_tokens) > 1)
            assert lower <= config.lower_prefill_tokens

    def _running_key(self, seq: Sequence, admit_order: int) -> tuple[int, int]:
        return (seq.priority if self.config.policy is Policy.PRIORITY else 0, admit_order)

    @invariant()
    def check_state(self) -> None:
        if not hasattr(self, "sched"):
            return
        sched, bm, bs = self.sched, self.bm, self.setup.block_size
        bm.check_invariants()
        assert len(sched.running) <= self.config.max_num_seqs
        assert sched.waiting == sorted(sched.waiting, key=sched._waiting_key)
        assert sched.running == sorted(sched.running, key=sched._running_key)
        # Every request is in exactly one place.
        waiting, running = set(sched.waiting), set(sched.running)
        assert len(waiting) == len(sched.waiting) and len(running) == len(sched.running) and not waiting & running
        assert waiting | running <= set(self.seqs.values())
        for seq in self.seqs.values():
            if seq in waiting:
                assert seq.status is SequenceStatus.WAITING and not seq.block_table and seq.num_computed_tokens == 0
            elif seq in running:
                assert seq.status is (SequenceStatus.FINISHED if seq.is_padding else SequenceStatus.RUNNING)
            else:
                assert seq.is_finished and not seq.block_table, seq.request_id
        # Reference counts: the live tables holding each block; a table holds a block once.
        holders = [0] * bm.num_blocks
        in_flight = {s.seq: s.num_new_tokens for s in self.in_flight.scheduled} if self.in_flight else {}
        for seq in sched.running:
            assert len(set(seq.block_table)) == len(seq.block_table)
            for block in seq.block_table:
                holders[block] += 1
            expected = seq.num_computed_tokens + in_flight.get(seq, 0)
            assert len(seq.block_table) == bm.num_blocks_for(expected), f"{seq.request_id}: table size"
            if not seq.is_padding:
                assert seq.num_computed_tokens < seq.num_tokens
        assert holders == bm._ref_counts
        if not bm.enable_prefix_caching:
            assert not bm._cached and not bm._evictable
        # A cached block holds the KV of the very prefix its chained hash names.
        for h, block in bm._cached.items():
            prefix = self.kv[block][bs - 1]
            assert prefix and len(prefix) % bs == 0, f"block {block} cached with KV {prefix}"
            parent = ROOT_HASH
            for i in range(0, len(prefix), bs):
                parent = chain_hash(parent, prefix[i:i + bs])
            assert parent == h and bm._block_tokens[block] == prefix[-bs:]
            assert all(self.kv[block][i] == prefix[: len(prefix) - bs + i + 1] for i in range(bs))


def test_a_static_group_counts_the_cached_blocks_its_members_take() -> None:
    """A member whose prefix hit is evictable takes that block out of the pool: counted against the room the
    group's earlier members reserved, it does not fit, and is not admitted only to be preempted at once."""
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=3, max_model_len=3, batching="static",
                             policy="fcfs")
    sched = Scheduler(config, BlockManager(num_blocks=3, block_size=1), Clock())
    first = Sequence("first", [1], SamplingParams(max_tokens=1))
    sched.add(first)
    out = sched.schedule()
    sched.advance(out, {"first": [4]})
    sched.finish(first, FinishReason.LENGTH)
    assert sched.block_manager.num_cached_blocks == 1  # its one block, evictable now
    fresh = Sequence("fresh", [2, 3], SamplingParams(max_tokens=1))  # reserves 2 blocks
    hit = Sequence("hit", [1, 2], SamplingParams(max_tokens=1))  # takes the cached block and needs 1 more
    sched.add(fresh)
    sched.add(hit)
    out = sched.schedule()
    assert not out.preempted and sched.num_preemptions == 0
    assert sched.running == [fresh] and sched.waiting == [hit]
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(fresh, 2)]


SchedulerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None, derandomize=True, database=None,
    suppress_health_check=list(HealthCheck))
TestSchedulerMachine = SchedulerMachine.TestCase
