"""What crosses between the job loop and the engine: ticks asked for and their results.

The same records whether the engine runs on a thread of the worker process
(``worker.engine.tick.EngineThread``) or in its own process
(``worker.engine.process``, where they are pickled across a socket). Nothing
here imports torch: the worker process unpickles these without loading it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from scheduler.params import SamplingParams
from scheduler.protocol.job import JobSpec
from worker.engine.records import EngineStats

_PARAM_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))

Add = tuple[str, JobSpec, int, list[int]]
"""A request to add: request id, its job, engine priority, tokens to resume from."""


@dataclass
class StepOutput:
    """What the job loop reads of a ``RequestOutput``: only what the step added (the job loop keeps the rest,
    so a tick's size across the engine process's socket does not grow with the output), and nothing whose
    unpickling would import torch into the parent."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[dict[str, Any]] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int

    def __reduce__(self) -> tuple[type[StepOutput], tuple[Any, ...]]:
        # Pickled as its fields in order: a step's outputs cross the engine process's socket every step, and
        # this takes about 40 % less time to pickle and 55 % less to unpickle than a dataclass's state dict.
        return (StepOutput, (self.request_id, self.new_token_ids, self.new_text, self.new_logprobs, self.finished,
                             self.finish_reason, self.num_prompt_tokens, self.num_cached_tokens))



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
    """What one engine tick did, the same from a thread or across the engine process's socket."""

    rejected: dict[str, Rejection]
    outputs: list[StepOutput]
    num_unfinished: int
    stats: EngineStats
    """The engine's counters after the step."""


@dataclass(frozen=True)
class TickRequest:
    """Parent to engine process: one tick to run (``None`` in its place: stop)."""

    adds: list[Add]
    aborts: list[str]
    do_step: bool


@dataclass(frozen=True)
class EngineReady:
    """Engine process to parent: the engine is built, with these limits."""

    max_num_seqs: int
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class EngineError:
    """Engine process to parent: the engine could not be built, or a tick raised; ``message`` says why."""

    message: str


EngineMessage = EngineReady | EngineError | Tick
"""Everything the engine process sends its parent."""


class EngineFailed(RuntimeError):
    """The engine cannot tick any more: its process died, or a step raised (the message holds its traceback)."""


class EngineRunner(Protocol):
    max_num_seqs: int
    max_model_len: int
    """Longest prompt + output a request may have."""
    vocab_size: int
    """Token ids a prompt may hold are below this."""

    @property
    def failure(self) -> BaseException | None:
        """Why the engine can take no more ticks (its process died), found even with none in flight; or None."""
        ...

    def tick(self, adds: list[Add], aborts: list[str], do_step: bool) -> asyncio.Future[Tick]:
        """Hand the tick to the engine at once (not at the caller's next await); the future holds its result.

        Ticks run one at a time in the order given, also when a caller stops waiting for one.
        """
        ...

    async def aclose(self) -> None: ...
