"""One engine tick and the two ways the job loop runs it: on a thread of this process, or in a child.

A tick aborts, adds, then (maybe) steps the engine, and reports what
happened. The job loop drives either runner through ``EngineRunner``; the
in-process one here runs ticks on one dedicated thread (the engine is not
thread-safe), the child-process one is ``worker.engine_process``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from scheduler.job import JobSpec
from scheduler.params import SamplingParams

_PARAM_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))

Add = tuple[str, JobSpec, int, list[int]]
"""A request to add: request id, its job, engine priority, tokens to resume from."""


@dataclass
class StepOutput:
    """What the job loop reads of a ``RequestOutput``, in a module free of torch (for the engine process's parent).

    Only what the step added: the job loop keeps the rest, so a reply's size does not grow with the output.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[dict[str, Any]] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


@dataclass
class Rejection:
    """A request the engine refused: why (the message starts with the field at fault), and its prompt length."""

    message: str
    num_prompt_tokens: int
    is_context_exceeded: bool = False
    """The prompt, or the prompt with max_tokens, does not fit the model's context."""

    @property
    def error(self) -> dict[str, str]:
        """The failed job's ``error``: the field at fault (as the job message names it) and, when the context
        is what is exceeded, the code OpenAI gives that (``context_length_exceeded``)."""
        name, sep, _ = self.message.partition(":")
        error = {"type": "invalid_request", "message": self.message}
        if sep and name.isidentifier():
            error["field"] = f"params.{name}" if name in _PARAM_NAMES else name
        if self.is_context_exceeded:
            error["code"] = CONTEXT_LENGTH_EXCEEDED
        return error


@dataclass
class Tick:
    """What one engine tick did."""

    rejected: dict[str, Rejection]
    outputs: list[Any]
    """The step's ``RequestOutput``s (``StepOutput``s from an engine process)."""
    num_unfinished: int
    stats: Any
    """The engine's ``EngineStats`` after the step (its fields in a ``SimpleNamespace`` from an engine process)."""


class EngineFailed(RuntimeError):
    """The engine cannot tick any more: its process died, or a step raised (the message holds its traceback)."""


class EngineRunner(Protocol):
    max_num_seqs: int
    max_model_len: int
    """Longest prompt + output a request may have."""

    def tick(self, adds: list[Add], aborts: list[str], do_step: bool) -> asyncio.Future[Tick]:
        """Hand the tick to the engine at once (not at the caller's next await); the future holds its result.

        Ticks run one at a time in the order given, also when a caller stops waiting for one.
        """
        ...

    async def aclose(self) -> None: ...


def as_runner(engine: Any) -> EngineRunner:
    """A runner as is; an in-process ``Engine`` wrapped to tick on its own thread."""
    return engine if hasattr(engine, "tick") else EngineThread(engine)


def run_tick(engine: Any, adds: list[Add], aborts: list[str], do_step: bool) -> Tick:
    rejected: dict[str, Rejection] = {}
    for request_id in aborts:
        engine.abort_request(request_id)
    for request_id, spec, priority, resume in adds:
        try:
            engine.add_request(
                request_id, spec.prompt if spec.prompt is not None else spec.prompt_token_ids, spec.params,
                messages=spec.messages, priority=priority, resume_token_ids=resume or None,
            )
        except ValueError as e:
            rejected[request_id] = _rejection(engine, spec, e)
    outputs = engine.step() if do_step and engine.has_unfinished_requests() else []
    return Tick(rejected, outputs, engine.num_unfinished_requests(), engine.stats())


def _rejection(engine: Any, spec: JobSpec, error: ValueError) -> Rejection:
    """The engine's refusal with the prompt's length, and a prompt that alone fills the context named as such.

    The engine checks prompt + max_tokens as one sum and names max_tokens; when the prompt leaves no room
    at all, no max_tokens could fit, so the prompt is what the producer must change.
    """
    from worker.prompt_input import prompt_token_ids

    prompt = spec.prompt if spec.prompt is not None else spec.prompt_token_ids
    try:
        num_prompt = len(prompt_token_ids(engine.tokenizer, engine.runner.vocab_size, prompt, spec.messages))
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

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.max_num_seqs: int = engine.max_num_seqs
        self.max_model_len: int = engine.max_model_len
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    def tick(self, adds: list[Add], aborts: list[str], do_step: bool) -> asyncio.Future[Tick]:
        return asyncio.get_running_loop().run_in_executor(self._executor, run_tick, self.engine, adds, aborts, do_step)

    async def aclose(self) -> None:
        # A tick still running finishes on its thread; waiting for it must not block the event loop.
        self._executor.shutdown(wait=False, cancel_futures=True)
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
