"""The engine: continuous batching over a paged KV cache, offline and step by step.

``Engine.step()`` is ``schedule → run → postprocess``: the scheduler picks
the tokens to compute, the model runner computes them in one forward, the
sampler draws a token for every sequence whose known tokens are now all
computed, and the stop rules decide who finishes. ``generate`` drives
``step`` until its prompts are done. The engine is not thread-safe: callers
use it from one thread.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import itertools
import operator
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from typing_extensions import TypeIs

from scheduler.block_manager import BlockManager
from scheduler.params import SamplingParams
from scheduler.runtime.model_path import check_local_checkpoint
from scheduler.scheduler import Scheduler
from scheduler.scheduler_config import SchedulerConfig
from scheduler.scheduler_output import ScheduledSeq, SchedulerOutput
from scheduler.sequence import PENDING_TOKEN, FinishReason, Sequence, SequenceStatus
from worker.engine.config import EngineConfig
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.device_check import check_device_available
from worker.engine.model_runner import ModelRunner, StepSeq, TokenFeed
from worker.engine.prompt_input import check_token_ids, max_prompt_chars, prompt_token_ids
from worker.engine.records import EngineStats
from worker.engine.request_state import Completion, RequestOutput, RequestState, StopDecision
from worker.engine.sampler import DrawnTokens, SampledToken, SampleRequest, Sampler
from worker.engine.sampling_rows import to_device
from worker.engine.speculation import Proposer, Speculator, parse_speculative
from worker.engine.text_decoder import text_decoder_for
from worker.engine.token_strings import TokenStrings

__all__ = ["Completion", "Engine", "EngineConfig", "EngineStats", "RequestOutput"]

# How long generate() sleeps when a step had nothing to run (dynamic batching gathering a group).
IDLE_SLEEP_S = 0.001


def on_device(device: str | torch.device) -> contextlib.AbstractContextManager[object]:
    """The block runs with `device` as CUDA's current device, as it was again after it; no-op off CUDA.

    Tensors carry their device, but Triton launches, CUDA graphs' capture stream and events recorded without a
    stream go to the current device, which is the first GPU on every thread unless set: an engine on `cuda:1`
    would launch its kernels there, on pointers into the other GPU."""
    resolved = torch.device(device)
    return torch.cuda.device(resolved) if resolved.type == "cuda" else contextlib.nullcontext()


@dataclass
class _Drawn:
    """A launched step's tokens, drawn on the device and not read by the host yet (scheduling ahead)."""

    tokens: DrawnTokens
    sampling: list[ScheduledSeq]
    states: list[RequestState]
    indices: list[int]
    """Where each sequence's pending token sits in its output."""


@dataclass
class _InFlight:
    """A step whose forward was launched and whose tokens are not read yet: not drawn (`drawn` None), or drawn
    on the device when the engine schedules ahead."""

    scheduled: SchedulerOutput
    logits: torch.Tensor | None
    """The forward's logits, until sampled (None once drawn: nothing keeps them alive then)."""
    drawn: _Drawn | None = None


