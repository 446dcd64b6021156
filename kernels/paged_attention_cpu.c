/* Paged decode attention on CPU: every sequence with a few new query tokens (one when decoding) attends to
 * its cached context, read in place from the paged fp32 cache, with no gathered copy.
 *
 * Built and checked at start-up by kernels/paged_attention_cpu.py, which documents the contract. For each
 * (sequence, kv head), one pass over the sequence's blocks keeps an online softmax per query row, a row
 * being (new token, query head of the group): each block's keys serve every row that shares them while
 * they are in the L1 cache.
 */
#include <math.h>
#include <stdint.h>

#define MAX_BLOCK_SIZE 256
#define MAX_ROWS 256        /* query rows of one (sequence, kv head): new tokens * group */
#define MAX_ROWS_DIM 16384  /* rows * head_dim */

/* e^x for x <= 0 (a score minus the running maximum), written so that the compiler vectorises it (the C
 * library's expf is a call per element): 2^(x log2 e) split into the nearest integer power, put into the
 * exponent bits, and 2^f for the rest, f in [-1/2, 1/2], by its degree-6 Taylor polynomial. Within 5e-7
 * relative above -5 and 2e-6 below, where the weights are under 0.007 of the maximum's. Below -87 it gives
 * about 1e-38 rather than 0, which weighs nothing against the terms near the maximum (e^0 = 1). */
static inline float exp_nonpositive(float x)
{
    const float t = (x < -87.0f ? -87.0f : x) * 1.44269504088896341f; /* NaN stays NaN */
    const float rounded = rintf(t);
    const float whole = rounded == rounded ? rounded : 0.0f; /* NaN: f carries it; the scale stays defined */
    const float f = t - whole;
    const float p = 1.0f + f * (0.693147182f + f * (0.240226507f + f * (0.0555041087f + f * (0.00961812911f
                    + f * (0.00133335581f + f * 0.000154035304f)))));
    int32_t bits;
    __builtin_memcpy(&bits, &p, sizeof bits);
    bits += (int32_t)whole * (1 << 23);
    float result;
    __builtin_memcpy(&result, &bits, sizeof result);
    return result;
}

/* One (sequence, kv head) unit: the online softmax of its `rows` query rows over the sequence's blocks, the
 * result written to out. head_dim is a constant where the caller dispatches on it (32, 64, 128), so that the
 * compiler unrolls the products over it. `next_keys`/`next_values`: the first block of the unit after this
 * one, fetched while this unit's last block is used (0: none). */
