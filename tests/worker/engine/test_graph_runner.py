"""Recorded decode steps: size choice, padding, replay equivalence, and the ban on host reads, on CPU.

`ReplayCapture` stands in for CUDA graphs: it replays a step by running it
again with the arguments it was recorded with, and fails on any host read,
which is what would break (or silently freeze) a CUDA graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kernels.workspace import Workspace
from worker.engine.default_model import create_tiny_model
from worker.engine.graph_runner import DecodeGraphs, HostReadError, ReplayCapture, forbid_host_reads, graph_batch_sizes
from worker.engine.model_runner import ModelRunner
from worker.engine.step_inputs import StepInputs, StepSeq

ATOL = 1e-4


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(45) == [1, 2, 4, 8, 16, 24, 32, 40, 45]


def test_sizes_are_recorded_largest_first_and_a_step_takes_the_smallest_that_fits() -> None:
    order: list[int] = []

    def forward(n: int) -> torch.Tensor:
        order.append(n)
        return torch.full((n, 3), float(n))

    graphs = DecodeGraphs(forward, graph_batch_sizes(32), ReplayCapture())
    # Each size: a warm-up run, then its recording.
    assert order == [n for n in (32, 24, 16, 8, 4, 2, 1) for _ in range(2)]
    assert [graphs.padded_size(n) for n in (1, 2, 3, 5, 8, 9, 17, 25, 32)] == [1, 2, 4, 8, 8, 16, 24, 32, 32]
    assert graphs.padded_size(33) is None
    assert graphs.replay(4).shape == (4, 3)


def test_a_host_read_in_a_recorded_step_fails_its_recording() -> None:
    x = torch.arange(4.0)
    with pytest.raises(HostReadError, match="item"):
        DecodeGraphs(lambda n: x[:n] * float(x.sum().item()), [2], ReplayCapture())
    for read in (lambda: x.tolist(), lambda: bool(x[0] > 0), lambda: x.cpu(), lambda: x.nonzero(), lambda: int(x[1])):
        with forbid_host_reads(), pytest.raises(HostReadError):
            read()
    with forbid_host_reads():
        torch.index_select(x, 0, torch.tensor([2, 0]))  # device-side work is fine


def _decode_batch(seqs: list[tuple[str, list[int], list[int]]]) -> list[StepSeq]:
    """(key, tokens so far, block table) -> a decode step of each sequence's last token."""
    return [StepSeq([tokens[-1]], len(tokens) - 1, table, True, key) for key, tokens, table in seqs]


def _prefill(runner: ModelRunner, seqs: list[tuple[str, list[int], list[int]]]) -> torch.Tensor:
    return runner.execute([StepSeq(tokens, 0, table, True, key) for key, tokens, table in seqs])


