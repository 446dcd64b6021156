"""The draft-model proposer: a smaller checkpoint with the model's tokenizer proposes the next tokens.

It runs on a ``ModelRunner`` of its own, over a paged KV cache of its own
kept by a ``BlockManager`` of its own (no prefix cache), the same machinery
as the engine's model. Per request it remembers which tokens its cache
holds; each call first brings the cache up to the request's known tokens
(computing only what it lacks, one forward for every request at once), then
drafts greedily, one forward per proposed token, feeding each draft back.
Proposals the engine rejected are found on the next call, as the tail where
the remembered tokens and the known ones part, and their blocks are freed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from scheduler.block_manager import BlockManager
from scheduler.params import SamplingParams
from scheduler.sequence import Sequence
from worker.engine.model_runner import ModelRunner
from worker.engine.step_inputs import StepSeq

log = logging.getLogger(__name__)


@dataclass
class _Draft:
    seq: Sequence
    """Holds the request's draft blocks and how many of its tokens they have computed."""
    computed_ids: list[int] = field(default_factory=list)
    """The tokens whose keys and values the draft cache holds, in order."""
    is_blind: bool = False
    """The request holds a token past the draft's embedding, which it cannot read: it gets no proposals."""


class DraftModel:
    def __init__(self, path: str, target: ModelRunner, max_num_seqs: int, max_model_len: int) -> None:
        try:
            self.runner = ModelRunner(path, device=str(target.device), dtype=str(target.dtype).removeprefix("torch."),
                                      block_size=target.block_size, num_blocks=target.num_blocks,
                                      max_num_seqs=max_num_seqs, max_num_batched_tokens=target.max_num_batched_tokens,
                                      matmul_tuning=target.matmul_tuning,
                                      # Held as the model's weights are: a full-width draft beside a quantized
                                      # model would cost a larger share of its step than the user chose.
                                      quantization=target.quantization.value if target.quantization else None)
        except ValueError as e:  # its faults are the draft's, not the model's: named as --draft-model's
            message = str(e)
            raise ValueError(f"draft_model: {message.removeprefix('model: ')}" if message.startswith("model: ")
                             else message) from e
        if self.runner.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ValueError(f"draft_model: {path} has another tokenizer than the model; a draft model must share it")
        self.max_model_len = min(max_model_len, self.runner.max_model_len)
        if self.max_model_len < max_model_len:
            log.warning("draft model %s serves %d tokens of context, the model %d: sequences longer than %d get "
                        "no proposals", path, self.max_model_len, max_model_len, self.max_model_len)
        draft_bytes, model_bytes = _weight_bytes(path), _weight_bytes(target.model_path)
        if model_bytes and draft_bytes >= model_bytes:
            log.warning("draft model %s holds as many weight bytes as the model or more (%s against %s): each "
                        "proposed token then costs a step of the model or more, and speculation slows decoding",
                        path, f"{draft_bytes:,}", f"{model_bytes:,}")
        self.target_vocab_size = target.vocab_size
        self.vocab_size = self.runner.vocab_size
        """Ids from here on (a model's embedding may be larger than its draft's) are the draft's to skip."""
        self.max_num_tokens = self.runner.max_num_batched_tokens
        """Most tokens one call brings into the cache (the model's step budget)."""
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size, enable_prefix_caching=False)
        self._drafts: dict[str, _Draft] = {}

    def propose(self, requests: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        """Up to `k` greedy draft tokens for each `(request_id, known token ids, k)`.

        A request whose missing tokens do not fit this call's budget, or whose blocks do not fit the draft
        cache, gets its cache brought closer (or nothing) and no proposal this time.
        """
        batch: list[StepSeq] = []
        drafting: list[tuple[str, _Draft, int]] = []
        budget = self.max_num_tokens
        for request_id, tokens, k in requests:
            draft = self._drafts.get(request_id)
            if draft is None:
                draft = self._drafts[request_id] = _Draft(Sequence(request_id, [], SamplingParams()))
            if draft.is_blind:
                continue
            self._roll_back(draft, tokens)
            start = draft.seq.num_computed_tokens
            k = min(k, self.max_model_len - len(tokens))
            num_missing = len(tokens) - start
            if budget <= 0 or k <= 0:
                continue
            catch_up = min(num_missing, budget)
            if max(tokens[start:start + catch_up], default=0) >= self.vocab_size:
                # Known tokens never roll back (only rejected drafts do), so this request stays unreadable.
                draft.is_blind = True
                self.block_manager.free(draft.seq)
                continue
            is_drafting = catch_up == num_missing
            num_blocks_for = catch_up + (k - 1 if is_drafting else 0)
            if not self.block_manager.can_allocate(draft.seq, num_blocks_for):
                continue
            self.block_manager.allocate_for(draft.seq, num_blocks_for)
            batch.append(StepSeq(tokens[start:start + catch_up], start, draft.seq.block_table, is_drafting, request_id))
            budget -= catch_up
            draft.seq.num_computed_tokens += catch_up
            draft.computed_ids.extend(tokens[start:start + catch_up])
            if is_drafting:
                drafting.append((request_id, draft, k))
        if not batch:
            return {}
        proposals: dict[str, list[int]] = {request_id: [] for request_id, _, _ in drafting}
        logits = self.runner.execute(batch)
        for step in range(max((k for _, _, k in drafting), default=0)):
            tokens_drawn = self._greedy(logits)
            feeding = []
            for (request_id, draft, k), token in zip(drafting, tokens_drawn):
                proposals[request_id].append(token)
                if step + 1 < k:
                    feeding.append((request_id, draft, k))
            if not feeding:
                break
            batch = [StepSeq([proposals[request_id][-1]], draft.seq.num_computed_tokens, draft.seq.block_table, True,
                             request_id) for request_id, draft, _ in feeding]
            logits = self.runner.execute(batch)
            for request_id, draft, _ in feeding:
                draft.seq.num_computed_tokens += 1
                draft.computed_ids.append(proposals[request_id][-1])
            drafting = feeding
        # A token the model's vocabulary lacks (a draft with a larger embedding) ends the proposal there.
        return {request_id: _within(tokens, self.target_vocab_size) for request_id, tokens in proposals.items()}

    def _greedy(self, logits: torch.Tensor) -> list[int]:
        return [int(t) for t in logits.argmax(dim=-1).tolist()]

    def _roll_back(self, draft: _Draft, tokens: list[int]) -> None:
        """Keep the cache only for the prefix the remembered tokens share with `tokens`, less its last token
        (whose logits the next proposal starts from)."""
        keep = 0
        computed = draft.computed_ids
        limit = min(len(computed), len(tokens) - 1)
        if computed[:limit] == tokens[:limit]:
            keep = limit
        else:
            while keep < limit and computed[keep] == tokens[keep]:
                keep += 1
        if keep < len(computed):
            del computed[keep:]
            draft.seq.num_computed_tokens = keep
            self.block_manager.trim_to_computed(draft.seq)

    def release(self, request_id: str) -> None:
        draft = self._drafts.pop(request_id, None)
        if draft is not None:
            self.block_manager.free(draft.seq)
            self.runner.release(request_id)


def _within(tokens: list[int], vocab_size: int) -> list[int]:
    for i, token in enumerate(tokens):
        if token >= vocab_size:
            return tokens[:i]
    return tokens


def _weight_bytes(path: str) -> int:
    """The bytes of a checkpoint directory's weight files (safetensors or torch's .bin)."""
    folder = Path(path)
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in folder.glob(pattern))
