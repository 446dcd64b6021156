"""Paged attention plugged into transformers through its attention interface.

The model's own attention modules do the projections and RoPE; at the point
where they would call SDPA they call `paged_attention_forward` instead, which
stores this step's keys and values into the paged cache and attends over it.
Everything the function needs arrives in a `PagedAttentionMetadata` passed as
a keyword argument through the model's forward, so the function is pure and
two runners in one process never share state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kernels import AttentionBackend

ATTN_IMPLEMENTATION = "carpool_paged"
METADATA_KWARG = "carpool_attn_metadata"

INERT_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions",
                          "output_router_logits", "sliding_window"})
"""Keyword arguments transformers' attention modules pass that leave the scores as they are: the model's own
bookkeeping, and a sliding window, which the engine's context never exceeds (`checkpoint_config.max_model_len`), so
that attending to the whole context is attending within the window."""


@dataclass
class PagedAttentionMetadata:
    """One forward's view of the paged KV cache (layouts as in docs/internals.md)."""

    backend: AttentionBackend
    k_caches: list[torch.Tensor]
    """Per layer `[num_blocks, block_size, num_kv_heads, head_dim]`."""
    v_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor
    """`[num_tokens]`: cache slot of each new token, -1 to skip."""
    block_tables: torch.Tensor
    """`[num_seqs, max_blocks_per_seq]` int32, padded with 0."""
    cu_seqlens_q: torch.Tensor
    """`[num_seqs + 1]` int32: offsets of each sequence's new tokens."""
    seq_lens: torch.Tensor
    """`[num_seqs]` int32: context length including this step's tokens."""
    max_query_len: int
    """Most new tokens of one sequence, known on the host: spares a device read per layer."""
    max_seq_len: int
    """Longest context, known on the host."""
    is_graphed: bool = False
    """A step recorded once and replayed (a decode or a speculative verify step): every sequence has
    `max_query_len` rows, its padding rows before its tokens, padding sequences follow the real ones, and nothing
    may be read on the host or planned from host lengths."""
    checks_arguments: bool = False
    """The start-up forward: each attention module's keyword arguments are checked for what paged attention does
    not compute (`unapplied_arguments`); they are the module's configuration, the same at every later forward."""
    backend_hints: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments for this backend's attention only (the torch backend's decode groups and
    gather workspace, the Triton kernel's most splits and split buffers), passed as they are."""


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Store K/V of the new tokens, then attend causally over each sequence's cached context.

    transformers hands over `[1, heads, tokens, head_dim]` (after RoPE) and
    expects `[1, tokens, heads, head_dim]` back, as its eager implementation returns.
    """
    metadata = kwargs.get(METADATA_KWARG)
    if not isinstance(metadata, PagedAttentionMetadata):
        # The model's code calls the attention interface without handing on the keyword arguments of its own
        # forward (StableLM does), where carpool passes each step's paged-cache layout.
        raise ValueError(
            f"{type(module).__name__} calls attention without the arguments its model's forward was given, where "
            f"carpool passes the paged KV cache's layout (`{METADATA_KWARG}`): this architecture is not supported"
        )
    if metadata.checks_arguments and (unapplied := unapplied_arguments(attention_mask, dropout, kwargs)):
        raise ValueError(f"{type(module).__name__} asks for attention that carpool's paged attention does not "
                         f"compute ({'; '.join(unapplied)}): this architecture is not supported")
    assert query.shape[0] == 1, "the runner flattens every sequence into one batch row"
    layer_idx = module.layer_idx
    assert isinstance(layer_idx, int), "transformers' attention modules carry their layer index"
    # Views, not copies: the kernels take strides, and each row's head_dim stays contiguous.
    q = query[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = paged_attention(layer_idx, q, key[0].transpose(0, 1), value[0].transpose(0, 1), metadata, scale)
    return out.unsqueeze(0), None


def unapplied_arguments(attention_mask: torch.Tensor | None, dropout: float, kwargs: dict[str, Any]) -> list[str]:
    """What an attention module passed that would change its result and that paged attention does not apply, each
    as a few words; empty when paged attention computes what the module asked for.

    Anything not known to be inert counts unless it is None: a model is refused rather than served wrong.
    """
    unapplied = []
    if attention_mask is not None:
        unapplied.append("an attention mask or bias (attention_mask)")
    if dropout:
        unapplied.append(f"dropout={dropout}")
    for name, value in kwargs.items():
        if name == METADATA_KWARG or name in INERT_KWARGS or value is None:
            continue
        if name == "is_causal":
            if value is not True:
                unapplied.append(f"is_causal={value} (attention over the whole sequence)")
        elif name == "softcap":
            if value:
                unapplied.append(f"softcap={value} (attention logit soft-capping)")
        elif name in ("s_aux", "sinks"):
            unapplied.append(f"{name} (attention sinks)")
        else:
            unapplied.append(f"{name} (an argument it does not know)")
    return unapplied


def paged_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    metadata: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    """Store this step's keys and values of layer `layer_idx`, then attend; `[tokens, heads, head_dim]` in and out.

    q, k and v may be strided views (their head_dim contiguous).
    """
    k_cache = metadata.k_caches[layer_idx]
    v_cache = metadata.v_caches[layer_idx]
    assert k.shape[1:] == k_cache.shape[2:], (k.shape, k_cache.shape)
    store_kv = metadata.backend.store_kv_padded if metadata.is_graphed else metadata.backend.store_kv
    store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
    return attend_cached(layer_idx, q, metadata, scale)


def attend_cached(layer_idx: int, q: torch.Tensor, metadata: PagedAttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of `q` over layer `layer_idx`'s cache, whose keys and values of this step are already written."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    metadata.backend.attention(
        q,
        metadata.k_caches[layer_idx],
        metadata.v_caches[layer_idx],
        metadata.block_tables,
        metadata.cu_seqlens_q,
        metadata.seq_lens,
        scale,
        out,
        max_query_len=metadata.max_query_len,
        max_seq_len=metadata.max_seq_len,
        **metadata.backend_hints,
    )
    return out


def register_paged_attention() -> str:
    """Register the function with transformers (idempotent) and return its implementation name.

    No mask function is registered on purpose: for implementations without
    one, transformers builds no attention mask, and the kernel applies
    causality itself.
    """
    # Here, not at the top: transformers' modeling package takes seconds to import, and carpool's own models
    # (every Llama-family checkpoint) never need it.
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
