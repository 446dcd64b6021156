"""An urgent request's prefill in a step of its own (``prefill_alone_priority``): the less urgent running
sequences' decodes wait that step out, so the urgent first token never waits on their work.

Pure Python: no model, the stand-in token source of ``test_scheduler``.
"""

from __future__ import annotations

import pytest

from scheduler import Scheduler, Sequence
from scheduler.scheduler_output import SchedulerOutput
from tests.scheduler.test_scheduler import make_scheduler, make_seq, run_all, step

URGENT = 10
"""The cutoff: priority numbers up to this are urgent."""


def scheduled(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]


def decoding_batch(sched: Scheduler, n: int) -> list[Sequence]:
    batch = [make_seq(f"batch{i}", 5, max_tokens=40, priority=2 * URGENT) for i in range(n)]
    for seq in batch:
        sched.add(seq)
    step(sched)  # their prefills
    step(sched)
    return batch


def test_an_urgent_prefill_runs_without_the_less_urgent_decodes() -> None:
    sched = make_scheduler(max_num_seqs=8, policy="priority", prefill_alone_priority=URGENT)
    batch = decoding_batch(sched, 3)
    chat = make_seq("chat", 6, max_tokens=3, priority=0)
    sched.add(chat)
    assert scheduled(step(sched)) == [("chat", 6)]
    # From its first decode on, it shares the steps again: nobody is left out twice.
    assert scheduled(step(sched)) == [("chat", 1), ("batch0", 1), ("batch1", 1), ("batch2", 1)]
    run_all(sched)
    assert [s.num_output_tokens for s in batch] == [40, 40, 40] and chat.num_output_tokens == 3
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    sched.block_manager.check_invariants()


def test_a_chunked_urgent_prefill_runs_alone_chunk_after_chunk() -> None:
    sched = make_scheduler(max_num_seqs=8, max_num_batched_tokens=8, policy="priority",
                           prefill_alone_priority=URGENT)
    decoding_batch(sched, 2)
    sched.add(make_seq("chat", 20, max_tokens=2, priority=0))
    assert [scheduled(step(sched)) for _ in range(3)] == [[("chat", 8)], [("chat", 8)], [("chat", 4)]]
    assert scheduled(step(sched)) == [("chat", 1), ("batch0", 1), ("batch1", 1)]


def test_urgent_decodes_keep_running_beside_a_new_urgent_prefill() -> None:
    sched = make_scheduler(max_num_seqs=8, policy="priority", prefill_alone_priority=URGENT)
    decoding_batch(sched, 2)
    sched.add(make_seq("chat0", 4, max_tokens=10, priority=0))
    step(sched)
    sched.add(make_seq("chat1", 4, max_tokens=10, priority=URGENT))
    assert scheduled(step(sched)) == [("chat0", 1), ("chat1", 4)]


def test_the_urgent_prefill_still_preempts_for_a_slot() -> None:
    sched = make_scheduler(max_num_seqs=2, policy="priority", prefill_alone_priority=URGENT)
    decoding_batch(sched, 2)
    sched.add(make_seq("chat", 4, max_tokens=2, priority=0))
    out = step(sched)
    assert [s.request_id for s in out.preempted] == ["batch1"]
    assert scheduled(out) == [("chat", 4)]


def test_an_urgent_request_that_cannot_start_leaves_an_ordinary_step() -> None:
    # 6 blocks of 4: an equally urgent sequence holds 4 of them, the less urgent one 2, and the new urgent prompt
    # needs 3, more than preempting the less urgent one frees. Nobody may be left out for a prefill that cannot run.
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4, policy="priority",
                           prefill_alone_priority=URGENT)
    sched.add(make_seq("held", 15, max_tokens=10, priority=0))
    sched.add(make_seq("low", 7, max_tokens=2, priority=2 * URGENT))
    step(sched)
    sched.add(make_seq("chat", 9, max_tokens=1, priority=0))
    out = step(sched)
    assert scheduled(out) == [("held", 1), ("low", 1)]
    assert not out.preempted and sched.waiting[0].request_id == "chat"


def test_without_the_setting_an_urgent_prefill_shares_the_step() -> None:
    sched = make_scheduler(max_num_seqs=8, policy="priority")
    decoding_batch(sched, 2)
    sched.add(make_seq("chat", 6, max_tokens=3, priority=0))
    assert scheduled(step(sched)) == [("batch0", 1), ("batch1", 1), ("chat", 6)]


def test_the_fcfs_policy_ignores_the_setting() -> None:
    sched = make_scheduler(max_num_seqs=8, policy="fcfs", prefill_alone_priority=URGENT)
    decoding_batch(sched, 2)
    sched.add(make_seq("chat", 6, max_tokens=3, priority=0))
    assert scheduled(step(sched)) == [("batch0", 1), ("batch1", 1), ("chat", 6)]


# --- lower_prefill_tokens: the less urgent prefills per step ---------------------------------------------------


def test_a_refill_of_many_batch_prompts_is_spread_over_steps() -> None:
    # 2 batch sequences decode; 5 new ones of 10 tokens arrive at once. With 16 prompt tokens a step for the less
    # urgent ones, the 50 prompt tokens take 4 steps, the last admission of a step chunked to what is left, while
    # the running decodes go on in every step.
    sched = make_scheduler(max_num_seqs=8, policy="priority", prefill_alone_priority=URGENT, lower_prefill_tokens=16)
    decoding_batch(sched, 2)
    refill = [make_seq(f"new{i}", 10, max_tokens=2, priority=2 * URGENT) for i in range(5)]
    for seq in refill:
        sched.add(seq)
    steps = [scheduled(step(sched)) for _ in range(4)]
    assert steps[0] == [("batch0", 1), ("batch1", 1), ("new0", 10), ("new1", 6)]
    assert steps[1] == [("batch0", 1), ("batch1", 1), ("new0", 1), ("new1", 4), ("new2", 10), ("new3", 2)]
    for s in steps:
        assert sum(n for rid, n in s if rid.startswith("new") and n > 1) <= 16
    run_all(sched)
    assert [s.num_output_tokens for s in refill] == [2] * 5
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    sched.block_manager.check_invariants()


def test_an_urgent_prefill_is_not_held_to_the_lower_allowance() -> None:
    sched = make_scheduler(max_num_seqs=8, policy="priority", prefill_alone_priority=URGENT, lower_prefill_tokens=4)
    decoding_batch(sched, 2)
    sched.add(make_seq("chat", 30, max_tokens=2, priority=0))
    assert scheduled(step(sched)) == [("chat", 30)]


def test_a_long_lower_prompt_continues_chunk_by_chunk() -> None:
    sched = make_scheduler(max_num_seqs=8, policy="priority", prefill_alone_priority=URGENT, lower_prefill_tokens=8)
    long = make_seq("long", 20, max_tokens=1, priority=2 * URGENT)
    sched.add(long)
    assert [scheduled(step(sched)) for _ in range(3)] == [[("long", 8)], [("long", 8)], [("long", 4)]]
    assert long.is_finished


def test_the_allowance_needs_prefill_alone_and_the_priority_policy() -> None:
    for config in ({"policy": "priority"}, {"policy": "fcfs", "prefill_alone_priority": URGENT}):
        sched = make_scheduler(max_num_seqs=8, lower_prefill_tokens=4, **config)
        sched.add(make_seq("batch", 20, max_tokens=1, priority=2 * URGENT))
        assert scheduled(step(sched)) == [("batch", 20)]


def test_the_allowance_is_validated() -> None:
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="lower_prefill_tokens"):
            make_scheduler(lower_prefill_tokens=bad)
