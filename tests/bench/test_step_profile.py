"""The GPU check's measures that run anywhere: which kernels are matrix products, the bytes of the matrices a step
reads, the table's rows, and transformers' runs of `skewed` beside carpool's."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest

from bench.skewed_gpu import peer_tokens_per_s
from bench.step_profile import TABLE_HEADER, is_matmul_kernel, profile_batch, table_row
from bench.workloads import skewed

MATMUL_KERNELS = [
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel",
    "nvjet_tst_128x64_64x8_2x1_v_bz_TNN",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false>",
    "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn",
    "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>",
    "cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>",
    "_decode_matmul_kernel",
    "_decode_matmul_reduce_kernel",
]
OTHER_KERNELS = [
    "_paged_attention_kernel",
    "_add_rms_norm_kernel",
    "_rope_store_kv_kernel",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::Epilogue>",
]


def test_matrix_product_kernels_are_told_from_the_others() -> None:
    assert all(is_matmul_kernel(name) for name in MATMUL_KERNELS)
    assert not any(is_matmul_kernel(name) for name in OTHER_KERNELS)


def test_a_profile_on_cpu_carries_the_matrix_bytes_of_carpool_models_only(tiny_model: Callable[..., str]) -> None:
    from worker.engine.model_runner import ModelRunner

    path = tiny_model("llama")
    own = profile_batch(path, "cpu", "float32", batch=2, mode="eager", timed_steps=3, model_impl="carpool")
    expected = ModelRunner(path, dtype="float32", num_blocks=8, model_impl="carpool").model.matrix_nbytes  # type: ignore[attr-defined]
    assert own.matrix_bytes == expected > 0
    other = profile_batch(path, "cpu", "float32", batch=2, mode="eager", timed_steps=3, model_impl="transformers")
    assert math.isnan(other.matrix_bytes)
    # No GPU kernels on a CPU: no matrix-product time, and the row says so rather than printing a rate.
    for profile in (own, other):
        row = table_row(profile, peak_gbps=3000.0)
        assert math.isnan(profile.matmul_ms) and row.endswith("| nan | – |")
        assert row.count("|") == TABLE_HEADER.splitlines()[0].count("|")
    # A GPU profile whose kernels none were told to be matrix products: the row says so, the table goes on.
    assert table_row(dataclasses.replace(own, matmul_ms=0.0), peak_gbps=3000.0).endswith("| 0.00 | – |")


@pytest.mark.parametrize("peer", ["generate", "generate_batch"])
def test_transformers_peers_run_the_same_skewed_requests(tiny_model: Callable[..., str], peer: str) -> None:
    rate, tokens = peer_tokens_per_s(peer, tiny_model("llama"), max_num_seqs=2, num_requests=2, device="cpu",
                                     dtype="float32")
    assert tokens == sum(r.max_tokens for r in skewed(2, seed=0).requests)
    assert rate > 0


def test_an_unknown_peer_is_refused(tiny_model: Callable[..., str]) -> None:
    with pytest.raises(ValueError, match="generate or generate_batch"):
        peer_tokens_per_s("vllm", tiny_model("llama"), max_num_seqs=2, num_requests=2, device="cpu", dtype="float32")
