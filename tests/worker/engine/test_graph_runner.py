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

    def forward(n: int, q: int) -> torch.Tensor:
        assert q == 1
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
        DecodeGraphs(lambda n, q: x[:n] * float(x.sum().item()), [2], ReplayCapture())
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


def _written_slots(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    """The cache slots any layer's keys or values changed at."""
    changed: set[int] = set()
    for old, new in zip(before, after):
        changed.update((old != new).flatten(2).any(-1).flatten().nonzero().flatten().tolist())
    return changed


def _verifying() -> list[tuple[str, list[int], list[int], list[list[int]]]]:
    """(key, known tokens, block table, proposed tokens at each step): three verify steps of 4 rows per sequence,
    in which sequences propose 0 to 3 tokens; "b" needs no logits in the second (as a chunk not sampled from)."""
    return [
        ("a", [5, 9, 13, 2, 7], [3, 17, 8, 20], [[1, 2, 3], [4], []]),
        ("b", [44, 1], [12, 1, 30, 31], [[], [6, 7], [8, 9, 10]]),
        ("c", [60, 61, 62, 63, 64, 65, 66], [9, 2, 25, 26], [[70], [], [71, 72]]),
    ]


@pytest.mark.parametrize(("backend", "model_impl"), [("torch", "carpool"), ("torch", "transformers"),
                                                     ("triton", "carpool")])
def test_replayed_verify_steps_match_eager_ones_and_padding_writes_nowhere(tiny_model: Callable[..., str],
                                                                          backend: str, model_impl: str) -> None:
    """Steps in which sequences bring up to 1 + k tokens replay verify graphs: three sequences (padded to four),
    each padded to 1 + k rows, give the eager step's logits rows, and only their real tokens reach the cache.
    The Triton kernels run compiled into CUDA graphs on a GPU (bench.gpu_check runs this file there), else
    interpreted on CPU tensors; transformers' model stores through the torch backend's padded store, carpool's
    through its own RoPE + store."""
    path = tiny_model("llama")
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    kwargs = {"device": device, "block_size": 4, "num_blocks": 40, "max_num_seqs": 4, "attention_backend": backend,
              "model_impl": model_impl, "num_speculative_tokens": 3}
    eager = ModelRunner(path, cuda_graphs=False, **kwargs)  # type: ignore[arg-type]
    graphed = ModelRunner(path, cuda_graphs=device == "cuda", **kwargs)  # type: ignore[arg-type]
    if device == "cpu":
        assert graphed.capture_decode_graphs(ReplayCapture())
    if backend == "triton":  # its store skips padding: recording ran over padding alone and wrote nothing
        assert not any(cache.any() for cache in graphed.k_caches + graphed.v_caches)
    assert graphed.verify_graph_sizes == graphed.graph_sizes == [1, 2, 4]
    seqs = _verifying()
    for runner in (eager, graphed):
        _prefill(runner, [(k, t[:-1], b) for k, t, b, _ in seqs])
    for step in range(3):
        batch = [StepSeq([tokens[-1], *proposals[step]], len(tokens) - 1, table, needs_logits=(key, step) != ("b", 1),
                         key=key, num_spec_tokens=len(proposals[step])) for key, tokens, table, proposals in seqs]
        before = [c.clone() for c in graphed.k_caches + graphed.v_caches]
        expected = eager.execute(batch)
        got = graphed.execute(batch)
        assert graphed.num_replayed_verify_steps == graphed.num_replayed_steps == step + 1
        num_rows = sum(1 + len(seq.token_ids) - 1 for seq in batch if seq.needs_logits)
        assert got.shape == expected.shape == (num_rows, eager.vocab_size)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        written = {seq.block_table[pos // 4] * 4 + pos % 4 for seq in batch
                   for pos in range(seq.start_pos, seq.start_pos + len(seq.token_ids))}
        assert _written_slots(before, graphed.k_caches + graphed.v_caches) <= written
        # Each sequence keeps its first proposed token, or the model's own next one.
        for key, tokens, _, proposals in seqs:
            tokens.append(proposals[step][0] if proposals[step] else int(expected[0].argmax()))
    # A decode step still replays a decode graph, over the cache the verify steps wrote.
    batch = _decode_batch([(k, t, b) for k, t, b, _ in seqs])
    torch.testing.assert_close(graphed.execute(batch), eager.execute(batch), atol=ATOL, rtol=0)
    assert (graphed.num_replayed_steps, graphed.num_replayed_verify_steps) == (4, 3)


def test_verify_graphs_only_with_speculation(tiny_model: Callable[..., str]) -> None:
    runner = ModelRunner(tiny_model("llama"), block_size=4, num_blocks=16, max_num_seqs=2)
    assert runner.capture_decode_graphs(ReplayCapture())
    assert runner.graph_sizes == [1, 2] and runner.verify_graph_sizes == []
    runner.execute([StepSeq([5, 9, 13], 0, [3], True, "a")])
    runner.execute([StepSeq([2, 7], 3, [3, 4], True, "a", num_spec_tokens=1)])
    assert runner.num_replayed_steps == 0
    # The step buffers hold a verify step of every sequence, whatever the step budget.
    speculating = ModelRunner(tiny_model("llama"), block_size=4, num_blocks=16, max_num_seqs=8,
                              max_num_batched_tokens=10, num_speculative_tokens=4)
    assert speculating.inputs.max_num_tokens == 8 * 5 and speculating.max_num_batched_tokens == 10


class _AddressesAtRecording:
    """ReplayCapture that notes, at each recording, where the workspace buffers the recorded step took lie: the
    addresses a CUDA graph recorded then would keep writing to at every replay. (Buffers an eager step took
    before, such as the start-up's first forward on a GPU, are not the recording's.)"""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.recorded: dict[tuple[int, object], int] = {}
        self._replay = ReplayCapture()

    def addresses(self) -> dict[tuple[int, object], int]:
        return {(id(workspace), key): buffer.data_ptr() for workspace in self._workspaces()
                for key, buffer in workspace._buffers.items()}

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        taken: set[tuple[int, object]] = set()

        def noting(workspace: Workspace) -> Callable[..., torch.Tensor]:
            take = workspace.take

            def noted(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
                taken.add((id(workspace), (name, dtype, device)))
                return take(name, shape, dtype, device)

            return noted

        workspaces = self._workspaces()
        for workspace in workspaces:
            workspace.take = noting(workspace)  # type: ignore[method-assign]
        try:
            replay = self._replay.capture(run)
        finally:
            for workspace in workspaces:
                del workspace.take
        now = self.addresses()
        self.recorded.update({key: now[key] for key in taken})
        return replay

    def _workspaces(self) -> list[Workspace]:
        return [workspace for workspace in vars(self.runner).values() if isinstance(workspace, Workspace)]


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


def test_a_verify_step_gives_each_sequence_equal_rows_its_tokens_last() -> None:
    inputs = StepInputs(max_num_seqs=4, max_num_tokens=12, max_blocks_per_seq=4, block_size=2,
                        device=torch.device("cpu"))
    # a verifies two proposed tokens, b decodes, c prefills two tokens without sampling; one padding sequence.
    batch = [StepSeq([7, 8, 9], 3, [5, 6, 7], True, "a", num_spec_tokens=2), StepSeq([4], 1, [2], True, "b"),
             StepSeq([1, 2], 0, [3], False, "c")]
    shape = inputs.prepare(batch, pad_to=4, query_len=3)
    assert (shape.num_seqs, shape.num_tokens, shape.num_logits) == (3, 6, 4)
    assert inputs.view("input_ids", 12).tolist() == [7, 8, 9, 0, 0, 4, 0, 1, 2, 0, 0, 0]
    assert inputs.view("positions", 12).tolist() == [3, 4, 5, 0, 0, 1, 0, 0, 1, 0, 0, 0]
    assert inputs.view("slot_mapping", 12).tolist() == [13, 14, 15, -1, -1, 5, -1, 6, 7, -1, -1, -1]
    assert inputs.view("seq_lens", 4).tolist() == [6, 2, 2, 0]
    assert inputs.view("cu_seqlens_q", 5).tolist() == [0, 3, 6, 9, 12]
    # The eager step's logits rows, in its order (a's three, b's one), then row 0 up to every row of the graph.
    assert inputs.view("logit_rows", 12).tolist() == [0, 1, 2, 5] + [0] * 8
    assert inputs.step_table[0, :3].tolist() == [5, 6, 7]


@pytest.mark.parametrize(("positions", "rows"), [([0, 1, 2], [0, 1, 2]), ([0, 2], [1, 0]), ([1, 2], [1, 2])])
def test_tokens_fed_from_the_device_land_where_the_placeholders_were(positions: list[int], rows: list[int]) -> None:
    """The usual step (the same sequences in the same order: one plain copy) and any other mapping alike."""
    inputs = StepInputs(max_num_seqs=3, max_num_tokens=4, max_blocks_per_seq=2, block_size=2,
                        device=torch.device("cpu"))
    staged = [[-1 if i in positions else 10 + i] for i in range(3)]
    inputs.prepare([StepSeq(ids, 0, [i], True, f"s{i}") for i, ids in enumerate(staged)])
    drawn = torch.tensor([40, 41, 42])
    inputs.feed_tokens(positions, drawn, rows)
    want = [10 + i for i in range(3)]
    for position, row in zip(positions, rows):
        want[position] = 40 + row
    assert inputs.view("input_ids", 3).tolist() == want
