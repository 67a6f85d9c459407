/* Decode attention over the paged KV cache, reading K/V blocks in place.
 *
 * One query token per request attends to its whole context: seq_lens[b] tokens whose K/V sit
 * in blocks block_tables[b, :] of caches laid out [num_blocks, block_size, num_kv_heads,
 * head_dim] (kvledger.model.kv_cache.PagedKVCache, float32). The torch path gathers every
 * context into a padded copy and runs SDPA over it; this kernel reads each K and V row once,
 * where it lies, so a decode step costs one pass over the live context.
 *
 * Per (request, KV head) work item, for the G = num_heads / num_kv_heads query heads that share
 * the KV head (GQA, no expansion): scores s = (q . k) * scale for every context token, then an
 * exact softmax (max, exp, sum: two passes over the scores, not an online rescaling), then the
 * probability-weighted sum of V rows, divided by the sum at the end. Float32, no fast-math;
 * exp is a Cephes-style polynomial accurate to ~1 ulp. Results depend only on the request's own
 * data, never on the batch around it.
 *
 * Work items are spread over OpenMP threads dynamically; each thread keeps G * max_seq_len
 * floats of scores. Returns 0, or -1 for unsupported arguments (the caller falls back).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

static inline float exp1(float x) { return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))); }

static inline void prefetch_rows(const float *p, int64_t n, int64_t row, int64_t D) {
    for (int64_t j = 0; j < n; j++, p += row)
        for (int64_t d = 0; d < D; d += 16) _mm_prefetch((const char *)(p + d), _MM_HINT_T1);
}

#define MAX_G 16
#define MAX_D 256

/* Which block holds a request's blk-th block of context. contig_decode.c includes this file with
 * KVL_CONTIGUOUS defined, turning it into the contiguous reference kernel: each request's blocks
 * are one run starting at table[0], so the address is affine in blk and no table entry is read
 * per block; every loop below is otherwise the same code. Keep every block lookup behind this. */
#ifdef KVL_CONTIGUOUS
#define BLOCK_ID(table, blk) (table[0] + (blk))
#else
#define BLOCK_ID(table, blk) (table[blk])
#endif

/* One (request, KV head) item. D and G are compile-time constants at the call sites below
 * (always_inline), so the per-token loops unroll and keep their accumulators in registers. */