def test_replayed_steps_match_eager_ones_and_padding_writes_nowhere(tiny_model: Callable[..., str]) -> None:
    path = tiny_model("llama")
    eager = ModelRunner(path, block_size=4, num_blocks=40, max_num_seqs=8)
    graphed = ModelRunner(path, block_size=4, num_blocks=40, max_num_seqs=8)
    assert graphed.capture_decode_graphs(ReplayCapture())
    assert graphed.graph_sizes == [1, 2, 4, 8]
    seqs = [("a", [5, 9, 13, 2, 7], [3, 17, 8]), ("b", [44, 1], [12, 1, 30]), ("c", [60, 61, 62, 63, 64, 65, 66], [9, 2, 25])]
    for runner in (eager, graphed):
        _prefill(runner, [(k, t[:-1], b) for k, t, b in seqs])
    for step in range(4):
        batch = _decode_batch(seqs)
        before = [c.clone() for c in graphed.k_caches + graphed.v_caches]
        expected = eager.execute(batch)
        got = graphed.execute(batch)
        assert graphed.num_replayed_steps == step + 1
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        # Three real rows padded to four: only the real rows' slots changed in any layer's cache.
        written = {seq.block_table[seq.start_pos // 4] * 4 + seq.start_pos % 4 for seq in batch}
        for old, new in zip(before, graphed.k_caches + graphed.v_caches):
            changed = (old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist()
            assert set(changed) <= written
        for key, tokens, table in seqs:
            tokens.append(int(expected[[k for k, _, _ in seqs].index(key)].argmax()))
            if len(tokens) > 4 * len(table):
                table.append(35 + len(table))


class _AddressesAtRecording:
    """ReplayCapture that notes, at each recording, where every workspace buffer of the runner lies: the addresses
    a CUDA graph recorded then would keep writing to at every replay."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.recorded: dict[tuple[int, object], int] = {}
        self._replay = ReplayCapture()

    def addresses(self) -> dict[tuple[int, object], int]:
        return {(id(workspace), key): buffer.data_ptr() for workspace in vars(self.runner).values()
                if isinstance(workspace, Workspace) for key, buffer in workspace._buffers.items()}

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        replay = self._replay.capture(run)
        self.recorded.update(self.addresses())
        return replay


def test_an_eager_step_never_moves_a_buffer_the_recorded_steps_write(tiny_model: Callable[..., str]) -> None:
    """A replayed graph writes its split-KV partial results where it was recorded: an eager step that needs bigger
    split buffers (a prefill of short prompts, a speculative step) must not free those and take new ones."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels: compiled, or interpreted on CPU
    runner = ModelRunner(tiny_model("llama"), device=device, block_size=4, num_blocks=16, max_num_seqs=2,
                         attention_backend="triton", cuda_graphs=False)
    runner._num_multiprocessors = 64  # as a GPU reports it: a step of a few sequences splits their contexts
    capture = _AddressesAtRecording(runner)
    assert runner.capture_decode_graphs(capture)
    assert any(key[1][0] == "split_out" for key in capture.recorded), "the recorded steps use split buffers"
    # Two prompts of 5 tokens: one query tile each, 10 rows for every split, more than decodes of 2 sequences need.
    seqs = [StepSeq([5, 9, 13, 2, 7], 0, [3, 7], True, "a"), StepSeq([44, 1, 60, 61, 62], 0, [12, 1], True, "b")]
    runner.execute(seqs)
    now = capture.addresses()
    assert {key: now.get(key) for key in capture.recorded} == capture.recorded
    decode = [StepSeq([8], 5, [3, 7], True, "a"), StepSeq([9], 5, [12, 1], True, "b")]
    runner.execute(decode)
    assert runner.num_replayed_steps == 1


def test_dynamic_rope_runs_eager(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = create_tiny_model(tmp_path / "dynamic-rope", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    runner = ModelRunner(str(path), block_size=4, num_blocks=16, max_num_seqs=2)
    with caplog.at_level(logging.WARNING, logger="worker.engine.model_runner"):
        assert not runner.capture_decode_graphs(ReplayCapture())
    assert runner.graph_sizes == []
    assert "dynamic RoPE" in caplog.text


def test_cuda_graphs_need_a_cuda_device(tiny_model: Callable[..., str]) -> None:
    with pytest.raises(ValueError, match="cuda_graphs"):
        ModelRunner(tiny_model("llama"), num_blocks=8, cuda_graphs=True)
    assert ModelRunner(tiny_model("llama"), num_blocks=8).graph_sizes == []  # off by default on CPU


def test_block_table_rows_follow_their_sequences_by_changes_only() -> None:
    inputs = StepInputs(max_num_seqs=2, max_num_tokens=8, max_blocks_per_seq=4, block_size=2,
                        device=torch.device("cpu"))
    a_table, b_table = [7], [3, 5]
    inputs.prepare([StepSeq([1, 2], 0, a_table, True, "a"), StepSeq([3], 2, b_table, True, "b")])
    assert inputs.step_table[0, :1].tolist() == [7] and inputs.step_table[1, :2].tolist() == [3, 5]
    a_row = inputs.view("rows", 2).tolist()[0]
    # a grows a block: one change; the batch order flips and the rows follow.
    a_table.append(9)
    shape = inputs.prepare([StepSeq([4], 3, b_table, True, "b"), StepSeq([5], 2, a_table, True, "a")])
    assert shape.is_decode and shape.max_seq_len == 4
    assert inputs.step_table[1, :2].tolist() == [7, 9] and inputs.step_table[0, :2].tolist() == [3, 5]
    assert inputs.view("rows", 2).tolist()[1] == a_row
    # a is preempted and comes back with a new table: its row is rewritten whole.
    inputs.release("a")
    inputs.prepare([StepSeq([1, 2, 3], 0, [11, 12], True, "a")])
    assert inputs.step_table[0, :2].tolist() == [11, 12]
    # A third sequence with no free row takes the least recently used row of one not in the step.
    inputs.prepare([StepSeq([8], 0, [20], True, "c"), StepSeq([9], 0, [21], True, "a")])
    assert inputs.step_table[0, :1].tolist() == [20]
    assert inputs.view("slot_mapping", 2).tolist() == [40, 42]