static inline __attribute__((always_inline)) void attend_unit(
    const float *q, int64_t q_stride_token, int64_t q_stride_head, const float *k_cache, const float *v_cache,
    int64_t stride_block, int64_t stride_slot, const int32_t *table, int64_t used_blocks, int64_t len,
    int64_t first, int64_t q_len, int64_t group, int64_t head, const int64_t head_dim, int64_t block_size,
    float scale, float *out, int64_t out_stride_token, int64_t out_stride_head, const float *next_keys,
    const float *next_values, float *acc, float *running_max, float *running_sum, float *scores)
{
    const int64_t rows = q_len * group;
    for (int64_t i = 0; i < rows * head_dim; i++)
        acc[i] = 0.0f;
    for (int64_t r = 0; r < rows; r++) {
        running_max[r] = -INFINITY;
        running_sum[r] = 0.0f;
    }
    for (int64_t b = 0; b < used_blocks; b++) {
        /* The next block is anywhere in the cache: fetch its keys and values while this one is used. */
        const float *fetch_keys = next_keys, *fetch_values = next_values;
        if (b + 1 < used_blocks) {
            fetch_keys = k_cache + table[b + 1] * stride_block;
            fetch_values = v_cache + table[b + 1] * stride_block;
        }
        if (fetch_keys != 0)
            for (int64_t t = 0; t < block_size; t++)
                for (int64_t d = 0; d < head_dim; d += 16) {
                    __builtin_prefetch(fetch_keys + t * stride_slot + d);
                    __builtin_prefetch(fetch_values + t * stride_slot + d);
                }
        const int64_t start = b * block_size;
        const int64_t in_block = len - start < block_size ? len - start : block_size;
        const float *keys = k_cache + table[b] * stride_block;
        const float *values = v_cache + table[b] * stride_block;
        /* Row r is (new token i, query head j of the group): r = i * group + j. */
        for (int64_t i = 0; i < q_len; i++) {
            for (int64_t j = 0; j < group; j++) {
                const int64_t r = i * group + j;
                const int64_t visible = len - q_len + i + 1 - start; /* keys of this block up to query i */
                const int64_t count = visible < in_block ? visible : in_block;
                if (count <= 0)
                    continue;
                const float *query = q + (first + i) * q_stride_token + (head * group + j) * q_stride_head;
                float block_max = -INFINITY;
                for (int64_t t = 0; t < count; t++) {
                    const float *key = keys + t * stride_slot;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < head_dim; d++)
                        dot += query[d] * key[d];
                    scores[t] = dot * scale;
                    block_max = scores[t] > block_max ? scores[t] : block_max;
                }
                const float new_max = block_max > running_max[r] ? block_max : running_max[r];
                const float rescale = exp_nonpositive(running_max[r] - new_max);
                float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
                for (int64_t t = 0; t < count; t++) {
                    scores[t] = exp_nonpositive(scores[t] - new_max);
                    block_sum += scores[t];
                }
                running_sum[r] = running_sum[r] * rescale + block_sum;
                running_max[r] = new_max;
                float *row = acc + r * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++)
                    row[d] *= rescale;
                /* Four values per pass over the row: a quarter of the loads and stores of the accumulator. */
                int64_t t = 0;
                for (; t + 4 <= count; t += 4) {
                    const float *v0 = values + t * stride_slot, *v1 = v0 + stride_slot;
                    const float *v2 = v1 + stride_slot, *v3 = v2 + stride_slot;
                    const float p0 = scores[t], p1 = scores[t + 1], p2 = scores[t + 2], p3 = scores[t + 3];
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++)
                        row[d] += (p0 * v0[d] + p1 * v1[d]) + (p2 * v2[d] + p3 * v3[d]);
                }
                for (; t < count; t++) {
                    const float *value = values + t * stride_slot;
                    const float p = scores[t];
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++)
                        row[d] += p * value[d];
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t i = r / group, j = r % group;
        float *o = out + (first + i) * out_stride_token + (head * group + j) * out_stride_head;
        const float inverse = running_sum[r] > 0.0f ? 1.0f / running_sum[r] : 0.0f;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++)
            o[d] = acc[r * head_dim + d] * inverse;
    }
}

/* Whether sequence s is one the kernel attends (1..max_query_len new tokens), and its query offset and length. */
static inline int takes(const int32_t *cu_seqlens_q, int64_t s, int64_t max_query_len, int64_t *first,
                        int64_t *q_len)
{
    *first = cu_seqlens_q[s];
    *q_len = cu_seqlens_q[s + 1] - *first;
    return *q_len >= 1 && *q_len <= max_query_len;
}

