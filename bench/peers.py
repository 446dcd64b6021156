"""The alternatives users would otherwise run, measured on the same requests.

- ``hf-generate``: transformers ``model.generate`` on left-padded static
  batches of ``max_num_seqs`` in arrival order; each batch runs to its
  longest member, and a member's tokens past its own length are discarded.
- ``hf-generate-batch``: transformers' own continuous batching
  (``ContinuousBatchingManager``, the engine behind ``generate_batch``), with
  a per-request ``max_new_tokens``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from bench.records import RequestTiming, RunResult
from bench.workloads import Workload

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    # transformers' own annotation of what AutoModelForCausalLM loads: a PreTrainedModel with GenerationMixin.
    from transformers.models.auto.modeling_auto import _BaseModelWithGenerate as CausalLM


class _StepClock:
    """A logits processor that only notes when each generation step produced its logits."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def load_hf_model(model_path: str, device: str = "cpu",
                  dtype: str | None = None) -> tuple[CausalLM, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype or "float32"))
    # transformers types `to` through a wrapper that mypy reads as taking the model, not a device.
    model = model.to(torch.device(device))  # type: ignore[arg-type]
    model.eval()
    return model, AutoTokenizer.from_pretrained(model_path)


@torch.no_grad()
def run_hf_generate(model: CausalLM, pad_id: int, workload: Workload, batch_size: int,
                    on_token: Callable[[int], None] | None = None) -> RunResult:
    from transformers import LogitsProcessorList

    requests = workload.requests
    timings = [RequestTiming(lane=r.lane, arrival_s=0.0) for r in requests]
    start = time.perf_counter()
    for g in range(0, len(requests), batch_size):
        group = list(range(g, min(g + batch_size, len(requests))))
        width = max(len(requests[i].prompt_token_ids) for i in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, i in enumerate(group):
            prompt = requests[i].prompt_token_ids
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        longest = max(requests[i].max_tokens for i in group)
        group_start = time.perf_counter() - start
        clock = _StepClock()
        # transformers types generate's self as a Protocol with settable `device` and `dtype`, which
        # PreTrainedModel's read-only properties do not satisfy.
        model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),  # type: ignore[misc]
                       max_new_tokens=longest, min_new_tokens=longest, do_sample=False, pad_token_id=pad_id,
                       logits_processor=LogitsProcessorList([clock]))
        times = [t - start for t in clock.times]
        for i in group:
            n = requests[i].max_tokens
            timings[i].admitted_s = group_start
            timings[i].first_token_s = times[0]
            timings[i].finished_s = times[n - 1]
            timings[i].num_output_tokens = n
            timings[i].token_gaps_s = [b - a for a, b in zip(times[: n - 1], times[1:n])]
        if on_token is not None:
            on_token(sum(requests[i].max_tokens for i in group))
    return RunResult(workload=workload.name, mode="peer", system="hf-generate", duration_s=time.perf_counter() - start,
                     requests=timings, max_num_seqs=batch_size)


@torch.no_grad()
def run_hf_generate_batch(model: CausalLM, workload: Workload, batch_size: int,
                          on_token: Callable[[int], None] | None = None) -> RunResult:
    """Raises whatever transformers raises when its continuous batching cannot run here."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=model.config.pad_token_id)
    # Sized explicitly: the automatic sizing reads free GPU memory.
    cb_config = ContinuousBatchingConfig(max_batch_tokens=2048, num_blocks=max(128, 24 * batch_size),
                                         max_requests_per_batch=batch_size)
    requests = workload.requests
    timings = [RequestTiming(lane=r.lane, arrival_s=0.0) for r in requests]
    with model.continuous_batching_context_manager(generation_config=config, continuous_batching_config=cb_config,
                                                   warmup=False, block=True, timeout=10) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(r.prompt_token_ids, request_id=f"r{i}", max_new_tokens=r.max_tokens,
                                   record_timestamps=True) for i, r in enumerate(requests)]
        index = {rid: i for i, rid in enumerate(ids)}
        remaining = len(ids)
        while remaining:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped")
                continue
            if not result.is_finished():
                continue
            if result.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed a request: {result.error}")
            remaining -= 1
            timing = timings[index[result.request_id]]
            stamps = [t - start for t in (result.timestamps or [])]
            timing.num_output_tokens = len(result.generated_tokens)
            timing.admitted_s = result.lifespan[0] - start if result.lifespan[0] > 0 else None
            timing.first_token_s = stamps[0] if stamps else None
            timing.finished_s = time.perf_counter() - start
            timing.token_gaps_s = [b - a for a, b in zip(stamps, stamps[1:])]
            if on_token is not None:
                on_token(timing.num_output_tokens)
        duration = time.perf_counter() - start
    return RunResult(workload=workload.name, mode="peer", system="hf-generate-batch", duration_s=duration,
                     requests=timings, max_num_seqs=batch_size)
