"""What the engine keeps per request besides its Sequence: text, stop rules, logprobs.

Stop rules follow vLLM's SamplingParams: nothing stops the output before
``min_tokens`` outputs exist (EOS and stop ids are also suppressed in the
sampler until then); EOS stops unless ``ignore_eos``; a stop token id stops
with that id as ``stop_reason``; a stop string stops with the string as
``stop_reason`` and is trimmed from the text unless
``include_stop_str_in_output``; ``max_tokens`` ends with ``"length"``. EOS and
stop tokens stay in ``token_ids`` but never reach the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.sequence import FinishReason, Sequence, SequenceStatus
from worker.engine.detokenizer import IncrementalDetokenizer, find_stop, partial_stop_len
from worker.engine.sampler import SampledToken, SampleRequest
from worker.engine.token_strings import TokenStrings


@dataclass
class RequestOutput:
    """What one step produced for one request.

    ``token_ids`` and ``logprobs`` are read from the request's own lists,
    which only ever grow, up to their lengths at this step: a step costs no
    copy of the whole output, and a reader on another thread still sees
    exactly this step's prefix (each read returns a fresh list).
    """

    request_id: str
    new_token_ids: list[int]
    num_text_chars: int
    """Length of the output text so far: stop strings trimmed, a possible partial stop string held back."""
    new_text: str
    """What ``text`` gained since the request's last output (the text only ever grows)."""
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    all_token_ids: list[int] = field(repr=False)
    num_token_ids: int
    all_logprobs: list[dict[str, Any]] | None = field(repr=False)
    num_logprobs: int
    text_source: RequestState = field(repr=False)
    """The request's state, whose text (which only grows) `text` reads up to `num_text_chars`."""

    @property
    def text(self) -> str:
        """All output text so far (`num_text_chars` of it), joined when read: a step's output carries only the
        length, as it carries its tokens."""
        return self.text_source.text_prefix(self.num_text_chars)

    @property
    def token_ids(self) -> list[int]:
        """Every output token so far (resumed ones included)."""
        return self.all_token_ids[: self.num_token_ids]

    @property
    def logprobs(self) -> list[dict[str, Any]] | None:
        """Per sampled token ``{"token_id", "token", "bytes", "logprob", "top_logprobs": [{"token_id", "token",
        "bytes", "logprob"}]}`` (``token``: the token's text, or ``bytes:\\xNN…`` for part of a character)."""
        return self.all_logprobs[: self.num_logprobs] if self.all_logprobs is not None else None

    @property
    def new_logprobs(self) -> list[dict[str, Any]] | None:
        """The logprobs of ``new_token_ids`` (each sampled token has one)."""
        if self.all_logprobs is None:
            return None
        return self.all_logprobs[self.num_logprobs - len(self.new_token_ids): self.num_logprobs]


