"""Priority preemption in the step scheduler: a more urgent waiting sequence takes a slot or blocks now.

Pure Python: no model, the stand-in token source of ``test_scheduler``.
"""

from __future__ import annotations

from scheduler import Scheduler, SequenceStatus
from tests.scheduler.test_scheduler import make_scheduler, make_seq, run_all, step


def running_ids(sched: Scheduler) -> set[str]:
    return {s.request_id for s in sched.running}


def test_a_more_urgent_sequence_takes_the_slot_of_the_least_urgent_in_the_same_step() -> None:
    sched = make_scheduler(max_num_seqs=2, policy="priority")
    first, second = make_seq("batch0", 9, max_tokens=20, priority=5), make_seq("batch1", 9, max_tokens=20, priority=5)
    sched.add(first)
    sched.add(second)
    for _ in range(4):
        step(sched)
    assert second.num_output_tokens == 4 and second.num_tokens == 13
    high = make_seq("high", 6, max_tokens=3, priority=0)
    sched.add(high)
    out = step(sched)
    # The latest admitted of the least urgent gives its slot up; "high" runs its prefill in this very step.
    assert out.preempted == [second]
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("batch0", 1), ("high", 6)]
    assert second.status is SequenceStatus.WAITING and second.num_computed_tokens == 0
    assert second.num_output_tokens == 4, "outputs are kept for the recompute"
    assert sched.num_priority_preemptions == sched.num_preemptions == 1
    # Its full computed blocks (12 of its 13 tokens were computed: 3 blocks of 4) stay cached, evictable.
    prefix = sched.block_manager.lookup_prefix(second.token_ids)
    assert prefix.num_blocks == 3
    sched.block_manager.check_invariants()

    # No thrashing: the displaced sequence waits behind "high" until a slot frees, and then re-prefills from the cache.
    while not high.is_finished:
        step(sched)
        assert "batch1" not in running_ids(sched)
    out = step(sched)
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("batch0", 1), ("batch1", 1)]
    assert second.num_cached_tokens == 12
    run_all(sched)
    assert first.num_output_tokens == second.num_output_tokens == 20 and high.num_output_tokens == 3
    assert sched.num_priority_preemptions == sched.num_preemptions == 1
    assert sched.block_manager.num_free_blocks == 64
    sched.block_manager.check_invariants()


def test_equal_or_higher_priority_is_never_preempted() -> None:
    sched = make_scheduler(max_num_seqs=2, policy="priority")
    running = [make_seq("a", 5, max_tokens=6, priority=3), make_seq("b", 5, max_tokens=6, priority=1)]
    for seq in running:
        sched.add(seq)
    step(sched)
    same = make_seq("same", 3, max_tokens=2, priority=3)
    sched.add(same)
    for _ in range(5):
        out = step(sched)
        assert not out.preempted and same.status is SequenceStatus.WAITING
    run_all(sched)
    assert same.num_output_tokens == 2 and sched.num_preemptions == 0


def test_the_fcfs_policy_never_preempts_for_priority() -> None:
    sched = make_scheduler(max_num_seqs=1, policy="fcfs")
    low = make_seq("low", 5, max_tokens=6, priority=9)
    sched.add(low)
    step(sched)
    high = make_seq("high", 3, max_tokens=2, priority=0)
    sched.add(high)
    order = [o.scheduled[0].seq.request_id for o in run_all(sched)]
    assert order == ["low"] * 5 + ["high"] * 2
    assert sched.num_preemptions == sched.num_priority_preemptions == 0


def test_the_least_urgent_is_the_victim_even_if_admitted_first() -> None:
    sched = make_scheduler(max_num_seqs=2, policy="priority")
    least, mid = make_seq("least", 5, max_tokens=8, priority=9), make_seq("mid", 5, max_tokens=8, priority=4)
    sched.add(least)
    step(sched)
    sched.add(mid)
    step(sched)
    high = make_seq("high", 3, max_tokens=2, priority=0)
    sched.add(high)
    out = step(sched)
    assert out.preempted == [least]
    assert running_ids(sched) == {"mid", "high"}
    run_all(sched)
    assert sched.num_priority_preemptions == 1
    assert least.num_output_tokens == mid.num_output_tokens == 8 and high.num_output_tokens == 2


def test_a_more_urgent_sequence_preempts_for_blocks() -> None:
    # 6 blocks of 4, slots to spare: two low-priority sequences hold all six blocks.
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, policy="priority")
    lows = [make_seq(f"low{i}", 11, max_tokens=4, priority=5) for i in range(2)]
    for seq in lows:
        sched.add(seq)
    step(sched)
    assert sched.block_manager.num_free_blocks == 0
    high = make_seq("high", 6, max_tokens=2, priority=1)
    sched.add(high)
    out = step(sched)
    assert out.preempted == [lows[1]]
    assert {s.seq.request_id for s in out.scheduled} == {"low0", "high"}
    assert sched.num_priority_preemptions == 1
    run_all(sched)
    assert all(seq.num_output_tokens == 4 for seq in lows) and high.num_output_tokens == 2
    assert sched.block_manager.num_free_blocks == 6
    sched.block_manager.check_invariants()


def test_nobody_is_preempted_when_that_would_not_make_room() -> None:
    # 6 blocks of 4: an urgent sequence holds 4 of them, a low one 2; a waiting one of middle
    # priority needs 3, and preempting the low one alone would free only 2.
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, policy="priority")
    urgent, low = make_seq("urgent", 15, max_tokens=4, priority=0), make_seq("low", 7, max_tokens=4, priority=9)
    sched.add(urgent)
    sched.add(low)
    step(sched)
    assert sched.block_manager.num_free_blocks == 0
    mid = make_seq("mid", 9, max_tokens=1, priority=3)
    sched.add(mid)
    out = step(sched)
    assert not out.preempted and mid.status is SequenceStatus.WAITING
    assert {s.seq.request_id for s in out.scheduled} == {"urgent", "low"}
    assert sched.num_preemptions == 0
    run_all(sched)
    assert mid.num_output_tokens == 1 and urgent.num_output_tokens == low.num_output_tokens == 4
    assert sched.num_priority_preemptions == 0
    sched.block_manager.check_invariants()


def test_as_many_less_urgent_sequences_as_needed_are_preempted_together() -> None:
    # 6 blocks of 4, held 3 and 3 by two low-priority sequences; the urgent prompt needs 5.
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, policy="priority")
    lows = [make_seq(f"low{i}", 11, max_tokens=3, priority=5) for i in range(2)]
    for seq in lows:
        sched.add(seq)
    step(sched)
    high = make_seq("high", 18, max_tokens=2, priority=0)
    sched.add(high)
    out = step(sched)
    assert out.preempted == [lows[1], lows[0]]
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("high", 18)]
    assert sched.num_priority_preemptions == 2
    run_all(sched)
    assert all(seq.num_output_tokens == 3 for seq in lows) and high.num_output_tokens == 2
    sched.block_manager.check_invariants()
