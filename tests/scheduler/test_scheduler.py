"""The step scheduler on its own: no model, a deterministic token source and a test clock."""

from __future__ import annotations

import random

import pytest

from scheduler import (
    BlockManager,
    FinishReason,
    SamplingParams,
    ScheduledSeq,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    Sequence,
    SequenceStatus,
)


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, clock: Clock | None = None, **config: object
) -> Scheduler:
    cfg = SchedulerConfig(**{"max_model_len": num_blocks * block_size, **config})  # type: ignore[arg-type]
    return Scheduler(cfg, BlockManager(num_blocks, block_size), clock or Clock())


def make_seq(request_id: str, num_prompt: int, max_tokens: int = 4, priority: int = 0) -> Sequence:
    # Seeded by the id itself (random.Random hashes a str seed with SHA-512), so prompts are the same in
    # every process: str hash() changes with PYTHONHASHSEED and could make two ids share a prefix by chance.
    rng = random.Random(request_id)
    prompt = [rng.randrange(50) for _ in range(num_prompt)]
    return Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens), priority=priority)


def step(sched: Scheduler) -> SchedulerOutput:
    """One step with a stand-in token source; finishes sequences at max_tokens."""
    out = sched.schedule()
    sampled = {s.seq.request_id: [7] for s in out.scheduled if s.is_sampling}
    sched.advance(out, sampled)
    for s in out.scheduled:
        seq = s.seq
        if s.is_sampling and seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, FinishReason.LENGTH)
    return out


def run_all(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched))
        assert len(outs) < max_steps
    return outs


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="batching"):
        SchedulerConfig(batching="greedy")
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="random")
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


def test_respects_max_num_seqs_and_token_budget() -> None:
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=10)
    seqs = [make_seq(f"r{i}", 3) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    outs = run_all(sched)
    assert all(len(o.scheduled) <= 3 and o.num_batched_tokens <= 10 for o in outs)
    assert outs[0].num_batched_tokens == 9
    assert all(seq.num_output_tokens == 4 and seq.is_finished for seq in seqs)
    assert sched.block_manager.num_free_blocks == 64


def test_long_prompt_is_chunked() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    seq = make_seq("long", 21, max_tokens=2)
    sched.add(seq)
    outs = run_all(sched)
    assert [o.scheduled[0].num_new_tokens for o in outs] == [8, 8, 5, 1]
    assert [o.scheduled[0].is_sampling for o in outs] == [False, False, True, True]
    assert seq.num_output_tokens == 2


def test_decodes_go_first_and_last_admitted_prompt_is_chunked() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add(make_seq("a", 4, max_tokens=10))
    step(sched)
    sched.add(make_seq("b", 20))
    out = step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]