static inline __attribute__((always_inline)) void attend_one(
    const float *q, const float *kc, const float *vc, const int64_t *table, int64_t len,
    float *out, const int64_t G, const int64_t Hkv, const int64_t kvh, const int64_t D,
    const int64_t bs, const float scale, float *sc) {
    const int64_t row = Hkv * D; /* floats between consecutive tokens of one KV head */
    const int64_t nblocks = (len + bs - 1) / bs;
    float mx[MAX_G], sum[MAX_G];
    for (int64_t g = 0; g < G; g++) mx[g] = -INFINITY;
    /* Scores: every query head of the group against each key, one pass over K. */
    for (int64_t blk = 0, t = 0; blk < nblocks; blk++) {
        const float *k = kc + BLOCK_ID(table, blk) * bs * row + kvh * D;
        const int64_t n = len - t < bs ? len - t : bs;
        /* The blocks are scattered, so the hardware prefetcher stops at each block's end: ask
         * for the next block's keys and this block's values (read in the V pass) now. */
        if (blk + 1 < nblocks) prefetch_rows(kc + BLOCK_ID(table, blk + 1) * bs * row + kvh * D, bs, row, D);
        prefetch_rows(vc + BLOCK_ID(table, blk) * bs * row + kvh * D, n, row, D);
        for (int64_t j = 0; j < n; j++, t++, k += row) {
            __m256 acc[MAX_G];
            for (int64_t g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8) {
                __m256 kv = _mm256_loadu_ps(k + d);
                for (int64_t g = 0; g < G; g++)
                    acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), kv, acc[g]);
            }
            for (int64_t g = 0; g < G; g++) {
                float s = hsum8(acc[g]) * scale;
                sc[g * len + t] = s;
                mx[g] = s > mx[g] ? s : mx[g];
            }
        }
    }
    /* Softmax numerators in place, and their sums. */
    for (int64_t g = 0; g < G; g++) {
        float *s = sc + g * len;
        __m256 m = _mm256_set1_ps(mx[g]), acc = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= len; t += 8) {
            __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
            _mm256_storeu_ps(s + t, p);
            acc = _mm256_add_ps(acc, p);
        }
        float tail = 0.0f;
        for (; t < len; t++) {
            s[t] = exp1(s[t] - mx[g]);
            tail += s[t];
        }
        sum[g] = hsum8(acc) + tail;
    }
    /* Weighted sum of V rows, one query head at a time: its D-wide accumulator stays in
     * registers; after the first head the item's V rows come from L2. */
    for (int64_t g = 0; g < G; g++) {
        const float *p = sc + g * len;
        __m256 acc[MAX_D / 8];
        for (int64_t d = 0; d < D / 8; d++) acc[d] = _mm256_setzero_ps();
        for (int64_t blk = 0, t = 0; blk < nblocks; blk++) {
            const float *v = vc + BLOCK_ID(table, blk) * bs * row + kvh * D;
            const int64_t n = len - t < bs ? len - t : bs;
            for (int64_t j = 0; j < n; j++, t++, v += row) {
                __m256 pv = _mm256_set1_ps(p[t]);
                for (int64_t d = 0; d < D / 8; d++)
                    acc[d] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8 * d), acc[d]);
            }
        }
        __m256 inv = _mm256_set1_ps(1.0f / sum[g]);
        for (int64_t d = 0; d < D / 8; d++) _mm256_storeu_ps(out + g * D + 8 * d, _mm256_mul_ps(acc[d], inv));
    }
}

static void attend_any(const float *q, const float *kc, const float *vc, const int64_t *table,
                       int64_t len, float *out, int64_t G, int64_t Hkv, int64_t kvh, int64_t D,
                       int64_t bs, float scale, float *sc) {
#define CASE(GG, DD)                                                                    \
    if (G == GG && D == DD) {                                                           \
        attend_one(q, kc, vc, table, len, out, GG, Hkv, kvh, DD, bs, scale, sc);        \
        return;                                                                         \
    }
    CASE(1, 64) CASE(2, 64) CASE(4, 64) CASE(8, 64)
    CASE(1, 128) CASE(2, 128) CASE(4, 128) CASE(8, 128)
#undef CASE
    attend_one(q, kc, vc, table, len, out, G, Hkv, kvh, D, bs, scale, sc);
}

int kvl_paged_decode(const float *q, int64_t q_row_stride, const float *k_cache,
                     const float *v_cache, const int64_t *block_tables, int64_t table_stride,
                     const int64_t *seq_lens, const int64_t *rows, int64_t B, float *out,
                     int64_t out_row_stride, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                     float scale, int num_threads) {
    if (B < 1 || Hkv < 1 || H % Hkv != 0 || H / Hkv > MAX_G || D % 8 != 0 || D > MAX_D || bs < 1 ||
        num_threads < 1)
        return -1;
    const int64_t G = H / Hkv;
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) {
        if (seq_lens[b] < 1) return -1;
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *sc = malloc(sizeof(float) * G * max_len);
        if (!sc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < B * Hkv; item++) {
            if (!sc) continue;
            int64_t b = item / Hkv, kvh = item % Hkv;
            attend_any(q + rows[b] * q_row_stride + kvh * G * D, k_cache, v_cache,
                       block_tables + b * table_stride, seq_lens[b],
                       out + rows[b] * out_row_stride + kvh * G * D, G, Hkv, kvh, D, bs, scale, sc);
        }
        free(sc);
    }
    return failed ? -1 : 0;
}
