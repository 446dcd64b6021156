"""All tensor work of a step: a transformers model over a paged KV cache.

`ModelRunner.execute` takes the sequences of one step (each a run of new
tokens plus its block table), packs their tokens into one flattened row,
runs one forward with paged attention and returns the logits of the last
token of each sequence that asked for them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from kernels import get_backend
from kernels.paged_attention_torch import GatherWorkspace, plan_decode_groups
from worker.attention import METADATA_KWARG, PagedAttentionMetadata, register_paged_attention

GIB = 1024**3
# CPU default cache budget, allocated (zeroed) up front.
CPU_KV_CACHE_GB = 0.25
# On CUDA the cache takes this share of the memory still free after loading.
CUDA_KV_CACHE_FRACTION = 0.7
# Without an explicit size, never allocate more than this many full-length sequences' worth.
MAX_DEFAULT_SEQS_CPU = 16
MAX_DEFAULT_SEQS_CUDA = 512

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass
class StepSeq:
    """One sequence's share of a step: tokens at positions `start_pos ..` get their KV computed."""

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    need_logits: bool


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        dtype: str | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory_gb: float | None = None,
        attention_backend: str | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {block_size}")
        self.device = torch.device(device)
        self.block_size = block_size
        self.backend = get_backend(attention_backend or ("triton" if self.device.type == "cuda" else "torch"))
        attn_implementation = register_paged_attention()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
            self.model = AutoModelForCausalLM.from_pretrained(
                model_path,
                local_files_only=True,
                dtype=_resolve_dtype(dtype),
                attn_implementation=attn_implementation,
            )
        except OSError as e:
            raise ValueError(f"model: cannot load a checkpoint from {model_path!r}: {e}") from e
        # transformers declares PreTrainedModel.to through functools.wraps, and typeshed's `_Wrapped` binds no
        # `self`, so mypy takes the device for the model.
        self.model.to(self.device).eval()  # type: ignore[arg-type]
        self.model.requires_grad_(False)
        config = self.model.config
        self.dtype: torch.dtype = self.model.dtype
        self.vocab_size: int = config.vocab_size
        self.max_model_len: int = _max_model_len(config)
        self.eos_token_ids: set[int] = _eos_token_ids(self.model)
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_blocks = num_blocks if num_blocks is not None else self._default_num_blocks(kv_cache_memory_gb)
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks: the KV cache must hold at least one block, got {self.num_blocks}")
        cache_shape = (self.num_blocks, block_size, self.num_kv_heads, self.head_dim)
        # Zeroed, not empty: a kernel that masks unused slots must never meet NaN garbage.
        self.k_caches = [torch.zeros(cache_shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v_caches = [torch.zeros(cache_shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self._workspace = GatherWorkspace()

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across all layers, keys and values."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size

    def _default_num_blocks(self, kv_cache_memory_gb: float | None) -> int:
        is_cuda = self.device.type == "cuda"
        if kv_cache_memory_gb is not None:
            if kv_cache_memory_gb <= 0:
                raise ValueError(f"kv_cache_memory_gb: must be positive, got {kv_cache_memory_gb}")
            return int(kv_cache_memory_gb * GIB) // self.block_bytes
        if is_cuda:
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free_bytes * CUDA_KV_CACHE_FRACTION)
        else:
            budget = int(CPU_KV_CACHE_GB * GIB)
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        max_seqs = MAX_DEFAULT_SEQS_CUDA if is_cuda else MAX_DEFAULT_SEQS_CPU
        return min(budget // self.block_bytes, max_seqs * blocks_per_seq)

    @torch.inference_mode()
    def execute(self, batch: list[StepSeq]) -> torch.Tensor:
        """One forward over every sequence's new tokens; float32 logits `[num need_logits, vocab]`."""
        assert batch, "a step runs at least one sequence"
        meta = _step_layout(batch, self.block_size, self.max_model_len)

        def to_device(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.device, non_blocking=True)

        block_tables = to_device(meta.block_tables)
        metadata = PagedAttentionMetadata(
            backend=self.backend,
            k_caches=self.k_caches,
            v_caches=self.v_caches,
            slot_mapping=to_device(meta.slot_mapping),
            block_tables=block_tables,
            cu_seqlens_q=to_device(meta.cu_seqlens_q),
            seq_lens=to_device(meta.seq_lens),
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            backend_hints=self._backend_hints(batch, block_tables),
        )
        output = self.model(
            input_ids=to_device(meta.input_ids).unsqueeze(0),
            position_ids=to_device(meta.positions).unsqueeze(0),
            use_cache=False,
            # A tensor of row indices: lm_head runs only on the rows we sample from.
            logits_to_keep=to_device(meta.logit_rows),
            **{METADATA_KWARG: metadata},
        )
        return output.logits[0].float()

    def _backend_hints(self, batch: list[StepSeq], block_tables: torch.Tensor) -> dict[str, Any]:
        """The torch backend's decode groups, planned once per step rather than once per layer."""
        if self.backend.name != "torch":
            return {}
        decodes = [i for i, seq in enumerate(batch) if len(seq.token_ids) == 1]
        # Keys and values of one block in fp32, the precision the backend attends in.
        block_row_bytes = 2 * self.block_size * self.num_kv_heads * self.head_dim * 4
        groups = plan_decode_groups(decodes, [batch[i].start_pos + 1 for i in decodes], block_tables,
                                    self.block_size, block_row_bytes) if decodes else []
        return {"decode_groups": groups, "workspace": self._workspace}


@dataclass
class _StepLayout:
    """A step's inputs and attention metadata, built on the CPU."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    logit_rows: torch.Tensor
    max_query_len: int
    max_seq_len: int


def _step_layout(batch: list[StepSeq], block_size: int, max_model_len: int) -> _StepLayout:
    """Per-sequence Python, per-token tensor ops: a long prefill chunk costs no Python loop."""
    q_lens = [len(seq.token_ids) for seq in batch]
    seq_lens = [seq.start_pos + n for seq, n in zip(batch, q_lens)]
    max_blocks = max(len(seq.block_table) for seq in batch)
    for seq, n, end in zip(batch, q_lens, seq_lens):
        assert n > 0, "every scheduled sequence brings at least one token"
        assert end <= len(seq.block_table) * block_size, "block table too short for the scheduled tokens"
        assert end <= max_model_len, "sequence longer than the model's context"
    cu_seqlens = list(itertools.accumulate(q_lens, initial=0))
    num_tokens = cu_seqlens[-1]
    block_tables = torch.tensor(
        [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in batch], dtype=torch.int32
    )
    q_lens_t = torch.tensor(q_lens)
    starts = torch.tensor([seq.start_pos for seq in batch])
    # Token t of sequence s sits at start_pos[s] + (t - cu_seqlens[s]).
    seq_of_token = torch.repeat_interleave(torch.arange(len(batch)), q_lens_t, output_size=num_tokens)
    offsets = starts - torch.tensor(cu_seqlens[:-1])
    positions = torch.arange(num_tokens) + offsets[seq_of_token]
    slot_mapping = block_tables[seq_of_token, positions // block_size].long() * block_size + positions % block_size
    # Each sequence's last new token is the one its next token is sampled from.
    logit_rows = [cu_seqlens[i + 1] - 1 for i, seq in enumerate(batch) if seq.need_logits]
    return _StepLayout(
        input_ids=torch.tensor(list(itertools.chain.from_iterable(seq.token_ids for seq in batch)), dtype=torch.long),
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        logit_rows=torch.tensor(logit_rows, dtype=torch.long),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )


def _resolve_dtype(dtype: str | None) -> torch.dtype | str:
    if dtype is None or dtype == "auto":
        return "auto"
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: unknown dtype {dtype!r}, expected one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


def _max_model_len(config: PretrainedConfig) -> int:
    max_len = int(config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    # The kernels attend to the whole context; within the window that equals sliding-window attention.
    if window and getattr(config, "use_sliding_window", True):
        max_len = min(max_len, int(window))
    return max_len


def _eos_token_ids(model: torch.nn.Module) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    return ids
