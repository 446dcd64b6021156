"""One engine tick and the in-process way to run it: on one dedicated thread of the worker process.

A tick aborts, adds, then (maybe) steps the engine, and reports what
happened (``worker.engine.wire.Tick``). The job loop drives a runner through
``EngineRunner``: ``EngineThread`` here runs ticks on one thread (the engine
is not thread-safe); ``worker.engine.process`` runs them in a child process.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from scheduler.protocol.job import JobSpec
from worker.engine.wire import Add, Rejection, StepOutput, Tick

if TYPE_CHECKING:
    from worker.engine.engine import Engine
    from worker.engine.request_state import RequestOutput


def run_tick(engine: Engine, adds: list[Add], aborts: list[str], do_step: bool,
             later: list[tuple[list[Add], list[str]]] | None = None) -> Tick:
    """Abort, add, step. ``later``: the adds and aborts of ticks sent after this one, taken in now (each tick's
    aborts, then its adds, in the order they were sent), so their jobs join this step instead of waiting for
    the ticks in between; their rejections are reported with this tick."""
    rejected: dict[str, Rejection] = {}
    for tick_adds, tick_aborts in [(adds, aborts), *(later or [])]:
        for request_id in tick_aborts:
            engine.abort_request(request_id)
        for request_id, spec, priority, resume in tick_adds:
            try:
                engine.add_request(
                    request_id, spec.prompt if spec.prompt is not None else spec.prompt_token_ids, spec.params,
                    messages=spec.messages, priority=priority, resume_token_ids=resume or None,
                )
            except ValueError as e:
                rejected[request_id] = _rejection(engine, spec, e)
    outputs = engine.step() if do_step and engine.has_unfinished_requests() else []
    return Tick(rejected, [_step_output(out) for out in outputs], engine.num_unfinished_requests(), engine.stats())



def _step_output(out: RequestOutput) -> StepOutput:
    return StepOutput(out.request_id, out.new_token_ids, out.new_text, out.new_logprobs, out.finished,
                      out.finish_reason, out.num_prompt_tokens, out.num_cached_tokens)


def _rejection(engine: Engine, spec: JobSpec, error: ValueError) -> Rejection:
    """The engine's refusal with the prompt's length, and a prompt that alone fills the context named as such.

    The engine checks prompt + max_tokens as one sum and names max_tokens; when the prompt leaves no room
    at all, no max_tokens could fit, so the prompt is what the producer must change.
    """
    from worker.engine.prompt_input import PromptTooLong, prompt_token_ids

    if isinstance(error, PromptTooLong):  # refused untokenized: counting its tokens is what that spared
        return Rejection(str(error), 0, is_context_exceeded=True)
    prompt = spec.prompt if spec.prompt is not None else spec.prompt_token_ids
    try:
        num_prompt = len(prompt_token_ids(engine.tokenizer, engine.runner.vocab_size, prompt, spec.messages,
                                          engine.max_prompt_chars))
    except ValueError:
        return Rejection(str(error), 0)  # the prompt itself is what is wrong, and the engine said so
    max_len = engine.max_model_len
    if num_prompt >= max_len:
        field = "prompt" if spec.prompt is not None else ("messages" if spec.messages is not None else "prompt_token_ids")
        return Rejection(f"{field}: {num_prompt} tokens leave no room to generate within the model's context "
                         f"of {max_len}", num_prompt, is_context_exceeded=True)
    max_tokens = spec.params.max_tokens
    return Rejection(str(error), num_prompt, is_context_exceeded=max_tokens is not None
                     and num_prompt + max_tokens > max_len)


class EngineThread:
    """An in-process engine, ticked on one dedicated thread; the event loop stays free meanwhile."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.max_num_seqs: int = engine.max_num_seqs
        self.max_model_len: int = engine.max_model_len
        self.vocab_size: int = engine.vocab_size
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    @property
    def failure(self) -> BaseException | None:
        return None  # it lives and dies with the worker's process

    def tick(self, adds: list[Add], aborts: list[str], do_step: bool) -> asyncio.Future[Tick]:
        return asyncio.get_running_loop().run_in_executor(self._executor, run_tick, self.engine, adds, aborts, do_step)

    async def aclose(self) -> None:
        # A tick still running finishes on its thread; waiting for it must not block the event loop.
        self._executor.shutdown(wait=False, cancel_futures=True)
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