class Engine:
    def __init__(self, config: EngineConfig | str | os.PathLike[str] | None = None, **settings: Any) -> None:
        """``Engine(EngineConfig(...))``, or the same settings as keywords: ``Engine(model=PATH, block_size=16)``;
        a path first is the model, as in ``Engine(PATH, max_num_seqs=8)``."""
        if config is not None and not isinstance(config, EngineConfig):
            settings = {"model": str(config), **settings}
            config = None
        if config is None:
            config = EngineConfig(**settings)
        elif settings:
            raise TypeError("Engine: give an EngineConfig or keyword settings, not both")
        # A hub id or a missing path fails here, in one line, not in transformers after a network attempt.
        for setting in ("model", "draft_model"):
            if getattr(config, setting) is not None:
                check_local_checkpoint(getattr(config, setting), setting)
                # `~/m` as a deployment's variable holds it (no shell expanded it): loaded from where it was found.
                config = dataclasses.replace(config, **{setting: os.path.expanduser(getattr(config, setting))})
        if config.model is None:
            from worker.engine.default_model import default_model_path, models_cache_dir

            config = dataclasses.replace(config, model=str(default_model_path(models_cache_dir(os.environ))))
        assert config.model is not None
        check_device_available(config.device)
        self.config = config
        with on_device(config.device):
            self.runner = ModelRunner(
                config.model, device=config.device, dtype=config.dtype, block_size=config.block_size,
                num_blocks=config.num_blocks, kv_cache_memory_gb=config.kv_cache_memory_gb,
                attention_backend=config.attention_backend, max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens, cuda_graphs=config.cuda_graphs,
                model_impl=config.model_impl, quantization=config.quantization, cpu_kernels=config.cpu_kernels,
                matmul_tuning=config.matmul_tuning, draft_model=config.draft_model,
                num_speculative_tokens=config.num_speculative_tokens if config.speculative else 0,
            )
        self.tokenizer = self.runner.tokenizer
        # Chosen once here, not per request: the choice checks the tokenizer over its whole vocabulary.
        self.text_decoder = text_decoder_for(self.tokenizer)
        self.token_strings = TokenStrings(self.tokenizer)
        max_model_len = config.max_model_len
        if max_model_len is not None and max_model_len > self.runner.max_model_len:
            raise ValueError(
                f"max_model_len: {max_model_len} exceeds the model's context length {self.runner.max_model_len} "
                f"({self.runner.context_limit})"
            )
        # One sequence of max_model_len must always fit alone, or preemption could never make room.
        cache_tokens = self.runner.num_blocks * self.runner.block_size
        asked = max_model_len or self.runner.max_model_len
        self.max_model_len = min(asked, cache_tokens)
        if cache_tokens < asked:
            self.context_limit = f"the KV cache's {self.runner.num_blocks} blocks of {self.runner.block_size} tokens"
        elif max_model_len is not None:
            self.context_limit = "--max-model-len"
        else:
            self.context_limit = f"the model's context, {self.runner.context_limit}"
        """What sets `max_model_len`, for the messages of prompts that do not fit."""
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.max_model_len)
        """Longer text prompts are refused before they are tokenized (`prompt_input.max_prompt_chars`)."""
        self.max_num_seqs = config.max_num_seqs
        self.vocab_size = self.runner.vocab_size
        """Token ids a prompt may hold are below this."""
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                batching=config.batching,
                policy=config.policy,
                max_wait_ms=config.max_wait_ms,
                prefill_alone_priority=config.prefill_alone_priority,
                lower_prefill_tokens=config.lower_prefill_tokens,
            ),
            self.block_manager,
        )
        with on_device(config.device):
            self.sampler = Sampler(self.runner.vocab_size, config.max_num_seqs, config.device)
            self.speculator = self._speculator(self.config)
        # On CUDA the host prepares the next step while the device computes this one; on a CPU both are the
        # same cores, so there it would only delay each step's outputs by one step.
        self.async_scheduling = (
            self.runner.device.type == "cuda" if config.async_scheduling is None else config.async_scheduling
        )
        self.schedules_ahead = self.async_scheduling and self.speculator is None
        """The next step is scheduled and launched before this one's tokens reach the host, its inputs fed from
        the tokens drawn on the device; with proposals to verify (how many are accepted decides the next step's
        tokens), the engine reads each step's tokens before scheduling the next."""
        self._in_flight: _InFlight | None = None
        self._requests: dict[str, RequestState] = {}
        self._pending: list[RequestOutput] = []
        """Outputs decided outside a step (aborts, already-complete resumes), sent with the next one."""
        self._num_generate_calls = 0
        self._num_steps = 0
        self._last_step = (0, 0, 0.0)

    # ---- step API -------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        priority: int = 0,
        resume_token_ids: list[int] | None = None,
    ) -> int:
        """Queue a request; returns its number of prompt tokens. Bad input raises ValueError."""
        if request_id in self._requests:
            raise ValueError(f"id: request {request_id!r} is already running")
        # An earlier request of this id, aborted since the last step, has its final output still queued; it
        # belongs to that request, so it must not reach the caller as this one's.
        self._pending = [o for o in self._pending if o.request_id != request_id]
        params = params if params is not None else SamplingParams()
        prompt_ids = prompt_token_ids(self.tokenizer, self.runner.vocab_size, prompt, messages, self.max_prompt_chars)
        resumed = list(resume_token_ids or [])
        check_token_ids("resume_token_ids", resumed, self.runner.vocab_size)
        if params.max_tokens is None:  # as many as fit: the rest of the context (a prompt that fills it is refused)
            params = dataclasses.replace(params, max_tokens=max(1, self.max_model_len - len(prompt_ids)))
        assert params.max_tokens is not None
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds max_model_len {self.max_model_len} (set by {self.context_limit})"
            )
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, decoder=self.text_decoder)
        # Resumed tokens that already end the request (its worker crashed after the last one, before writing the
        # result): done already, as the steps that drew them would have found, cut where they stopped.
        stop = self._replay(request_id, prompt_ids, params, resumed, detokenizer) if resumed else None
        if stop is not None:
            resumed = resumed[:stop[0]]
        seq = Sequence(request_id, prompt_ids, params, priority=priority, output_token_ids=resumed)
        state = RequestState(seq, detokenizer, self.runner.eos_token_ids, self.token_strings)
        if stop is not None:
            _, decision, final_text = stop
            seq.finish_reason, seq.stop_reason = decision.reason, decision.stop_reason
            seq.status = SequenceStatus.FINISHED
            state.final_text = final_text
            state.detokenizer.flush()
            self._pending.append(state.take_output())
            return len(prompt_ids)
        self.scheduler.add(seq)
        self._requests[request_id] = state
        return len(prompt_ids)

    def _replay(self, request_id: str, prompt_ids: list[int], params: SamplingParams, tokens: list[int],
                detokenizer: IncrementalDetokenizer) -> tuple[int, StopDecision, str | None] | None:
        """Feed `tokens`, a resumed output, to `detokenizer` with the checks a step makes on each new token, up to
        the first that ends the request (EOS, a stop token or string, max_tokens): how many tokens it keeps, the
        stop and the text a stop string cut (None for the others); None when they do not end it."""
        replay = RequestState(Sequence(request_id, prompt_ids, params), detokenizer, self.runner.eos_token_ids)
        for i, token in enumerate(tokens):
            decision = replay.on_token(SampledToken(token, None, None), i + 1)
            if decision is not None:
                return i + 1, decision, replay.final_text
        return None

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request; its final output (finish_reason "abort") comes with the next step."""
        seq = self.scheduler.abort(request_id)
        state = self._requests.pop(request_id, None)
        self._release(request_id)
        if self.speculator is not None:
            self.speculator.release(request_id)
        if seq is None or state is None:
            return False
        state.detokenizer.flush()
        self._pending.append(state.take_output())
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def step(self) -> list[RequestOutput]:
        """Run one iteration; one output per request that got a token or finished.

        With `async_scheduling` the forward of the step scheduled here runs on
        the device while the host reads the previous step's tokens and turns
        them into outputs (detokenization, stop checks): the step is scheduled
        and launched before those tokens reach the host, its inputs fed from
        them on the device (`schedules_ahead`; with proposals to verify, after
        the host has read them). A request that stops on a stop token or
        string is then computed one token further, and that token is dropped
        (one that reaches `max_tokens` is not scheduled again).
        """
        start_s = time.perf_counter()
        outputs, self._pending = self._pending, []
        with on_device(self.config.device):
            if self.schedules_ahead:
                previous, self._in_flight = self._in_flight, None
                try:
                    scheduled = self.scheduler.schedule()
                    if not scheduled.is_empty:
                        self._in_flight = self._launch_drawn(scheduled, previous)
                except BaseException:
                    # The engine stays whole: the previous step is still read, its outputs (and the ones queued)
                    # come with the next step.
                    if previous is not None:
                        outputs.extend(self._postprocess(self._read(previous)))
                    self._pending = outputs + self._pending
                    raise
                if previous is not None:
                    outputs.extend(self._postprocess(self._read(previous)))
            elif self.async_scheduling:
                done = self._complete(self._in_flight) if self._in_flight is not None else []
                self._in_flight = None
                scheduled = self._schedule()
                if not scheduled.is_empty:
                    self._in_flight = self._launch(scheduled)
                outputs.extend(self._postprocess(done))
            else:
                scheduled = self._schedule()
                if not scheduled.is_empty:
                    outputs.extend(self._postprocess(self._complete(self._launch(scheduled))))
        self._num_steps += 1
        self._last_step = (
            scheduled.num_batched_tokens, len(scheduled.scheduled), time.perf_counter() - start_s
        )
        return outputs

    def _release(self, request_id: str) -> None:
        """The request left the batch (finished, aborted, preempted): its block-table row and sampling row are free."""
        self.runner.release(request_id)
        self.sampler.release(request_id)

    def _speculator(self, config: EngineConfig) -> Speculator | None:
        proposer = parse_speculative(config.speculative)
        if proposer is None:
            return None
        draft = None
        if proposer is Proposer.DRAFT:
            from worker.engine.draft_model import DraftModel

            assert config.draft_model is not None
            draft = DraftModel(config.draft_model, self.runner, config.max_num_seqs, self.max_model_len)
        return Speculator(proposer, config.num_speculative_tokens, draft)

    def _schedule(self) -> SchedulerOutput:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.max_model_len)
        return self.scheduler.schedule()

    def _launch(self, scheduled: SchedulerOutput) -> _InFlight:
        """Start the step's forward; on CUDA it runs on while the host goes on."""
        for seq in scheduled.preempted:
            self._release(seq.request_id)
        batch = [
            StepSeq(s.token_ids, s.start_pos, s.seq.block_table, s.needs_logits, s.seq.request_id, s.num_spec_tokens)
            for s in scheduled.scheduled
        ]
        return _InFlight(scheduled, self.runner.execute(batch))

    def _launch_drawn(self, scheduled: SchedulerOutput, previous: _InFlight | None) -> _InFlight:
        """Start the step's forward and draw its tokens on the device, then advance the sequences past them
        (as pending tokens), all without waiting for the device; input tokens drawn by `previous` and not read
        yet come from the device."""
        for seq in scheduled.preempted:
            self._release(seq.request_id)
        # One pass over the batch: its inputs, and for each sampling sequence its state, what the sampler needs
        # and its logit row.
        batch = []
        sampling: list[ScheduledSeq] = []
        states: list[RequestState] = []
        requests: list[SampleRequest] = []
        indices: list[int] = []
        rows_of_sampling: list[int] = []
        num_logit_rows = 0
        by_id = self._requests
        for s in scheduled.scheduled:
            seq = s.seq
            batch.append(StepSeq(s.token_ids, s.start_pos, seq.block_table, s.needs_logits, seq.request_id))
            if s.is_sampling:
                state = by_id[seq.request_id]
                sampling.append(s)
                states.append(state)
                requests.append(state.sample_request_now())
                indices.append(len(seq.output_token_ids))
                rows_of_sampling.append(num_logit_rows)
            num_logit_rows += s.needs_logits
        logits = self.runner.execute(batch, self._feed(scheduled.scheduled, batch, previous))
        drawn = None
        if sampling:
            # Usually every row samples (all decodes): no gather of the rows then. Else the index goes to the
            # device without a wait (a list index would copy from pageable memory, waiting for the forward).
            rows = logits if len(sampling) == logits.shape[0] else logits.index_select(
                0, to_device(rows_of_sampling, torch.int64, logits.device))
            drawn = _Drawn(self.sampler.launch(rows, requests), sampling, states, indices)
        self.scheduler.advance_launched(scheduled)
        return _InFlight(scheduled, None, drawn)

    @staticmethod
    def _feed(scheduled: list[ScheduledSeq], batch: list[StepSeq], previous: _InFlight | None) -> TokenFeed | None:
        """Where the step's input holds a pending token, the row of `previous`'s drawn tokens that fills it."""
        drawn = previous.drawn if previous is not None else None
        if drawn is None:
            return None  # only a step drawn and not read leaves pending tokens
        if (len(drawn.sampling) == len(scheduled)
                and all(map(operator.is_, map(_SEQ, drawn.sampling), map(_SEQ, scheduled)))
                and all(len(b.token_ids) == 1 and b.token_ids[0] == PENDING_TOKEN for b in batch)):
            # The usual step: the same sequences in the same order each decode the token the last step drew.
            in_order = list(range(len(batch)))
            return TokenFeed(in_order, drawn.tokens.token_ids, in_order)
        row_of = {s.seq: i for i, s in enumerate(drawn.sampling)}
        positions: list[int] = []
        rows: list[int] = []
        offset = 0
        for s, step_seq in zip(scheduled, batch):
            if s.seq.num_pending_tokens:
                # Only the last step can have drawn a token still pending: earlier ones were read.
                row = row_of[s.seq]
                for i, token in enumerate(step_seq.token_ids):
                    if token == PENDING_TOKEN:
                        positions.append(offset + i)
                        rows.append(row)
            offset += len(step_seq.token_ids)
        if not positions:
            return None
        return TokenFeed(positions, drawn.tokens.token_ids, rows)

    def _read(self, step: _InFlight) -> list[tuple[Sequence, RequestState, list[SampledToken], int]]:
        """Read the step's drawn tokens and put their values in place of the pending ones; sequences that
        finished or were aborted since the launch are left out, their tokens dropped."""
        drawn = step.drawn
        if drawn is None:
            return []
        done = []
        resolve = self.scheduler.resolve
        for s, state, index, token in zip(drawn.sampling, drawn.states, drawn.indices,
                                          self.sampler.collect(drawn.tokens)):
            seq = s.seq
            if seq.status is SequenceStatus.FINISHED:
                continue
            resolve(seq, index, token.token_id)
            done.append((seq, state, [token], index))
        return done

    def _complete(self, step: _InFlight) -> list[tuple[Sequence, RequestState, list[SampledToken], int]]:
        """Sample the step's tokens and advance its sequences; those that finished or were aborted since it was
        launched (only with async scheduling) are left out, their tokens dropped.

        A sequence that verified proposed tokens gets the accepted ones and the token after them.
        """
        scheduled = step.scheduled.scheduled
        with_logits = [s for s in scheduled if s.needs_logits]
        first_rows = list(itertools.accumulate((1 + s.num_spec_tokens for s in with_logits), initial=0))
        chosen = [i for i, s in enumerate(with_logits) if s.is_sampling and not s.seq.is_finished]
        sampling = [with_logits[i] for i in chosen]
        states = [self._requests[s.seq.request_id] for s in sampling]
        sampled: list[list[SampledToken]] = []
        if sampling:
            requests = [state.sample_request_now() for state in states]
            rows = [r for i in chosen for r in range(first_rows[i], first_rows[i + 1])]
            logits = step.logits
            assert logits is not None, "a step read in full is sampled from its logits"
            # Usually every row samples (all decodes): no gather of the rows then.
            logits = logits if len(rows) == logits.shape[0] else logits[rows]
            if any(s.num_spec_tokens for s in sampling):
                sampled = self.sampler.verify(logits, requests, [s.spec_token_ids for s in sampling])
            else:
                sampled = [[t] for t in self.sampler.sample(logits, requests)]
        # A sequence finished since the launch is gone from the running set, unless it stays as a static
        # group's padding, which still moves on.
        live = [s for s in scheduled if not s.seq.is_finished or s.seq.is_padding]
        self.scheduler.advance(SchedulerOutput(scheduled=live),
                               {s.seq.request_id: [t.token_id for t in ts] for s, ts in zip(sampling, sampled)})
        if self.speculator is not None:
            for s, tokens in zip(sampling, sampled):
                self.speculator.verified(s.seq, s.num_spec_tokens, len(tokens) - 1)
        return [(s.seq, state, tokens, s.seq.num_output_tokens - len(tokens))
                for s, state, tokens in zip(sampling, states, sampled)]

    def _postprocess(self, done: list[tuple[Sequence, RequestState, list[SampledToken], int]]) -> list[RequestOutput]:
        """Stop checks and detokenization of sampled tokens, each sequence's first at output index `num_before`;
        finished requests leave the scheduler.

        Several tokens of one step are checked in order; the ones after a stop are cut from the output (and so
        is a pending token drawn after it).
        """
        outputs = []
        for seq, state, tokens, num_before in done:
            for i, token in enumerate(tokens):
                decision = state.on_token(token, num_before + i + 1)
                if decision is not None:
                    seq.truncate_output(num_before + i + 1)
                    self.scheduler.finish(seq, decision.reason, decision.stop_reason)
                    del self._requests[seq.request_id]
                    self._release(seq.request_id)
                    if self.speculator is not None:
                        self.speculator.cut_by_stop(len(tokens) - (i + 1))
                        self.speculator.release(seq.request_id)
                    break
            outputs.append(state.take_output())
        return outputs

    def stats(self) -> EngineStats:
        bm = self.block_manager
        num_tokens, num_seqs, step_s = self._last_step
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks=bm.num_blocks,
            num_kv_blocks_used=bm.num_used_blocks,
            kv_usage=bm.num_used_blocks / bm.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_priority_preemptions=self.scheduler.num_priority_preemptions,
            prefix_cache_query_tokens=bm.prefix_cache_query_tokens,
            prefix_cache_hit_tokens=bm.prefix_cache_hit_tokens,
            num_steps=self._num_steps,
            last_step_num_tokens=num_tokens,
            last_step_num_seqs=num_seqs,
            last_step_s=step_s,
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, Any]:
        if self.speculator is None:
            return {}
        counters = self.speculator.counters
        return {"spec_proposer": self.speculator.proposer.value, "spec_num_drafts": counters.num_drafts,
                "spec_proposed_tokens": counters.num_proposed_tokens,
                "spec_accepted_tokens": counters.num_accepted_tokens}

    # ---- offline API ----------------------------------------------------

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run every prompt to completion; results in input order."""
        batch: collections.abc.Sequence[str | list[int]]
        if isinstance(prompts, str) or _is_token_ids(prompts):
            batch = [prompts]
        else:
            batch = prompts
        if isinstance(params, list):
            if len(params) != len(batch):
                raise ValueError(f"params: {len(params)} given for {len(batch)} prompts")
            per_prompt = params
        else:
            per_prompt = [params or SamplingParams()] * len(batch)
        self._num_generate_calls += 1
        ids = [f"generate-{self._num_generate_calls}-{i}" for i in range(len(batch))]
        prompt_ids: dict[str, list[int]] = {}
        for request_id, prompt, p in zip(ids, batch, per_prompt):
            self.add_request(request_id, prompt, p)
            prompt_ids[request_id] = self._requests[request_id].seq.prompt_token_ids
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            outputs = self.step()
            done.update((o.request_id, o) for o in outputs if o.finished and o.request_id in prompt_ids)
            if not outputs and self._last_step[1] == 0:
                time.sleep(IDLE_SLEEP_S)
        return [
            Completion(
                request_id=rid,
                prompt_token_ids=prompt_ids[rid],
                token_ids=done[rid].token_ids,
                text=done[rid].text,
                finish_reason=done[rid].finish_reason,
                stop_reason=done[rid].stop_reason,
                logprobs=done[rid].logprobs,
                num_cached_tokens=done[rid].num_cached_tokens,
            )
            for rid in ids
        ]


_SEQ = operator.attrgetter("seq")


def _is_token_ids(prompts: list[int] | list[str] | list[list[int]]) -> TypeIs[list[int]]:
    """One prompt given as token ids, rather than a batch of prompts."""
    return bool(prompts) and isinstance(prompts[0], int)
