/* carpool's own models' small fused ops on CPU, fp32: residual add + RMSNorm, SiLU-and-multiply, and RoPE
 * applied where the KV cache is written. The same fusions as the Triton kernels of kernels/norm_act.py and kernels/rope_kv.py,
 * with the same plain-torch references; built and checked at start-up by kernels/model_ops_cpu.py. Each
 * replaces several torch ops (and their dispatch) per layer with one call.
 */
#include <math.h>
#include <stdint.h>

/* out = weight * (total / sqrt(mean(total^2) + eps)) per row, total = x + residual (or x): transformers'
 * arithmetic in fp32, the sum of squares in another order. residual_out takes total when a residual is given. */
void add_rms_norm_f32(const float *x, int64_t x_stride, const float *residual, int64_t residual_stride,
                      const float *weight, float eps, float *out, int64_t out_stride, float *residual_out,
                      int64_t residual_out_stride, int64_t rows, int64_t hidden)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        const float *total = xr;
        if (residual != 0) {
            const float *rr = residual + r * residual_stride;
            float *sum = residual_out + r * residual_out_stride;
#pragma omp simd
            for (int64_t i = 0; i < hidden; i++)
                sum[i] = rr[i] + xr[i];
            total = sum;
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < hidden; i++)
            squares += total[i] * total[i];
        const float inverse = 1.0f / sqrtf(squares / (float)hidden + eps);
        float *o = out + r * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++)
            o[i] = weight[i] * (total[i] * inverse);
    }
}

/* x * cos + rotate_half(x) * sin for one head of head_dim values, rotate_half(x) = (-x[half:], x[:half]). */
static inline void rope_head(const float *x, const float *cos, const float *sin, float *out, int64_t head_dim)
{
    const int64_t half = head_dim / 2;
#pragma omp simd
    for (int64_t d = 0; d < half; d++)
        out[d] = x[d] * cos[d] + (-x[d + half]) * sin[d];
#pragma omp simd
    for (int64_t d = half; d < head_dim; d++)
        out[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

/* For each token t: q_out[t] = RoPE(q[t]); the cache slot slot_mapping[t] (-1: none) takes RoPE(k[t]) and
 * v[t]. Returns 0, or 1 + the first token whose slot is beyond the cache (nothing of it or after it is
 * written). */
int64_t rope_store_kv_f32(const float *q, int64_t q_stride_token, int64_t q_stride_head,
                          const float *k, int64_t k_stride_token, int64_t k_stride_head,
                          const float *v, int64_t v_stride_token, int64_t v_stride_head,
                          const float *cos, const float *sin, int64_t cs_stride,
                          float *k_cache, float *v_cache, int64_t num_slots, int64_t block_size,
                          int64_t stride_block, int64_t stride_slot, int64_t stride_head,
                          const int64_t *slot_mapping, float *q_out, int64_t out_stride_token,
                          int64_t out_stride_head, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim)
{
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < -1 || slot >= num_slots)
            return 1 + t;
        const float *c = cos + t * cs_stride, *s = sin + t * cs_stride;
        for (int64_t h = 0; h < num_heads; h++)
            rope_head(q + t * q_stride_token + h * q_stride_head, c, s,
                      q_out + t * out_stride_token + h * out_stride_head, head_dim);
        if (slot < 0)
            continue;
        const int64_t offset = (slot / block_size) * stride_block + (slot % block_size) * stride_slot;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            rope_head(k + t * k_stride_token + h * k_stride_head, c, s, k_cache + offset + h * stride_head,
                      head_dim);
            const float *vh = v + t * v_stride_token + h * v_stride_head;
            float *dst = v_cache + offset + h * stride_head;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++)
                dst[d] = vh[d];
        }
    }
    return 0;
}

/* e^x, written so that the compiler vectorises it (the C library's expf is a call per element): x = n ln 2 + r
 * with n the nearest integer to x / ln 2, and ln 2 split in two so that n ln 2 is subtracted without rounding
 * (Cody and Waite); e^r, |r| <= ln(2) / 2, by its degree-7 Taylor polynomial (within 6e-9 relative); then two
 * factors of 2^(n/2), each a normal float, so that results past the float range overflow to infinity and tiny
 * ones underflow gradually, as expf's do. NaN gives NaN. */
static inline float exp_f32(float x)
{
    const float c = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x); /* e^-104 rounds to 0, e^89 to infinity */
    const float rounded = rintf(c * 1.44269504088896341f);
    const float n = rounded == rounded ? rounded : 0.0f; /* NaN: r carries it; the scale stays defined */
    const float r = (c - n * 0.693359375f) - n * -2.12194440e-4f;
    const float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.66666667e-1f + r * (4.16666667e-2f
                    + r * (8.33333333e-3f + r * (1.38888889e-3f + r * 1.98412698e-4f))))));
    const int32_t k = (int32_t)n, half = k / 2;
    const int32_t bits_a = (half + 127) * (1 << 23), bits_b = (k - half + 127) * (1 << 23);
    float scale_a, scale_b;
    __builtin_memcpy(&scale_a, &bits_a, sizeof scale_a);
    __builtin_memcpy(&scale_b, &bits_b, sizeof scale_b);
    return p * scale_a * scale_b;
}

/* out = silu(gate) * up per row, gate the first `inter` values of a gate_up row and up the next `inter`:
 * silu(x) = x / (1 + e^-x) as torch computes it, its e^x and this one within a few units in the last place. */
void silu_and_mul_f32(const float *gate_up, int64_t gate_up_stride, float *out, int64_t out_stride, int64_t rows,
                      int64_t inter)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * gate_up_stride, *up = gate + inter;
        float *o = out + r * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++)
            o[i] = gate[i] / (1.0f + exp_f32(-gate[i])) * up[i];
    }
}
