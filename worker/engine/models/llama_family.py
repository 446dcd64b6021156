"""carpool's own decoder for the Llama family: Llama, Mistral, Qwen2 and Qwen3.

Built from a checkpoint directory's `config.json` (parsed by transformers)
and its safetensors weights, with q/k/v fused into one matrix and gate/up
into another at load time, so a layer is five matrix products: qkv, o,
gate_up, down, and the step's one lm_head product over the sampled rows.
Residual adds are fused into the RMSNorm that follows them, SiLU into the
multiply by `up`, and RoPE is applied by the kernel that writes the KV
cache: Triton kernels on CUDA (`kernels/norm_act.py`, `kernels/rope_kv.py`),
the same fusions compiled from C on CPU in fp32 (`kernels/model_ops_cpu.py`,
one forward's calls checked once per step, with the compiled attention
called directly for decodes), and their torch references otherwise. With a
`quantization` the four layer matrices are held as int8 or fp8 with per-row
scales (`worker.engine.models.quantization`), multiplied on CUDA at decode
sizes by the Triton kernel of `kernels/decode_matmul.py`; embeddings,
norms and lm_head stay in the model's dtype. On CUDA in bf16 or fp16 the
same kernel takes a plain matrix's decode-sized products where it beat
torch's own when both were timed at load (`matmul_tuning`,
`worker.engine.models.matmul_choice`). Attention goes
through the same paged attention as the transformers path
(`worker.engine.attention`). The arithmetic follows transformers' modules step for
step (fp32 RMSNorm, RoPE tables computed the same way, the same roundings),
so greedy tokens match theirs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import PretrainedConfig

from kernels import norm_act
from kernels.model_ops_cpu import CpuForward, CpuModelOps
from kernels.rope_kv import rope_store_kv
from kernels.split_kv import num_multiprocessors
from worker.engine.attention import PagedAttentionMetadata, attend_cached, paged_attention
from worker.engine.kernel_checks import check_model_kernels
from worker.engine.models.packed import PackedWeight, can_pack, pack_verified
from worker.engine.models.matmul_choice import MatmulChoices, MatrixKind, cache_file, choose_matmuls, kind_of
from worker.engine.models.llama_weights import check_weights
from worker.engine.models.matmul_timing import Matrix
from worker.engine.models.quantization import (
    LinearWeight,
    Quantization,
    QuantizedWeight,
    can_use_quantized_kernel,
    gated_linear,
    linear,
    quantize_weight,
)
from worker.engine.models.rope import RotaryEmbedding, apply_rope

log = logging.getLogger(__name__)

ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm over the last axis (Qwen3's per-head q/k norms)."""
    return norm_act.add_rms_norm_reference(x, None, weight, eps)[0]


@dataclass
class _Layer:
    qkv: LinearWeight
    qkv_bias: torch.Tensor | None
    o: LinearWeight
    o_bias: torch.Tensor | None
    gate_up: LinearWeight
    down: LinearWeight
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