@dataclass
class Completion:
    """The final result of one ``Engine.generate`` prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: list[dict[str, Any]] | None
    num_cached_tokens: int


@dataclass
class StopDecision:
    reason: FinishReason
    stop_reason: str | int | None = None


@dataclass
class RequestState:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    eos_token_ids: set[int]
    token_strings: TokenStrings | None = None
    """Names the tokens of logprobs entries (``token``, ``bytes``); without it they carry ids only."""
    logprobs: list[dict[str, Any]] | None = None
    final_text: str | None = None
    """Set once a stop string cut the text; later text is never shown."""
    new_token_ids: list[int] = field(default_factory=list)
    text_reported: int = 0
    """Length of the text in the last output."""
    max_tokens: int = field(init=False)
    """The output limit, resolved when the request was added."""
    sample_request: SampleRequest = field(init=False)
    """What the sampler reads of this request, made once: `sample_request_now` brings its position and
    suppressed ids up to date each step (its token lists are the sequence's own, which only grow)."""

    longest_stop: int = field(init=False)
    """Characters of the longest stop string (0: none): how much of the text's end a stop check reads."""

    def __post_init__(self) -> None:
        if self.seq.params.logprobs is not None:
            self.logprobs = []
        seq = self.seq
        self.longest_stop = max((len(stop) for stop in seq.params.stop), default=0)
        self.max_tokens = seq.max_tokens
        self.sample_request = SampleRequest(request_id=seq.request_id, params=seq.params,
                                            prompt_token_ids=seq.prompt_token_ids,
                                            output_token_ids=seq.output_token_ids, position=0, suppress_token_ids=[])

    def sample_request_now(self) -> SampleRequest:
        """What the sampler needs for the token after the sequence's known ones (pending ones included)."""
        request, seq = self.sample_request, self.seq
        num_output = len(seq.output_token_ids)
        request.position = len(seq.prompt_token_ids) + num_output
        request.suppress_token_ids = self.suppress_token_ids() if num_output < seq.params.min_tokens else []
        return request

    @property
    def text(self) -> str:
        """The text an output may show now (`text_prefix` of `reportable_length`)."""
        return self.text_prefix(self.reportable_length())

    def reportable_length(self) -> int:
        """Characters of text an output may show now: the text cut at a stop string, or all of it but, while the
        request runs, a possible partial stop string at its end (the next tokens may complete it). Reads only
        the text not shown yet."""
        if self.final_text is not None:
            return len(self.final_text)
        buffer = self.detokenizer.buffer
        stops = self.seq.params.stop
        if not stops or self.seq.is_finished:
            return buffer.length
        return buffer.length - partial_stop_len(buffer.recent, stops)

    def text_prefix(self, num_chars: int) -> str:
        """The first `num_chars` characters of the request's text (cut at its stop string, if one ended it)."""
        return (self.final_text if self.final_text is not None else self.detokenizer.text)[:num_chars]

    def suppress_token_ids(self) -> list[int]:
        """Ids the sampler must not draw: stop tokens (and EOS) before min_tokens."""
        params = self.seq.params
        if self.seq.num_output_tokens >= params.min_tokens:
            return []
        ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            ids |= self.eos_token_ids
        return sorted(ids)

    def on_token(self, sampled: SampledToken, num_output_tokens: int | None = None) -> StopDecision | None:
        """Account for a token appended to the sequence; the stop it causes, if any.

        `num_output_tokens`: the output's length up to this token (default: the whole output, the token being
        the last one); a step that accepted several tokens checks them one by one.
        """
        seq = self.seq
        params = seq.params
        num_output = len(seq.output_token_ids) if num_output_tokens is None else num_output_tokens
        token = sampled.token_id
        self.new_token_ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(_logprob_entry(sampled, self.token_strings))
        can_stop = num_output >= params.min_tokens
        if can_stop:
            decision: StopDecision | None = None
            if not params.ignore_eos and token in self.eos_token_ids:
                decision = StopDecision(FinishReason.STOP)
            elif params.stop_token_ids and token in params.stop_token_ids:
                decision = StopDecision(FinishReason.STOP, token)
            if decision is not None:
                # The end's held bytes come out as U+FFFD, which a stop string may hold.
                return self._stop_string_in(self.detokenizer.flush()) or decision
        new_text = self.detokenizer.push_one(token)
        if can_stop:
            found_stop = self._stop_string_in(new_text)
            if found_stop is not None:
                return found_stop
        if num_output >= self.max_tokens:
            flushed = self.detokenizer.flush()
            return (self._stop_string_in(flushed) if can_stop else None) or StopDecision(FinishReason.LENGTH)
        return None

    def _stop_string_in(self, new_text: str) -> StopDecision | None:
        """The stop for a stop string that ends in `new_text` (the text just added), the text cut at it."""
        params = self.seq.params
        if not params.stop or not new_text:
            return None
        # A stop ending in the new text starts in the text not shown yet: what came before it was held back as
        # a possible start of a stop.
        found = find_stop(self.detokenizer.buffer.recent, params.stop, len(new_text))
        if found is None:
            return None
        index, stop = found
        start = self.text_reported + index
        end = start + len(stop) if params.include_stop_str_in_output else start
        self.final_text = self.detokenizer.text[:end]
        return StopDecision(FinishReason.STOP, stop)

    def take_output(self) -> RequestOutput:
        """The output for this step; clears the new tokens."""
        seq = self.seq
        new, self.new_token_ids = self.new_token_ids, []
        buffer, reported = self.detokenizer.buffer, self.text_reported
        end = self.reportable_length()
        if self.final_text is not None:
            new_text = self.final_text[reported:end]
            buffer.take(len(buffer.recent))  # nothing after a stop string is ever shown
        else:
            new_text = buffer.take(end - reported)
        self.text_reported = end
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new,
            num_text_chars=end,
            new_text=new_text,
            finished=seq.status is SequenceStatus.FINISHED,
            finish_reason=seq.finish_reason.value if seq.finish_reason is not None else None,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
            all_token_ids=seq.output_token_ids,
            num_token_ids=len(seq.output_token_ids) - seq.num_pending_tokens,  # the known ones
            all_logprobs=self.logprobs,
            num_logprobs=len(self.logprobs) if self.logprobs is not None else 0,
            text_source=self,
        )


def _logprob_entry(sampled: SampledToken, names: TokenStrings | None) -> dict[str, Any]:
    def one(token_id: int, logprob: float | None) -> dict[str, Any]:
        if names is None:
            return {"token_id": token_id, "logprob": logprob}
        token, data = names.get(token_id)
        entry = {"token_id": token_id, "token": token, "bytes": data, "logprob": logprob}
        if names.is_special(token_id):
            entry["special"] = True  # not in the output text: its bytes take no place there
        return entry

    top = sampled.top_logprobs or {}
    return {**one(sampled.token_id, sampled.logprob), "top_logprobs": [one(t, lp) for t, lp in top.items()]}