static inline __attribute__((always_inline)) int64_t attend_all(
    const float *q, int64_t q_stride_token, int64_t q_stride_head,
    const float *k_cache, const float *v_cache, int64_t num_blocks,
    int64_t stride_block, int64_t stride_slot, int64_t stride_head,
    const int32_t *block_tables, int64_t table_width, int64_t table_stride,
    const int32_t *cu_seqlens_q, const int32_t *seq_lens, int64_t num_seqs, int64_t num_tokens,
    int64_t max_query_len, int64_t num_heads, int64_t num_kv_heads, const int64_t head_dim, int64_t block_size,
    float scale, float *out, int64_t out_stride_token, int64_t out_stride_head)
{
    const int64_t group = num_heads / num_kv_heads;
    float acc[MAX_ROWS_DIM];
    float running_max[MAX_ROWS], running_sum[MAX_ROWS];
    float scores[MAX_BLOCK_SIZE];
    int64_t first, q_len;
    for (int64_t s = 0; s < num_seqs; s++) {
        if (!takes(cu_seqlens_q, s, max_query_len, &first, &q_len))
            continue; /* no new token, or a prefill chunk: not for this kernel */
        const int64_t len = seq_lens[s];
        const int32_t *table = block_tables + s * table_stride;
        const int64_t used_blocks = (len + block_size - 1) / block_size;
        if (first < 0 || first + q_len > num_tokens || len < q_len || used_blocks > table_width)
            return 1 + s;
        for (int64_t b = 0; b < used_blocks; b++)
            if (table[b] < 0 || table[b] >= num_blocks)
                return 1 + s;
        /* The first block of the next attended sequence, fetched during this one's last unit (-1: none). */
        int64_t next_block = -1;
        for (int64_t n = s + 1; n < num_seqs; n++) {
            int64_t next_first, next_q_len;
            if (takes(cu_seqlens_q, n, max_query_len, &next_first, &next_q_len)) {
                if (seq_lens[n] > 0 && table_width > 0)
                    next_block = block_tables[n * table_stride];
                break;
            }
        }
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const float *next_keys = 0, *next_values = 0;
            if (h + 1 < num_kv_heads) {
                next_keys = k_cache + (h + 1) * stride_head + table[0] * stride_block;
                next_values = v_cache + (h + 1) * stride_head + table[0] * stride_block;
            } else if (next_block >= 0 && next_block < num_blocks) {
                next_keys = k_cache + next_block * stride_block;
                next_values = v_cache + next_block * stride_block;
            }
            attend_unit(q, q_stride_token, q_stride_head, k_cache + h * stride_head, v_cache + h * stride_head,
                        stride_block, stride_slot, table, used_blocks, len, first, q_len, group, h, head_dim,
                        block_size, scale, out, out_stride_token, out_stride_head, next_keys, next_values, acc,
                        running_max, running_sum, scores);
        }
    }
    return 0;
}

/* Sequences with 1..max_query_len new tokens are attended (decodes, and a few tokens being verified);
 * query i of such a sequence sits at position seq_len - q_len + i and sees the keys up to it. Rows of
 * other sequences are left alone.
 *
 * Returns 0 on success; -1 for shapes beyond the limits above; otherwise 1 + the index of the first
 * sequence whose query offsets, length or block table are out of range (nothing of that sequence or
 * after it is written). */
int64_t paged_decode_attention_f32(
    const float *q, int64_t q_stride_token, int64_t q_stride_head,
    const float *k_cache, const float *v_cache, int64_t num_blocks,
    int64_t stride_block, int64_t stride_slot, int64_t stride_head,
    const int32_t *block_tables, int64_t table_width, int64_t table_stride,
    const int32_t *cu_seqlens_q, const int32_t *seq_lens, int64_t num_seqs, int64_t num_tokens,
    int64_t max_query_len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale, float *out, int64_t out_stride_token, int64_t out_stride_head)
{
    if (num_kv_heads < 1)
        return -1;
    const int64_t group = num_heads / num_kv_heads;
    if (block_size < 1 || block_size > MAX_BLOCK_SIZE || group < 1 || group * num_kv_heads != num_heads
        || max_query_len < 1 || max_query_len * group > MAX_ROWS || max_query_len * group * head_dim > MAX_ROWS_DIM)
        return -1;
#define ATTEND_ALL(dim)                                                                                           \
    attend_all(q, q_stride_token, q_stride_head, k_cache, v_cache, num_blocks, stride_block, stride_slot,       \
               stride_head, block_tables, table_width, table_stride, cu_seqlens_q, seq_lens, num_seqs,          \
               num_tokens, max_query_len, num_heads, num_kv_heads, dim, block_size, scale, out,                 \
               out_stride_token, out_stride_head)
    /* The common head sizes get their own unrolled copies; any other runs the generic loops. */
    switch (head_dim) {
    case 32: return ATTEND_ALL(32);
    case 64: return ATTEND_ALL(64);
    case 128: return ATTEND_ALL(128);
    default: return ATTEND_ALL(head_dim);
    }
#undef ATTEND_ALL
}