def test_preempts_most_recently_admitted_by_recompute() -> None:
    # 6 blocks of 4: three 7-token prompts take 2 blocks each, decode needs more.
    sched = make_scheduler(num_blocks=6, block_size=4)
    seqs = [make_seq(f"r{i}", 7, max_tokens=6) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    step(sched)
    step(sched)  # every sequence now has 8 tokens
    out = step(sched)  # each needs a third block: r2 gives its two up
    assert [s.request_id for s in out.preempted] == ["r2"]
    assert [s.seq.request_id for s in out.scheduled] == ["r0", "r1"]
    assert seqs[2].status is SequenceStatus.WAITING and seqs[2].num_computed_tokens == 0
    assert seqs[2].num_output_tokens == 2  # outputs are kept for the recompute
    run_all(sched)
    assert all(seq.num_output_tokens == 6 for seq in seqs)
    assert sched.num_preemptions == 1 and seqs[2].num_preemptions == 1
    assert sched.block_manager.num_free_blocks == 6


def test_priority_policy_preempts_the_less_urgent_even_if_admitted_first() -> None:
    sched = make_scheduler(num_blocks=3, block_size=4, policy="priority")
    low, high = make_seq("low", 5, max_tokens=6, priority=5), make_seq("high", 3, max_tokens=6, priority=0)
    sched.add(low)
    step(sched)
    sched.add(high)
    step(sched)
    step(sched)
    out = step(sched)  # "high" needs its second block; "low" holds the other two
    assert out.preempted == [low]
    run_all(sched)
    assert low.num_output_tokens == high.num_output_tokens == 6


def test_priority_policy_admits_by_priority() -> None:
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    for name, prio in (("low", 5), ("high", 0), ("mid", 2)):
        sched.add(make_seq(name, 2, max_tokens=1, priority=prio))
    order = [o.scheduled[0].seq.request_id for o in run_all(sched)]
    assert order == ["high", "mid", "low"]


def test_sjf_runs_shortest_job_first() -> None:
    sched = make_scheduler(max_num_seqs=1, policy="sjf")
    sched.add(make_seq("big", 10, max_tokens=1))
    sched.add(make_seq("small", 2, max_tokens=1))
    sched.add(make_seq("medium", 5, max_tokens=1))
    order = [o.scheduled[0].seq.request_id for o in run_all(sched)]
    assert order == ["small", "medium", "big"]


def test_fcfs_runs_in_arrival_order() -> None:
    sched = make_scheduler(max_num_seqs=1, policy="fcfs")
    for name in ("c", "a", "b"):
        sched.add(make_seq(name, 3, max_tokens=1, priority=-ord(name)))
    order = [o.scheduled[0].seq.request_id for o in run_all(sched)]
    assert order == ["c", "a", "b"]


def test_abort_frees_blocks_and_reports_the_sequence() -> None:
    sched = make_scheduler()
    seq = make_seq("x", 9, max_tokens=10)
    sched.add(seq)
    step(sched)
    assert sched.block_manager.num_used_blocks == 3
    assert sched.abort("x") is seq
    assert seq.finish_reason is FinishReason.ABORT
    assert sched.abort("x") is None
    assert sched.block_manager.num_used_blocks == 0 and not sched.has_unfinished()


def test_prompt_that_can_never_fit_is_rejected() -> None:
    sched = make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="prompt"):
        sched.add(make_seq("huge", 9))


def test_static_groups_keep_finished_members_as_padding() -> None:
    sched = make_scheduler(batching="static", max_num_seqs=2)
    short, long_, next_ = make_seq("short", 3, 1), make_seq("long", 3, 4), make_seq("next", 3, 1)
    for seq in (short, long_, next_):
        sched.add(seq)
    outs = run_all(sched)
    names = [[s.seq.request_id for s in o.scheduled] for o in outs]
    # "short" finishes after the first step but keeps computing as padding;
    # "next" waits for the whole group to drain.
    assert names == [["short", "long"]] + [["long", "short"]] * 3 + [["next"]]
    assert short.output_token_ids == [7] and long_.num_output_tokens == 4
    assert not any(s.is_sampling for o in outs[1:4] for s in o.scheduled if s.seq is short)
    assert sched.block_manager.num_free_blocks == 64


def test_dynamic_waits_for_the_batch_to_fill_or_time_out() -> None:
    clock = Clock()
    sched = make_scheduler(batching="dynamic", max_num_seqs=3, max_wait_ms=50, clock=clock)
    sched.add(make_seq("a", 2, 1))
    assert sched.schedule().is_empty
    clock.now_s += 0.049
    assert sched.schedule().is_empty
    clock.now_s += 0.002
    out = step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["a"]
    # A full batch goes without waiting.
    for name in ("b", "c", "d"):
        sched.add(make_seq(name, 2, 1))
    assert len(step(sched).scheduled) == 3


