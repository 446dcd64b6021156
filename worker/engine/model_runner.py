"""All tensor work of a step: a transformers model over a paged KV cache.

`ModelRunner.execute` takes the sequences of one step (each a run of new
tokens plus its block table), stages them into persistent device buffers
(`worker.engine.step_inputs`), runs one forward with paged attention and returns
the logits of the last token of each sequence that asked for them (and of
its proposed tokens, when it verifies a speculative proposal). On CUDA,
steps replay CUDA graphs recorded at start-up (`worker.engine.graph_runner`):
decode steps (every sequence brings one token and samples it) replay decode
graphs, and with speculative decoding configured, steps in which every
sequence brings at most `1 + num_speculative_tokens` tokens (verifying
proposals, or not) replay verify graphs. Steps with a longer chunk (prefill)
and batches past `max_num_seqs` run eager.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from kernels import get_backend
from kernels.cpu_build import compiler_of, kernels_cache_dir
from kernels.model_ops_cpu import CpuModelOps, load_cpu_model_ops
from kernels.paged_attention_cpu import CpuDecodeAttention, load_cpu_decode_attention
from kernels.paged_attention import kernels_are_interpreted
from kernels.paged_attention_torch import plan_decode_groups
from kernels.split_kv import MAX_SPLITS, num_multiprocessors, plan_kv_splits
from kernels.workspace import Workspace
from worker.engine.attention import ATTN_IMPLEMENTATION, PagedAttentionMetadata
from worker.engine.checkpoint_config import (
    architecture,
    check_causal,
    check_unquantized,
    eos_token_ids,
    first_paragraph,
    kv_block_bytes,
    max_model_len,
    model_dtype,
    one_line,
)
from worker.engine.config import ModelImpl
from worker.engine.graph_runner import (
    HOST_BRANCHING_ROPE,
    CaptureBackend,
    CudaGraphCapture,
    DecodeGraphs,
    graph_batch_sizes,
    rope_type,
)
from worker.engine.kernel_checks import check_cpu_decode_attention, check_cpu_model_ops, check_paged_attention
from worker.engine.models import CausalLM, choose_model_impl, load_causal_lm
from worker.engine.models.quantization import check_device_supports, parse_quantization
from worker.engine.step_inputs import StepInputs, StepSeq, StepShape, TokenFeed

__all__ = ["ModelRunner", "StepSeq", "TokenFeed"]

log = logging.getLogger(__name__)

CpuLibrary = TypeVar("CpuLibrary", CpuModelOps, CpuDecodeAttention)

GIB = 1024**3
# CPU default cache budget, allocated (zeroed) up front.
CPU_KV_CACHE_GB = 0.25
# On CUDA the cache takes this share of the memory still free after loading.
CUDA_KV_CACHE_FRACTION = 0.7
# Without an explicit size, never allocate more than this many full-length sequences' worth.
MAX_DEFAULT_SEQS_CPU = 16
MAX_DEFAULT_SEQS_CUDA = 512

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "*.model", "vocab.*", "*.tiktoken")
"""A checkpoint's tokenizer is in files like these (a fast tokenizer, a config naming a tokenizer class, a
SentencePiece model, a vocabulary, a tiktoken file)."""


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
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        cuda_graphs: bool | None = None,
        model_impl: str = "auto",
        model_kernels: bool | None = None,
        matmul_tuning: bool | None = None,
        quantization: str | None = None,
        cpu_kernels: bool | None = None,
        draft_model: str | None = None,
        num_speculative_tokens: int = 0,
    ) -> None:
        """`draft_model`: the checkpoint of a draft model whose KV cache will take this one's block count, so that
        the cache's size by default (or `kv_cache_memory_gb`) is the memory of both caches together;
        `cuda_graphs` records decode steps as CUDA graphs (None: on for CUDA with the Triton backend);
        `model_impl` picks carpool's own model (`carpool`, the Llama family), transformers' (`transformers`),
        or the first by the checkpoint's architecture (`auto`); `model_kernels` has carpool's models use their
        fused Triton kernels, and quantized weights on CUDA the quantized matmul kernel (default: on CUDA; on CPU
        only under TRITON_INTERPRET=1, for tests); `matmul_tuning` has carpool's models on CUDA time their
        decode-sized matrix products through torch's and that kernel's launches at load and keep the fastest
        for each (default: wherever the kernels run), kept for later starts in the kernels' cache folder
        (`$XDG_CACHE_HOME/carpool/kernels/matmul-choices`); `quantization`
        (`int8`, `fp8`) holds carpool's models' linear weights quantized per output channel (None: in `dtype`);
        `cpu_kernels` has the torch backend attend decoding sequences with the compiled C kernel of
        `kernels/paged_attention_cpu.py` (None: where it builds and passes its check; True: or fail);
        `num_speculative_tokens`: the most tokens a sequence proposes per step when the engine speculates (0:
        it does not), so that verify steps, `1 + num_speculative_tokens` token rows per sequence, are recorded
        as graphs beside decode steps and the step buffers hold the largest of them."""
        if block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {block_size}")
        assert num_speculative_tokens >= 0, num_speculative_tokens
        self.device = torch.device(device)
        self.block_size = block_size
        self.matmul_tuning = matmul_tuning
        self.quantization = parse_quantization(quantization)
        check_device_supports(self.quantization, self.device)
        self.backend = get_backend(attention_backend or ("triton" if self.device.type == "cuda" else "torch"))
        if self.backend.name == "triton" and self.device.type != "cuda" and not kernels_are_interpreted():
            # Refused here, not at the first step: a worker would take jobs and then fail them all.
            raise ValueError(f"attention_backend: the Triton kernels were compiled for CUDA and cannot run on "
                             f"{self.device}; use the torch backend there "
                             "(or set TRITON_INTERPRET=1 to interpret them)")
        try:
            config = AutoConfig.from_pretrained(model_path, local_files_only=True)
            check_causal(config)
            check_unquantized(config)
            if not any(any(Path(model_path).glob(pattern)) for pattern in TOKENIZER_FILES):
                raise ValueError(f"model: no tokenizer in {model_path!r} (none of {', '.join(TOKENIZER_FILES)}); "
                                 "carpool needs the checkpoint's tokenizer files beside its weights")
            self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        except (OSError, ValueError) as e:  # ValueError: a model type this transformers does not know, say
            if str(e).startswith("model: "):
                raise
            raise ValueError(f"model: cannot load a checkpoint from {model_path!r}: {first_paragraph(e)}") from e
        self.dtype: torch.dtype = model_dtype(config, dtype)
        self.vocab_size: int = config.vocab_size
        self.max_model_len, self.context_limit = max_model_len(config)
        """The model's context, and what sets it (its position embeddings, its sliding window, ...)."""
        self.model_choice = choose_model_impl(config, model_impl, model_path)
        weights = self.quantization.value if self.quantization else str(self.dtype).removeprefix("torch.")
        log.info("model %s: %s implementation (%s), %s weights", model_path, self.model_choice.impl.value,
                 self.model_choice.reason, weights)
        if len(self.tokenizer) > self.vocab_size:
            log.warning("model %s: its tokenizer has %d tokens and its model embeddings for %d: a prompt whose text "
                        "holds a token past them fails (tokens added to the tokenizer without resizing the model's "
                        "embeddings?)", model_path, len(self.tokenizer), self.vocab_size)
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        cpu_ops = self._load_cpu_model_ops(config, cpu_kernels)
        try:
            self.model: CausalLM = load_causal_lm(model_path, config, self.model_choice.impl, self.dtype, self.device,
                                                  self.max_model_len, model_kernels, self.quantization, cpu_ops,
                                                  matmul_tuning, kernels_cache_dir(os.environ) / "matmul-choices")
        except ValueError:
            raise  # already one line naming the setting at fault
        except Exception as e:  # a truncated weights file (SafetensorError), an architecture whose code cannot take
            # carpool's attention (a KeyError looking it up), ...
            why = one_line(e)
            if isinstance(e, KeyError) and e.args == (ATTN_IMPLEMENTATION,):
                why = ("its transformers code looks attention up in a table of its own, not in transformers' "
                       "attention interface, where carpool plugs in its paged attention: this architecture is not "
                       "supported")
            raise ValueError(f"model: cannot load {architecture(config)} from {model_path!r} "
                             f"({self.model_choice.impl.value} implementation): {why}") from e
        self.config = config
        self.model_path = model_path
        self.eos_token_ids: set[int] = eos_token_ids(model_path, config, self.tokenizer.eos_token_id)
        if self.backend.name == "triton" and self.device.type == "cuda":
            failure = check_paged_attention(self.device, self.dtype, self.num_heads, self.num_kv_heads, self.head_dim,
                                            block_size)
            if failure is not None:
                log.warning("the Triton attention kernels failed their start-up check (%s); attention runs on the "
                            "torch backend", failure)
                self.backend = get_backend("torch")
        self.num_layers: int = config.num_hidden_layers
        if num_blocks is None:
            num_blocks = self._default_num_blocks(kv_cache_memory_gb, self._draft_block_bytes(draft_model))
        self.num_blocks = num_blocks
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks: the KV cache must hold at least one block, got {self.num_blocks}")
        # Zeroed, not empty: a kernel that masks unused slots must never meet NaN garbage.
        cache_shape = (self.num_blocks, block_size, self.num_kv_heads, self.head_dim, self.dtype, self.device)
        try:
            self.k_caches = [self.backend.new_cache(*cache_shape) for _ in range(self.num_layers)]
            self.v_caches = [self.backend.new_cache(*cache_shape) for _ in range(self.num_layers)]
        except RuntimeError as e:  # torch.OutOfMemoryError on CUDA, the allocator's own error on CPU
            gib = self.num_blocks * self.block_bytes / GIB
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"num_blocks: a KV cache of {self.num_blocks} blocks ({gib:.1f} GiB) cannot be "
                             f"allocated on {self.device} ({reason}); ask for less with --num-blocks or "
                             "--kv-cache-memory-gb") from None
        self._workspace = Workspace()
        self._graph_workspace = Workspace()
        """The recorded steps' own buffers (split buffers, their logits), sized before recording: a graph keeps the
        addresses it recorded, so an eager step that outgrows a buffer (a prefill's split buffers, say) must grow
        another one."""
        self.cpu_decode: CpuDecodeAttention | None = self._load_cpu_decode(cpu_kernels)
        """The compiled CPU kernel that attends decoding sequences; None where the backend's own path does."""
        self._num_multiprocessors = num_multiprocessors(self.device)
        max_blocks_per_seq = min(-(-self.max_model_len // block_size), self.num_blocks)
        self.max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
        """The most tokens of one step (a step of `max_num_seqs` decodes always fits)."""
        self.verify_query_len = 1 + num_speculative_tokens if num_speculative_tokens else None
        """Token rows per sequence of a verify step, as recorded; None without speculation."""
        # A verify graph of `max_num_seqs` sequences lays out `verify_query_len` rows for each, padding included.
        max_num_rows = max(self.max_num_batched_tokens, max_num_seqs * (self.verify_query_len or 1))
        self.inputs = StepInputs(max_num_seqs, max_num_rows, max_blocks_per_seq, block_size, self.device)
        self._graphs: DecodeGraphs | None = None
        self._verify_graphs: DecodeGraphs | None = None
        self.num_replayed_steps = 0
        """Steps that replayed a recorded graph, decode or verify."""
        self.num_replayed_verify_steps = 0
        """Of those, the ones that replayed a verify graph."""
        self._is_first_forward = False
        """While the start-up forward runs: its attention checks what the model's modules ask of it."""
        self._check_first_forward()
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and self.backend.name == "triton"
        if cuda_graphs:
            if self.device.type != "cuda":
                raise ValueError(f"cuda_graphs: CUDA graphs need a CUDA device, got {self.device}")
            self.capture_decode_graphs(CudaGraphCapture())

    def _check_first_forward(self) -> None:
        """Run one token through the model before any job can: a checkpoint whose code cannot run here (its
        transformers code does not hand carpool's paged attention what it needs, say) is refused at start, in
        one line, instead of failing the first job and stopping the worker. The token's KV lands in block 0,
        which is zeroed again after: the cache starts as it was made."""
        self._is_first_forward = True
        try:
            with torch.inference_mode():
                logits = self.execute([StepSeq(token_ids=[0], start_pos=0, block_table=[0], needs_logits=True)])
                for cache in self.k_caches + self.v_caches:
                    cache[0].zero_()
                logits.sum().item()  # waits for the device: a kernel's fault surfaces here, not at the first job
        except Exception as e:
            raise ValueError(f"model: {architecture(self.config)} from {self.model_path!r} cannot run here "
                             f"({self.model_choice.impl.value} implementation): {one_line(e)}") from e
        finally:
            self._is_first_forward = False
        if logits.shape[-1] != self.vocab_size:  # the sampler's rows are vocab_size wide
            raise ValueError(f"model: {architecture(self.config)} from {self.model_path!r} gives logits over "
                             f"{logits.shape[-1]} tokens (its output embedding's rows), but its config's vocab_size "
                             f"is {self.vocab_size}")

    def capture_decode_graphs(self, backend: CaptureBackend) -> bool:
        """Record decode steps, and verify steps when speculating, at every padded batch size; False (and a log
        line) when this model cannot be.

        A model whose RoPE branches on host values runs eager; so does any
        model whose recording fails, rather than the worker.
        """
        kind = rope_type(self.config)
        if kind in HOST_BRANCHING_ROPE:
            log.warning("decode steps run eager: %s RoPE reads positions on the host, which a graph cannot replay",
                        kind)
            return False
        if self.backend.name == "triton":
            # Split buffers for the most splits any recorded size plans, before any recording needs them.
            self._graph_workspace.reserve("split_out", (MAX_SPLITS, self.inputs.max_num_seqs, self.num_heads,
                                                        self.head_dim), torch.float32, self.device)
            self._graph_workspace.reserve("split_ml", (MAX_SPLITS, self.inputs.max_num_seqs, self.num_heads, 2),
                                          torch.float32, self.device)
        sizes = graph_batch_sizes(self.inputs.max_num_seqs)
        try:
            with torch.inference_mode():  # as the steps it replays run
                # Verify steps first: they are the larger, and later recordings reuse the pool's memory.
                if self.verify_query_len is not None:
                    self.inputs.prepare_padding(self.inputs.max_num_seqs, self.verify_query_len)
                    self._verify_graphs = DecodeGraphs(self._graphed_forward, sizes, backend, self.verify_query_len)
                self.inputs.prepare_padding(self.inputs.max_num_seqs, 1)
                self._graphs = DecodeGraphs(self._graphed_forward, sizes, backend)
        except Exception:
            log.exception("recording step graphs failed; every step runs eager")
            self._graphs = self._verify_graphs = None
            return False
        log.info("decode steps replay recorded graphs at batch sizes %s", sizes)
        if self._verify_graphs is not None:
            log.info("speculative verify steps (%d tokens per sequence) replay recorded graphs at the same sizes",
                     self.verify_query_len)
        return True

    def _load_cpu_model_ops(self, config: PretrainedConfig, wanted: bool | None) -> CpuModelOps | None:
        """carpool's models' add + RMSNorm, SiLU-and-multiply and RoPE + KV store compiled for the CPU, when they
        serve this model and are asked for (None: where they build and pass their check). Only carpool's own
        models are read for their sizes: a transformers-path config need not name an intermediate size."""
        if wanted is False or self.model_choice.impl is not ModelImpl.CARPOOL:
            return None
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return None  # the Triton kernels on CUDA; the references for other dtypes
        ops = load_cpu_model_ops(kernels_cache_dir(os.environ), compiler_of(os.environ))
        failure = ops if isinstance(ops, str) else check_cpu_model_ops(ops, config.hidden_size,
                                                                       config.intermediate_size,
                                                                       self.num_heads, self.num_kv_heads,
                                                                       self.head_dim)
        return _accepted(ops, failure, wanted, "the compiled model ops",
                         "carpool's model runs its norms, SiLU and RoPE on the torch path",
                         "carpool's model: add + RMSNorm, SiLU-and-multiply and RoPE + KV store by compiled CPU "
                         "kernels")

    def _load_cpu_decode(self, wanted: bool | None) -> CpuDecodeAttention | None:
        """The compiled CPU decode kernel when asked for (None: where it serves), checked on this model's shapes."""
        if wanted is False:
            return None
        serves = self.backend.name == "torch" and self.device.type == "cpu" and self.dtype == torch.float32
        if not serves:
            if wanted:
                raise ValueError("cpu_kernels: the compiled decode attention serves the torch backend on CPU with "
                                 f"float32 caches, not {self.backend.name} on {self.device} with {self.dtype}")
            return None
        kernel = load_cpu_decode_attention(kernels_cache_dir(os.environ), compiler_of(os.environ))
        failure = kernel if isinstance(kernel, str) else check_cpu_decode_attention(
            kernel, self.num_heads, self.num_kv_heads, self.head_dim, self.block_size)
        return _accepted(kernel, failure, wanted, "the compiled decode attention",
                         "decode attention runs on the torch path", "decode attention: carpool's compiled CPU kernel")

    @property
    def graph_sizes(self) -> list[int]:
        """The batch sizes decode steps replay at; empty when every step runs eager."""
        return self._graphs.sizes if self._graphs is not None else []

    @property
    def verify_graph_sizes(self) -> list[int]:
        """The batch sizes verify steps replay at; empty without speculation or graphs."""
        return self._verify_graphs.sizes if self._verify_graphs is not None else []

    def release(self, key: str) -> None:
        """A sequence left the batch: its block-table row is free again."""
        self.inputs.release(key)

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across all layers, keys and values."""
        return kv_block_bytes(self.config, self.block_size, self.dtype)

    def _draft_block_bytes(self, draft_model: str | None) -> int:
        """Bytes a block of `draft_model`'s cache will take (it runs in this model's dtype); 0 without one."""
        if draft_model is None:
            return 0
        try:
            config = AutoConfig.from_pretrained(draft_model, local_files_only=True)
        except (OSError, ValueError) as e:  # ValueError: a model type this transformers does not know, say
            raise ValueError(f"draft_model: cannot load a checkpoint from {draft_model!r}: {first_paragraph(e)}") from e
        return kv_block_bytes(config, self.block_size, self.dtype)

    def _default_num_blocks(self, kv_cache_memory_gb: float | None, draft_block_bytes: int) -> int:
        is_cuda = self.device.type == "cuda"
        block_bytes = self.block_bytes + draft_block_bytes
        if kv_cache_memory_gb is not None:
            if kv_cache_memory_gb <= 0:
                raise ValueError(f"kv_cache_memory_gb: must be positive, got {kv_cache_memory_gb}")
            num_blocks = int(kv_cache_memory_gb * GIB) // block_bytes
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory_gb: {kv_cache_memory_gb} GiB holds no KV-cache block; one takes "
                                 f"{block_bytes} bytes at block_size {self.block_size}")
            return num_blocks
        if is_cuda:
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free_bytes * CUDA_KV_CACHE_FRACTION)
        else:
            budget = int(CPU_KV_CACHE_GB * GIB)
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        max_seqs = MAX_DEFAULT_SEQS_CUDA if is_cuda else MAX_DEFAULT_SEQS_CPU
        return min(budget // block_bytes, max_seqs * blocks_per_seq)

    @torch.inference_mode()
    def execute(self, batch: list[StepSeq], feed: TokenFeed | None = None) -> torch.Tensor:
        """One forward over every sequence's new tokens; float32 logits `[rows, vocab]`: for each sequence with
        `needs_logits`, in batch order, the rows of its last `1 + num_spec_tokens` tokens.

        `feed` gives input tokens still on the device (drawn by the step before, not read by the host yet), at
        their places in the batch's tokens laid end to end. A step replays a recorded graph where one holds it:
        a decode graph when every sequence brings one token and samples it, else a verify graph when every
        sequence brings at most its query length. The logits of a replayed step live in the graphs' own
        buffer: read them before the next step.
        """
        assert batch, "a step runs at least one sequence"
        num_seqs = len(batch)
        graphs = self._graphs
        if graphs is not None and all(len(seq.token_ids) == 1 and seq.needs_logits for seq in batch):
            padded = graphs.padded_size(num_seqs)
            if padded is not None:
                self.inputs.prepare(batch, pad_to=padded, gather_table=False)
                self._feed(feed)
                self.num_replayed_steps += 1
                return graphs.replay(padded)[:num_seqs]
        verify = self._verify_graphs
        if verify is not None and all(len(seq.token_ids) <= verify.query_len for seq in batch):
            padded = verify.padded_size(num_seqs)
            if padded is not None:
                # Verify graphs exist only with speculation, which reads each step's tokens before the next: no
                # feed, whose places assume the tokens laid end to end, not a verify graph's padded rows.
                assert feed is None, "a step fed from the device replayed as a verify step"
                shape = self.inputs.prepare(batch, pad_to=padded, query_len=verify.query_len, gather_table=False)
                self.num_replayed_steps += 1
                self.num_replayed_verify_steps += 1
                return verify.replay(padded)[: shape.num_logits]
        shape = self.inputs.prepare(batch)
        self._feed(feed)
        return self._forward(shape, batch)

    def _feed(self, feed: TokenFeed | None) -> None:
        if feed is not None and feed.positions:
            self.inputs.feed_tokens(feed.positions, feed.tokens, feed.rows)

    def _forward(self, shape: StepShape, batch: list[StepSeq]) -> torch.Tensor:
        inputs = self.inputs
        block_tables = inputs.step_table[: shape.num_seqs]
        cu_seqlens_q = inputs.view("cu_seqlens_q", shape.num_seqs + 1)
        seq_lens = inputs.view("seq_lens", shape.num_seqs)
        metadata = PagedAttentionMetadata(
            backend=self.backend,
            k_caches=self.k_caches,
            v_caches=self.v_caches,
            slot_mapping=inputs.view("slot_mapping", shape.num_tokens),
            block_tables=block_tables,
            cu_seqlens_q=cu_seqlens_q,
            seq_lens=seq_lens,
            max_query_len=shape.max_query_len,
            max_seq_len=shape.max_seq_len,
            checks_arguments=self._is_first_forward,
            backend_hints=self._backend_hints(batch, block_tables, cu_seqlens_q, seq_lens, shape),
        )
        # Only the rows sampled from go through lm_head (all of them: None).
        logit_rows = None if shape.num_logits == shape.num_tokens else inputs.view("logit_rows", shape.num_logits)
        logits = self.model(inputs.view("input_ids", shape.num_tokens), inputs.view("positions", shape.num_tokens),
                            metadata, logit_rows)
        return logits.float()

    def _graphed_forward(self, num_seqs: int, query_len: int) -> torch.Tensor:
        """The recorded step over the first `num_seqs` sequences of the buffers, `query_len` token rows each:
        reads nothing on the host. A decode step (one row each) returns every row's logits; a longer one the
        rows `logit_rows` names, as many as the step has rows, the real ones first."""
        inputs = self.inputs
        num_rows = num_seqs * query_len
        inputs.gather_table(num_seqs)
        hints: dict[str, Any] = {"workspace": self._graph_workspace}
        if self.backend.name == "triton":
            # The kernel splits only the contexts of one-token queries: a verify step's splits would sit idle.
            hints["num_kv_splits"] = self._num_kv_splits(num_seqs) if query_len == 1 else 1
        elif self.backend.name == "torch":
            hints["is_graphed"] = True
        metadata = PagedAttentionMetadata(
            backend=self.backend,
            k_caches=self.k_caches,
            v_caches=self.v_caches,
            slot_mapping=inputs.view("slot_mapping", num_rows),
            block_tables=inputs.step_table[:num_seqs],
            cu_seqlens_q=inputs.view("cu_seqlens_q", num_seqs + 1),
            seq_lens=inputs.view("seq_lens", num_seqs),
            max_query_len=query_len,
            max_seq_len=inputs.max_blocks_per_seq * self.block_size,
            is_graphed=True,
            backend_hints=hints,
        )
        logit_rows = None if query_len == 1 else inputs.view("logit_rows", num_rows)
        logits = self.model(inputs.view("input_ids", num_rows), inputs.view("positions", num_rows), metadata,
                            logit_rows)
        # Into one buffer that every recorded step shares (recorded largest first, so it never grows once one
        # was): a graph's own output would stay allocated for as long as the graph, rows * vocab each.
        out = self._graph_workspace.take("logits", tuple(logits.shape), torch.float32, logits.device)
        return out.copy_(logits)

    def _num_kv_splits(self, num_seqs: int) -> int:
        return plan_kv_splits(self._num_multiprocessors, num_seqs * self.num_kv_heads)

    def _backend_hints(self, batch: list[StepSeq], block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       seq_lens: torch.Tensor, shape: StepShape) -> dict[str, Any]:
        """Per-step settings the backend would otherwise derive per layer."""
        if self.backend.name == "triton":
            return {"num_kv_splits": self._num_kv_splits(shape.num_seqs), "workspace": self._workspace}
        if self.backend.name != "torch":
            return {}
        if self.cpu_decode is not None:  # one call per layer attends every decode: no groups to plan
            return {"cpu_decode": self.cpu_decode.plan(block_tables, cu_seqlens_q, seq_lens),
                    "workspace": self._workspace}
        # The torch backend's decode groups, planned once per step rather than once per layer.
        decodes = [i for i, seq in enumerate(batch) if len(seq.token_ids) == 1]
        # Keys and values of one block in fp32, the precision the backend attends in.
        block_row_bytes = 2 * self.block_size * self.num_kv_heads * self.head_dim * 4
        groups = plan_decode_groups(decodes, [batch[i].start_pos + 1 for i in decodes], block_tables,
                                    self.block_size, block_row_bytes) if decodes else []
        return {"decode_groups": groups, "workspace": self._workspace}


def _accepted(loaded: CpuLibrary | str, failure: str | None, wanted: bool | None, what: str, fallback: str,
              serving: str) -> CpuLibrary | None:
    """A compiled CPU library that loaded and passed its check (`failure` None), and the start-up log line that
    says so; else None and a warning naming the `fallback`, or an error when it was `wanted`."""
    if failure is not None:
        if wanted:
            raise ValueError(f"cpu_kernels: {what} cannot be used: {failure}")
        log.warning("%s: %s cannot be used (%s)", fallback, what, failure)
        return None
    assert not isinstance(loaded, str)
    log.info("%s (%s)", serving, loaded.library)
    return loaded