class LlamaFamilyModel:
    """Callable as `model(input_ids [T], positions [T], metadata, logit_rows) -> logits [rows, vocab]`."""

    def __init__(self, config: PretrainedConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, max_positions: int, use_kernels: bool | None = None,
                 quantization: Quantization | None = None, cpu_ops: CpuModelOps | None = None,
                 matmul_tuning: bool | None = None, matmul_cache: Path | None = None) -> None:
        """`use_kernels`: the fused Triton kernels of `kernels/norm_act.py` and `kernels/rope_kv.py` (default:
        on CUDA), and on CUDA the decode-sized matmul of `kernels/decode_matmul.py` for quantized weights, each
        where it passes its start-up check; otherwise `cpu_ops`, the same fusions compiled for the CPU
        (`kernels/model_ops_cpu.py`), when given for an fp32 model on CPU; otherwise their plain-torch
        references. `quantization`: how qkv, o, gate_up and down are held (None: in `dtype`). `matmul_tuning`:
        with the kernels on CUDA, time each matrix kind's decode-sized products through torch's product and
        the matmul kernel's plans at load and keep the fastest (`worker.engine.models.matmul_choice`; default:
        on where the kernels are), keeping the choices in a file in the `matmul_cache` folder for later starts."""
        arch = (config.architectures or [""])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"model: carpool's models cover {sorted(ARCHITECTURES)}, not {arch!r}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"model: carpool's models use SiLU, not {config.hidden_act!r}")
        self.config = config
        self.dtype = dtype
        self.device = device
        self.quantization = quantization
        wants_kernels = device.type == "cuda" if use_kernels is None else use_kernels
        self.use_kernels = wants_kernels
        if self.use_kernels:
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            failure = check_model_kernels(device, dtype, config.hidden_size, config.intermediate_size,
                                          config.num_attention_heads,
                                          getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                                          head_dim)
            if failure is not None:
                log.warning("the fused model kernels failed their start-up check (%s); running their torch "
                            "references instead", failure)
                self.use_kernels = False
        serves = not self.use_kernels and device.type == "cpu" and dtype == torch.float32
        self.cpu_ops = cpu_ops if serves else None
        # The fused ops one by one: Triton on CUDA, the compiled ones on CPU (a forward goes through
        # `cpu_ops.forward` instead, but for a final norm over fewer rows), otherwise the torch references.
        self._add_rms_norm: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float],
                                     tuple[torch.Tensor, torch.Tensor]]
        self._silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
        if self.use_kernels:
            self._add_rms_norm, self._silu_and_mul = norm_act.add_rms_norm, norm_act.silu_and_mul
        elif self.cpu_ops is not None:
            self._add_rms_norm, self._silu_and_mul = self.cpu_ops.add_rms_norm, self.cpu_ops.silu_and_mul
        else:
            self._add_rms_norm = norm_act.add_rms_norm_reference
            self._silu_and_mul = norm_act.silu_and_mul_reference
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        check_weights(config, weights, self.num_heads, self.num_kv_heads, self.head_dim)
        use_quantized_kernel = quantization is not None and wants_kernels and can_use_quantized_kernel(
            device, dtype, quantization, self._matrix_shapes(config.hidden_size, config.intermediate_size))
        self.eps: float = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.rope = RotaryEmbedding(config, self.head_dim, max_positions, dtype, device)

        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(device=device, dtype=dtype)

        def maybe(name: str) -> torch.Tensor | None:
            return take(name) if name in weights else None

        def fused(*names: str) -> torch.Tensor:
            return torch.cat([weights.pop(n) for n in names]).to(device=device, dtype=dtype)

        # Packing stops at the first weight that fails its check (and says why); those packed before it passed.
        self.packed = quantization is None and can_pack(device, dtype)

        def matrix(weight: torch.Tensor) -> LinearWeight:
            # Quantized from the checkpoint's values, not from their rounding to `dtype`.
            if quantization is not None:
                return quantize_weight(weight.to(device=device), quantization, dtype)
            plain = weight.to(device=device, dtype=dtype)
            if not self.packed:
                return plain
            packed = pack_verified(plain)
            if isinstance(packed, str):
                log.warning("packing fp32 weights for oneDNN failed its check (%s); the remaining weights stay "
                            "plain", packed)
                self.packed = False
                return plain
            return packed

        def fused_matrix(*names: str) -> LinearWeight:
            return matrix(torch.cat([weights.pop(n) for n in names]))

        self.embed = take("embed_tokens.weight")
        self.layers: list[_Layer] = []
        for i in range(config.num_hidden_layers):
            p = f"layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            has_bias = attn + "q_proj.bias" in weights
            self.layers.append(_Layer(
                qkv=fused_matrix(attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                qkv_bias=fused(attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias") if has_bias else None,
                o=matrix(weights.pop(attn + "o_proj.weight")),
                o_bias=maybe(attn + "o_proj.bias"),
                gate_up=fused_matrix(mlp + "gate_proj.weight", mlp + "up_proj.weight"),
                down=matrix(weights.pop(mlp + "down_proj.weight")),
                input_norm=take(p + "input_layernorm.weight"),
                post_norm=take(p + "post_attention_layernorm.weight"),
                q_norm=maybe(attn + "q_norm.weight"),
                k_norm=maybe(attn + "k_norm.weight"),
            ))
            if mlp + "gate_proj.bias" in weights:
                raise ValueError("model: carpool's models have no MLP biases (mlp_bias)")
        self.norm = take("norm.weight")
        # A tied lm_head is the embedding table itself, which the embedding lookup reads plain: it is not packed.
        self.lm_head: LinearWeight
        if getattr(config, "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)
            self.lm_head = self.embed
        else:
            self.lm_head = matrix(weights.pop("lm_head.weight")) if self.packed else take("lm_head.weight")
        self.vocab_size = self.lm_head.shape[0]
        self.matmuls: MatmulChoices | None = None
        """Which decode-sized products run the matmul kernel, and how; None: none do."""
        # Plain matrices in fp32 stay with torch's product: the kernel's fp32 products are not tensor-core ones.
        tunes = (self.use_kernels and device.type == "cuda" and matmul_tuning is not False
                 and (use_quantized_kernel if quantization is not None else dtype in (torch.bfloat16, torch.float16)))
        if use_quantized_kernel:
            self.matmuls = MatmulChoices(num_multiprocessors(device))  # each bucket's default launch
        if tunes:
            try:
                sms = num_multiprocessors(device)
                cache = None if matmul_cache is None else cache_file(matmul_cache, device, dtype, sms)
                down = self.layers[0].down
                assert not isinstance(down, PackedWeight), "packed weights are the CPU's"
                down_kind = kind_of(down.data if isinstance(down, QuantizedWeight) else down)
                self.matmuls = choose_matmuls(self._matrix_groups(), dtype, device, sms, cache=cache,
                                              gated_kinds={down_kind})
            except Exception:  # a GPU where the timing itself fails: the worker starts without the choice
                log.exception("timing the matrix products failed; %s", "quantized weights take the kernel's default "
                              "launches" if use_quantized_kernel else "torch's matmul serves every product")
        if self.packed:
            extra = sum(w.plain.nbytes for w in [*self._layer_matrices(), self.lm_head] if isinstance(w, PackedWeight))
            log.info("fp32 weights packed for oneDNN at load, plain copies kept for one-row products (+%d MiB)",
                     extra >> 20)

    def _matrix_shapes(self, hidden: int, intermediate: int) -> list[tuple[int, int]]:
        """`(out, in)` of a layer's qkv, o, gate_up and down matrices."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [(q_size + 2 * kv_size, hidden), (hidden, q_size), (2 * intermediate, hidden), (hidden, intermediate)]

    def _layer_matrices(self) -> list[LinearWeight]:
        """Every layer's qkv, o, gate_up and down, in the order a step reads them."""
        return [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    def _matrix_groups(self) -> dict[MatrixKind, list[Matrix]]:
        """The matrices a decode step reads, every layer's qkv, o, gate_up and down and lm_head, by kind."""
        groups: dict[MatrixKind, list[Matrix]] = {}
        for weight in self._layer_matrices():
            assert not isinstance(weight, PackedWeight), "packed weights are the CPU's"
            matrix: Matrix = (weight.data, weight.scales) if isinstance(weight, QuantizedWeight) else (weight, None)
            groups.setdefault(kind_of(matrix[0]), []).append(matrix)
        assert isinstance(self.lm_head, torch.Tensor), type(self.lm_head)
        groups.setdefault(kind_of(self.lm_head), []).append((self.lm_head, None))
        return groups

    def _linear(self, x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, weight, bias, self.matmuls)

    def _mlp_down(self, gate_up: torch.Tensor, down: LinearWeight,
                  silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The down projection of SiLU(gate) * up: in one launch where the timed choice read the activation in."""
        if self.matmuls is not None and (out := gated_linear(gate_up, down, self.matmuls)) is not None:
            return out
        return self._linear(silu_and_mul(gate_up), down)

    @property
    def matrix_nbytes(self) -> int:
        """Bytes of the matrices a decode step reads once each, every layer's four and lm_head: the floor of a
        step's memory traffic (a packed CPU weight's two copies counted once, as a product reads one)."""
        def read(weight: LinearWeight) -> int:
            return weight.plain.nbytes if isinstance(weight, PackedWeight) else weight.nbytes

        layers = sum(read(w) for w in self._layer_matrices())
        return layers + read(self.lm_head)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: PagedAttentionMetadata,
                 logit_rows: torch.Tensor | None) -> torch.Tensor:
        """Logits of `logit_rows` (every token when None), in the model's dtype."""
        hidden = F.embedding(input_ids, self.embed)
        cos, sin = self.rope(positions)
        # On CPU in fp32 the compiled ops, through one forward's calls (their shared arguments checked once).
        step = None if self.cpu_ops is None else self.cpu_ops.forward(
            self.config.hidden_size, self.config.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim,
            cos, sin, metadata.slot_mapping, metadata.k_caches, metadata.v_caches,
            metadata.backend_hints.get("cpu_decode"))
        add_rms_norm = self._add_rms_norm if step is None else step.add_rms_norm
        silu_and_mul = self._silu_and_mul if step is None else step.silu_and_mul
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            x, residual = add_rms_norm(hidden, residual, layer.input_norm, self.eps)
            x = self._attention(i, layer, x, cos, sin, metadata, step)
            x, residual = add_rms_norm(x, residual, layer.post_norm, self.eps)
            hidden = self._mlp_down(self._linear(x, layer.gate_up), layer.down, silu_and_mul)
        assert residual is not None, "a model has at least one layer"
        if logit_rows is not None:  # fewer rows than the forward's: the checked call
            hidden, residual = hidden.index_select(0, logit_rows), residual.index_select(0, logit_rows)
            add_rms_norm = self._add_rms_norm
        hidden, _ = add_rms_norm(hidden, residual, self.norm, self.eps)
        return self._linear(hidden, self.lm_head)

    def _attention(self, index: int, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   metadata: PagedAttentionMetadata, step: CpuForward | None) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self._linear(x, layer.qkv, layer.qkv_bias)
        if step is not None and layer.q_norm is None:
            q = step.rope_store_kv(index, qkv)
            out = step.attend(index, q, metadata.max_query_len, self.scale)
            if out is None:
                out = attend_cached(index, q, metadata, self.scale)
            return self._linear(out.view(num_tokens, q_size), layer.o, layer.o_bias)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = rms_norm(q, layer.q_norm, self.eps), rms_norm(k, layer.k_norm, self.eps)
        if self.use_kernels:
            # RoPE applied where the keys are written: one kernel for both rotations and the KV store.
            q = rope_store_kv(q, k, v, cos, sin, metadata.k_caches[index], metadata.v_caches[index],
                              metadata.slot_mapping)
            out = attend_cached(index, q, metadata, self.scale)
        elif self.cpu_ops is not None:
            q = self.cpu_ops.rope_store_kv(q, k, v, cos, sin, metadata.k_caches[index], metadata.v_caches[index],
                                           metadata.slot_mapping)
            out = attend_cached(index, q, metadata, self.scale)
        else:
            out = paged_attention(index, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, metadata, self.scale)
        return self._linear(out.view(num_tokens, q_size), layer.o, layer.o_bias)


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory's safetensors files (sharded or not), `model.` prefix dropped."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.exists():
        files = sorted({root / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no safetensors weights in {str(root)!r}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                weights[name.removeprefix("model.")] = handle.get_tensor(name)
    return weights