def test_scheduler_package_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, scheduler, scheduler.scheduler; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_sequence_can_preempt_itself() -> None:
    # Pool of 3 blocks of 4: "a" (5-token prompt) holds 2, "b" (3 tokens) holds 1.
    # At its fifth token "b" needs a block and is itself the latest admitted.
    sched = make_scheduler(num_blocks=3, block_size=4)
    a, b = make_seq("a", 5, max_tokens=8), make_seq("b", 3, max_tokens=8)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    out = step(sched)
    assert out.preempted == [b] and [s.seq for s in out.scheduled] == [a]
    assert b.status is SequenceStatus.WAITING and b.num_output_tokens == 2
    run_all(sched)
    assert a.num_output_tokens == b.num_output_tokens == 8
    sched.block_manager.check_invariants()
    assert sched.block_manager.num_free_blocks == 3


def test_a_scheduled_sequences_logit_row_is_fixed_when_scheduled() -> None:
    seq = Sequence("chunked", list(range(8)), SamplingParams(max_tokens=4))
    chunk = ScheduledSeq(seq, num_new_tokens=4)  # the first half of its prompt: no token sampled, no logits
    assert not chunk.is_sampling and not chunk.needs_logits
    # Aborted while that step runs, a static group's member stays on as padding, whose later steps pay for
    # logits; the step already launched computed none for it.
    seq.is_padding = True
    assert not chunk.needs_logits
    assert ScheduledSeq(seq, num_new_tokens=4).needs_logits


def test_scheduling_ahead_with_pending_tokens() -> None:
    """A launched step's sampled tokens are pending: the next step is scheduled over them, blocks holding one are
    not hashed, a sequence preempted with one waits until it is read, and finishing drops it."""
    from scheduler.sequence import PENDING_TOKEN

    sched = make_scheduler(num_blocks=3, block_size=4, max_num_seqs=2)
    a, b = make_seq("a", 7, max_tokens=8), make_seq("b", 3, max_tokens=8)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    sched.advance_launched(first)
    assert a.output_token_ids == [PENDING_TOKEN] and a.num_pending_tokens == 1 and a.num_known_output_tokens == 0
    assert len(a.block_hashes) == 1  # the full prompt block: no pending token in it
    # The next step is scheduled before the first one's tokens are read: each decodes its pending token.
    second = sched.schedule()
    assert [(s.seq, s.token_ids) for s in second.scheduled] == [(a, [PENDING_TOKEN]), (b, [PENDING_TOKEN])]
    sched.advance_launched(second)
    assert a.num_computed_tokens == 8 and a.output_token_ids == [PENDING_TOKEN, PENDING_TOKEN]
    assert len(a.block_hashes) == 1, "the block ending in a pending token is not hashed yet"
    sched.resolve(a, 0, 41)
    assert a.output_token_ids == [41, PENDING_TOKEN] and len(a.block_hashes) == 2
    sched.resolve(b, 0, 42)
    # Out of blocks: b (admitted last) is preempted, its second token still pending; it is not re-admitted
    # before that token is read, then is.
    third = sched.schedule()
    assert third.preempted == [b] and b.num_pending_tokens == 1
    sched.advance_launched(third)
    sched.finish(a, FinishReason.STOP)
    assert a.output_token_ids == [41] and a.num_pending_tokens == 0
    assert sched.schedule().is_empty
    sched.resolve(b, 1, 43)
    fourth = sched.schedule()
    assert [s.seq for s in fourth.scheduled] == [b]
    resumed = fourth.scheduled[0]
    assert resumed.token_ids == (b.prompt_token_ids + [42, 43])[resumed.start_pos:]


def test_a_sequence_with_its_last_token_sampled_is_not_scheduled_again() -> None:
    """Its stop check (or the read of its pending token) finishes it; a step computing that token's KV would only
    take a block and a slot."""
    sched = make_scheduler(num_blocks=8, block_size=4)
    seq = make_seq("a", 3, max_tokens=2)
    sched.add(seq)
    sched.advance_launched(sched.schedule())  # the prefill draws token 1
    assert [s.seq for s in sched.schedule().scheduled] == [seq]  # which the next step computes
    sched.resolve(seq, 0, 9)
    sched.advance_launched(SchedulerOutput(scheduled=[ScheduledSeq(seq, 1)]))  # and draws token 2, the last
    assert seq.num_output_tokens == 2
    assert sched.schedule().is_empty
