/* Decode attention over the paged KV cache, reading K/V blocks in place.
 *
 * One query token per request attends to its whole context: seq_lens[b] tokens whose K/V sit
 * in blocks block_tables[b, :] of caches laid out [num_blocks, block_size, num_kv_heads,
 * head_dim] (kvledger.storage.kv_cache.PagedKVCache and kv_quant.QuantizedPagedKVCache). The
 * torch path gathers (and for quantised caches dequantises) every context into a padded copy
 * and runs SDPA over it; this kernel reads each K and V row once, where it lies, in its stored
 * format: float32, bfloat16, float16, or int8 / fp8 codes with one float16 scale per token and
 * KV head (the scale multiplies the token's score, and its softmax weight in the V sum, so no
 * dequantised copy is ever made).
 *
 * Per (request, KV head) work item, for the G = num_heads / num_kv_heads query heads that share
 * the KV head (GQA, no expansion): scores s = (q . k) * scale for every context token, then an
 * exact softmax (max, exp, sum: two passes over the scores, not an online rescaling), then the
 * probability-weighted sum of V rows, divided by the sum at the end. Float32 arithmetic, no
 * fast-math; exp is a Cephes-style polynomial accurate to ~1 ulp. One exception: int8 keys
 * against a bfloat16 query are scored with exact int32 dot products of the codes and the query
 * rounded per head to int16 (score_pass_q16), which adds at most 1/64 of the error the query's
 * own bf16 rounding carries and halves the pass's vector work. q is read and out written in
 * the model dtype (float32 or bfloat16). Results depend only on the request's own data, never
 * on the batch around it.
 *
 * Quantised caches keep some positions in full precision (kv_quant's overlay: attention sinks
 * and the recent window, and the step's own token): fp_spans[b] = (overlay base row, sink_lo,
 * sink_hi, win_lo, self) says which. Positions [sink_lo, sink_hi) are read from overlay row
 * base + p, [win_lo, p0) from ring row base + S + p % R, and the query's own position p0 from
 * this step's k/v row when self != 0. Their scores replace the code scores, and their weights
 * are taken out of the code V sum and applied to the full-precision rows instead: the same
 * per-query rule as the torch path (torch_backend._chunk_overlay).
 *
 * Work items are spread over OpenMP threads dynamically; each thread keeps G * max_seq_len
 * floats of scores. Returns 0, or -1 for unsupported arguments (the caller falls back).
 */
#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "kv_walk.h"
#include "simd.h"
#include "kernels.h"

#define MAX_G 16
#define MAX_D 256
#define MAX_ACC 16 /* V accumulators kept in registers: GB query heads x D / VW */

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

/* Prefetch distance, in context tokens (kv_walk.h). Measured on a cold 1,000-token decode (D 64,
 * 4 query heads, 1 thread, Zen 4; ns per token and KV head, before: one whole block prefetched at
 * each block's start): rows of one cache line (int8 / fp8 codes) 48 -> 24 with 16 rows ahead into
 * L1 (into L2: 43); longer rows (bf16, f32) 58 -> 30 into L1, 24 with 32 rows ahead into L2 (16,
 * 48, 64 and 128 ahead no better). */
#define KVL_PD_LINE 16
#define KVL_PD_ROWS 32

static inline kv_walk_t ahead_start(int64_t bs, int64_t bytes) {
    return kv_ahead_start(bytes > 64 ? KVL_PD_ROWS : KVL_PD_LINE, bs);
}

/* Prefetch the next row ahead (one KV head: `bytes` at `head_off`; one line into L1, longer rows
 * into L2) and, for a quantised cache, its block's K and V scales when that row opens a block
 * (one line each: bs * Hkv fp16; either may be NULL). */
static inline void prefetch_ahead(kv_walk_t *c, int64_t len, const char *cache, const int64_t *table, int64_t bs,
                                  int64_t row, int64_t head_off, int64_t bytes, const uint16_t *scales,
                                  const uint16_t *scales2, int64_t Hkv) {
    const int opens = c->j == 0;
    const int64_t slot = kv_prefetch_next(c, len, cache, table, bs, row, head_off, bytes, bytes <= 64);
    if (slot >= 0 && opens) {
        if (scales) _mm_prefetch((const char *)(scales + slot * Hkv), _MM_HINT_T0);
        if (scales2) _mm_prefetch((const char *)(scales2 + slot * Hkv), _MM_HINT_T0);
    }
}

typedef struct {
    const char *kc, *vc;          /* caches, element types KT / VT */
    const uint16_t *ks, *vs;      /* float16 scales [num_blocks * bs, Hkv] (quantised), else NULL */
    const char *ov_k, *ov_v;      /* overlay rows [*, Hkv, D] in the model dtype */
    const char *k_new, *v_new;    /* this step's k/v rows [T, Hkv, D] in the model dtype */
    int64_t new_stride, S, R, Hkv, D, bs;
    int qt;                       /* model dtype: ELEM_F32 or ELEM_BF16 */
    float scale, vunit;           /* vunit: FP8_UNIT for fp8 V codes, else 1 */
} args_t;

/* Full-precision positions of one item (quantised caches): row pointers, at most S + R + 1. */
typedef struct {
    int64_t n;
    int64_t *pos;
    const char **krow, **vrow;
} fp_t;

static float dot_fp(const float *q, const char *row, int qt, int64_t D) {
    vf acc = vzero();
    for (int64_t d = 0; d < D; d += VW)
        acc = vfmadd(vload_as_n(q + d, ELEM_F32, D - d), vload_as_n(row + d * (qt == ELEM_BF16 ? 2 : 4), qt, D - d), acc);
    return vhsum(acc);
}

/* The next four context rows of the (AVX-512, four-head) score loops: their addresses and score
 * factors (scale, times the token's fp16 scale and `unit` for a quantised cache), prefetching
 * ahead and advancing (blk, j) as the one-token loops do; with fv, the tokens' V scales too. */
static inline __attribute__((always_inline)) void next_rows4(
    const args_t *a, kv_walk_t *ahead, int64_t t, int64_t len, const int64_t *table, int64_t row,
    int64_t off, int64_t bytes, const uint16_t *scales, float unit, int64_t kvh, int64_t *blk,
    int64_t *j, const char **k, float *f, float *fv) {
    const int64_t bs = a->bs, Hkv = a->Hkv;
    for (int r = 0; r < 4; r++) {
        prefetch_ahead(ahead, len, a->kc, table, bs, row, off, bytes, scales, fv ? a->vs : NULL, Hkv);
        const int64_t slot = BLOCK_ID(table, *blk) * bs + *j;
        k[r] = a->kc + slot * row + off;
        f[r] = scales ? a->scale * half_to_float(scales[slot * Hkv + kvh]) * unit : a->scale;
        if (fv) fv[t + r] = half_to_float(a->vs[slot * Hkv + kvh]) * a->vunit;
        if (++*j == bs) {
            *j = 0;
            ++*blk;
        }
    }
}

/* Scores of GS query heads (q: GS rows of D floats) against every key of the context, into
 * sc[gi * len + t]; with fv (quantised V), each token's V scale into fv[t] on the way: read
 * beside the K scale, the V pass finds them in order instead of missing one line per block (its
 * own prefetch of that line came too late: int8 / bf16 decode speed 1.15-1.22x -> 1.23-1.39x). KT, D and GS
 * are compile-time constants at the call sites (always_inline): the loops unroll and the
 * accumulators stay in registers. With AVX-512 and four heads, four
 * tokens at a time: their 16 dot products are reduced together (vhsum16), which made the
 * reductions, not the products, the pass's cost when each was reduced on its own. */
static inline __attribute__((always_inline)) void score_pass(
    const args_t *a, const float *q, const int64_t *table, int64_t len, float *sc, float *fv, const int KT,
    const int64_t D, const int64_t GS, const int64_t kvh) {
    const int64_t Hkv = a->Hkv, bs = a->bs;
    const int64_t kes = KT == ELEM_F32 ? 4 : (KT <= ELEM_F16 ? 2 : 1);
    const int64_t row = Hkv * D * kes, off = kvh * D * kes;
    const float kunit = KT == ELEM_FP8 ? FP8_UNIT : 1.0f;
    const uint16_t *ks = KT >= ELEM_I8 ? a->ks : NULL;
    kv_walk_t ahead = ahead_start(bs, D * kes);
    int64_t t = 0, blk = 0, j = 0; /* token t is row j of the table's block blk */
#if VW == 16
    if (GS == 4)
        for (; t + 4 <= len; t += 4) {
            const char *k[4];
            float f[4];
            next_rows4(a, &ahead, t, len, table, row, off, D * kes, ks, kunit, kvh, &blk, &j, k, f, fv);
            vf acc[16];
            for (int i = 0; i < 16; i++) acc[i] = vzero();
            for (int64_t d = 0; d < D; d += VW)
                for (int r = 0; r < 4; r++) {
                    vf kv = vload_as_n(k[r] + d * kes, KT, D - d);
                    for (int g = 0; g < 4; g++) acc[4 * r + g] = vfmadd(vload_as_n(q + g * D + d, ELEM_F32, D - d), kv, acc[4 * r + g]);
                }
            /* lane 4g + r: head g, token t + r */
            vf s = vmul(vhsum16(acc), _mm512_broadcast_f32x4(_mm_loadu_ps(f)));
            for (int g = 0; g < 4; g++) _mm_storeu_ps(sc + g * len + t, _mm512_extractf32x4_ps(s, g));
        }
#endif
    for (; t < len; blk++, j = 0) { /* one token at a time, block by block */
        const int64_t slot0 = BLOCK_ID(table, blk) * bs;
        const char *k = a->kc + (slot0 + j) * row + off;
        for (const int64_t end = len - t < bs - j ? j + len - t : bs; j < end; j++, t++, k += row) {
            prefetch_ahead(&ahead, len, a->kc, table, bs, row, off, D * kes, ks, fv ? a->vs : NULL, Hkv);
            if (fv) fv[t] = half_to_float(a->vs[(slot0 + j) * Hkv + kvh]) * a->vunit;
            vf acc[MAX_G];
            for (int64_t g = 0; g < GS; g++) acc[g] = vzero();
            for (int64_t d = 0; d < D; d += VW) {
                vf kv = vload_as_n(k + d * kes, KT, D - d);
                for (int64_t g = 0; g < GS; g++) acc[g] = vfmadd(vload_as_n(q + g * D + d, ELEM_F32, D - d), kv, acc[g]);
            }
            const float f = ks ? a->scale * half_to_float(ks[(slot0 + j) * Hkv + kvh]) * kunit : a->scale;
            for (int64_t g = 0; g < GS; g++) sc[g * len + t] = vhsum(acc[g]) * f;
        }
    }
}

/* The int8-key score pass with the query rounded to int16 (q16, one power-of-two step qs[g] per
 * head): every product and sum is exact in int32 (|q16| <= 32640, |code| <= 128, D <= 256: sums
 * below 2^31), so the only change from the float pass is q's rounding, <= 2^-15 of the head's
 * largest element: 1/64 of the rounding a bfloat16 query already carries, which is why the
 * caller takes this path for bfloat16 queries only. Half the vector operations of
 * converting each code to a float (two int16 products per lane, no conversion of the codes). */
static inline __attribute__((always_inline)) void score_pass_q16(
    const args_t *a, const int16_t *q16, const float *qs, const int64_t *table, int64_t len, float *sc,
    float *fv, const int64_t D, const int64_t GS, const int64_t kvh) {
    const int64_t Hkv = a->Hkv, bs = a->bs, row = Hkv * D, off = kvh * D;
    kv_walk_t ahead = ahead_start(bs, D);
    int64_t t = 0, blk = 0, j = 0; /* token t is row j of the table's block blk */
#if VW == 16
    if (GS == 4) { /* four tokens at a time, reduced together, as score_pass */
        const __m512 qsv = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_insertf128_ps(
            _mm256_castps128_ps256(_mm_set1_ps(qs[0])), _mm_set1_ps(qs[1]), 1)),
            _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(qs[2])), _mm_set1_ps(qs[3]), 1), 1);
        for (; t + 4 <= len; t += 4) {
            const char *k[4];
            float f[4];
            next_rows4(a, &ahead, t, len, table, row, off, D, a->ks, 1.0f, kvh, &blk, &j, k, f, fv);
            vi acc[16];
            for (int i = 0; i < 16; i++) acc[i] = vi_zero();
            for (int64_t d = 0; d < D; d += IW)
                for (int r = 0; r < 4; r++) {
                    vi kv = vi_load_i8((const int8_t *)k[r] + d);
                    for (int g = 0; g < 4; g++) acc[4 * r + g] = vi_dot(acc[4 * r + g], vi_load16(q16 + g * D + d), kv);
                }
            /* lane 4g + r: head g, token t + r; the same products as the one-token path below */
            const __m512 m = _mm512_mul_ps(qsv, _mm512_broadcast_f32x4(_mm_loadu_ps(f)));
            const __m512 s = _mm512_mul_ps(_mm512_cvtepi32_ps(vhsum16_epi32(acc)), m);
            for (int g = 0; g < 4; g++) _mm_storeu_ps(sc + g * len + t, _mm512_extractf32x4_ps(s, g));
        }
    }
#endif
    for (; t < len; blk++, j = 0) {
        const int64_t slot0 = BLOCK_ID(table, blk) * bs;
        const int8_t *k = (const int8_t *)a->kc + (slot0 + j) * row + off;
        for (const int64_t end = len - t < bs - j ? j + len - t : bs; j < end; j++, t++, k += row) {
            prefetch_ahead(&ahead, len, a->kc, table, bs, row, off, D, a->ks, fv ? a->vs : NULL, Hkv);
            if (fv) fv[t] = half_to_float(a->vs[(slot0 + j) * Hkv + kvh]) * a->vunit;
            vi acc[MAX_G];
            for (int64_t g = 0; g < GS; g++) acc[g] = vi_zero();
            for (int64_t d = 0; d < D; d += IW) {
                vi kv = vi_load_i8(k + d);
                for (int64_t g = 0; g < GS; g++) acc[g] = vi_dot(acc[g], vi_load16(q16 + g * D + d), kv);
            }
            const float f = a->scale * half_to_float(a->ks[(slot0 + j) * Hkv + kvh]);
            for (int64_t g = 0; g < GS; g++) sc[g * len + t] = (float)vi_hsum(acc[g]) * (qs[g] * f);
        }
    }
}

/* out[gi] = sum_t w[gi * len + t] * V_t for GN query heads (unnormalised); each V row is loaded
 * (and converted) once for the GN heads, whose accumulators stay in registers. Quantised V rows
 * take their scales from fv (the score pass read them). */
static inline __attribute__((always_inline)) void v_pass(
    const args_t *a, const float *w, const float *fv, const int64_t *table, int64_t len, float *out, const int VT,
    const int64_t D, const int64_t GN, const int64_t kvh) {
    const int64_t Hkv = a->Hkv, bs = a->bs, DV = (D + VW - 1) / VW;
    const int64_t ves = VT == ELEM_F32 ? 4 : (VT <= ELEM_F16 ? 2 : 1);
    const int64_t row = Hkv * D * ves;
    const int64_t nblocks = (len + bs - 1) / bs;
    vf acc[MAX_ACC > MAX_D / VW ? MAX_ACC : MAX_D / VW];
    for (int64_t i = 0; i < GN * DV; i++) acc[i] = vzero();
    kv_walk_t ahead = ahead_start(bs, D * ves);
    for (int64_t blk = 0, t = 0; blk < nblocks; blk++) {
        const int64_t slot0 = BLOCK_ID(table, blk) * bs;
        const char *v = a->vc + (slot0 * Hkv + kvh) * D * ves;
        const int64_t n = len - t < bs ? len - t : bs;
        for (int64_t j = 0; j < n; j++, t++, v += row) {
            prefetch_ahead(&ahead, len, a->vc, table, bs, row, kvh * D * ves, D * ves, NULL, NULL, Hkv);
            const float f = VT >= ELEM_I8 ? fv[t] : 1.0f;
            vf pv[MAX_ACC];
            for (int64_t gi = 0; gi < GN; gi++) pv[gi] = vset1(w[gi * len + t] * f);
            for (int64_t d = 0; d < DV; d++) {
                vf vv = vload_as_n(v + d * VW * ves, VT, D - d * VW);
                for (int64_t gi = 0; gi < GN; gi++) acc[gi * DV + d] = vfmadd(pv[gi], vv, acc[gi * DV + d]);
            }
        }
    }
    for (int64_t gi = 0; gi < GN; gi++)
        for (int64_t d = 0; d < DV; d++) vstore_n(out + gi * D + d * VW, acc[gi * DV + d], D - d * VW);
}

/* Specialisations: element type x head_dim {32, 64, 128, any} x heads per pass {4, 2, 1}. The
 * generic head_dim runs its loops with masked loads and no unrolling: 1.7x slower at 32 than
 * the specialised 64 on twice the data, before 32 was specialised. */
#define BY_GS(CALL, DD)                    \
    switch (gs) {                          \
    case 4: CALL(DD, 4); return;           \
    case 2: CALL(DD, 2); return;           \
    default: CALL(DD, 1); return;          \
    }
#define BY_D(CALL)                         \
    if (D == 32) { BY_GS(CALL, 32) }       \
    if (D == 64) { BY_GS(CALL, 64) }       \
    if (D == 128) { BY_GS(CALL, 128) }     \
    CALL(D, gs);                           \
    return;

#define SCORE(DD, GG) score_pass(a, q, table, len, sc, fv, KT_, DD, GG, kvh)
static void scores_any(const args_t *a, const float *q, const int64_t *table, int64_t len, float *sc,
                       float *fv, int kt, int64_t D, int64_t gs, int64_t kvh) {
#define KT_ ELEM_F32
    if (kt == KT_) { BY_D(SCORE) }
#undef KT_
#define KT_ ELEM_BF16
    if (kt == KT_) { BY_D(SCORE) }
#undef KT_
#define KT_ ELEM_F16
    if (kt == KT_) { BY_D(SCORE) }
#undef KT_
#define KT_ ELEM_I8
    if (kt == KT_) { BY_D(SCORE) }
#undef KT_
#define KT_ ELEM_FP8
    if (kt == KT_) { BY_D(SCORE) }
#undef KT_
}
#define SCORE16(DD, GG) score_pass_q16(a, q16, qs, table, len, sc, fv, DD, GG, kvh)
/* D a multiple of 32 (the caller checks): whole int16 vectors on both ISAs. */
static void scores_q16(const args_t *a, const int16_t *q16, const float *qs, const int64_t *table, int64_t len,
                       float *sc, float *fv, int64_t D, int64_t gs, int64_t kvh) {
    BY_D(SCORE16)
}
#define VSUM(DD, GG) v_pass(a, w, fv, table, len, out, VT_, DD, GG, kvh)
static void vsum_any(const args_t *a, const float *w, const float *fv, const int64_t *table, int64_t len,
                     float *out, int vt, int64_t D, int64_t gs, int64_t kvh) {
#define VT_ ELEM_F32
    if (vt == VT_) { BY_D(VSUM) }
#undef VT_
#define VT_ ELEM_BF16
    if (vt == VT_) { BY_D(VSUM) }
#undef VT_
#define VT_ ELEM_F16
    if (vt == VT_) { BY_D(VSUM) }
#undef VT_
#define VT_ ELEM_I8
    if (vt == VT_) { BY_D(VSUM) }
#undef VT_
#define VT_ ELEM_FP8
    if (vt == VT_) { BY_D(VSUM) }
#undef VT_
}

static inline int64_t pass_heads(int64_t left, int64_t cap) {
    int64_t g = left >= 4 ? 4 : (left >= 2 ? 2 : 1);
    while (g > cap) g /= 2;
    return g;
}

/* One (request, KV head) item: q and out are G rows of D floats. */
static void attend_item(const args_t *a, const float *q, const int64_t *table, int64_t len,
                        float *out, int kt, int vt, int64_t G, int64_t kvh, float *sc, float *fv,
                        const fp_t *fp, float *fpw) {
    const int64_t D = a->D;
    /* int8 keys, bfloat16 query: integer scores (score_pass_q16), q rounded per head to int16
     * with a power-of-two step, so its largest elements (a bf16's 8 significant bits) stay exact. */
    int q16_path = kt == ELEM_I8 && a->qt == ELEM_BF16 && D % 32 == 0;
    int16_t q16[q16_path ? G * D : 1];
    float qs[MAX_G];
    for (int64_t g = 0; g < G && q16_path; g++) {
        float m = 0.0f;
        for (int64_t d = 0; d < D; d++) {
            const float x = fabsf(q[g * D + d]);
            if (!(x <= FLT_MAX)) q16_path = 0; /* inf / NaN: the float pass, as other formats */
            m = x > m ? x : m;
        }
        int e = 0;
        frexpf(m, &e); /* m < 2^e */
        if (m == 0.0f || e < -100) { /* scores below ~1e-30 of the keys: zero */
            qs[g] = 0.0f;
            for (int64_t d = 0; d < D; d++) q16[g * D + d] = 0;
            continue;
        }
        qs[g] = ldexpf(1.0f, e - 15);
        const float inv = ldexpf(1.0f, 15 - e);
        for (int64_t d = 0; d < D; d++) q16[g * D + d] = (int16_t)lrintf(q[g * D + d] * inv);
    }
    for (int64_t g0 = 0; g0 < G;) {
        const int64_t gs = pass_heads(G - g0, 4);
        float *fvg = g0 == 0 && vt >= ELEM_I8 ? fv : NULL; /* the V scales, once */
        if (q16_path)
            scores_q16(a, q16 + g0 * D, qs + g0, table, len, sc + g0 * len, fvg, D, gs, kvh);
        else
            scores_any(a, q + g0 * D, table, len, sc + g0 * len, fvg, kt, D, gs, kvh);
        g0 += gs;
    }
    if (fp)
        for (int64_t i = 0; i < fp->n; i++)
            for (int64_t g = 0; g < G; g++)
                sc[g * len + fp->pos[i]] = dot_fp(q + g * D, fp->krow[i], a->qt, D) * a->scale;
    /* Softmax numerators in place, and their sums. */
    float sum[MAX_G];
    for (int64_t g = 0; g < G; g++) {
        float *s = sc + g * len;
        float mx = -INFINITY, lanes[VW];
        vf m = vset1(mx), acc = vzero();
        int64_t t = 0;
        for (; t + VW <= len; t += VW) m = vmax(vload(s + t), m); /* a NaN score is skipped, as below */
        vstore(lanes, m);
        for (int i = 0; i < VW; i++) mx = lanes[i] > mx ? lanes[i] : mx;
        for (; t < len; t++) mx = s[t] > mx ? s[t] : mx;
        m = vset1(mx);
        t = 0;
        for (; t + VW <= len; t += VW) {
            vf p = vexp(vsub(vload(s + t), m));
            vstore(s + t, p);
            acc = vadd(acc, p);
        }
        float tail = 0.0f;
        for (; t < len; t++) {
            s[t] = _mm256_cvtss_f32(exp8(_mm256_set1_ps(s[t] - mx)));
            tail += s[t];
        }
        sum[g] = vhsum(acc) + tail;
        if (fp)
            for (int64_t i = 0; i < fp->n; i++) {
                fpw[g * fp->n + i] = s[fp->pos[i]];
                s[fp->pos[i]] = 0.0f; /* its V row is read in full precision below */
            }
    }
    const int64_t DV = (D + VW - 1) / VW;
    const int64_t cap = MAX_ACC / DV < 1 ? 1 : MAX_ACC / DV;
    for (int64_t g0 = 0; g0 < G;) {
        const int64_t gs = pass_heads(G - g0, cap);
        vsum_any(a, sc + g0 * len, fv, table, len, out + g0 * D, vt, D, gs, kvh);
        g0 += gs;
    }
    for (int64_t g = 0; g < G; g++) {
        float *o = out + g * D;
        if (fp)
            for (int64_t i = 0; i < fp->n; i++) {
                vf pv = vset1(fpw[g * fp->n + i]);
                for (int64_t d = 0; d < D; d += VW)
                    vstore_n(o + d, vfmadd(pv, vload_as_n(fp->vrow[i] + d * (a->qt == ELEM_BF16 ? 2 : 4), a->qt, D - d),
                                           vload_as_n(o + d, ELEM_F32, D - d)), D - d);
            }
        vf inv = vset1(1.0f / sum[g]);
        for (int64_t d = 0; d < D; d += VW) vstore_n(o + d, vmul(vload_as_n(o + d, ELEM_F32, D - d), inv), D - d);
    }
}

#ifndef KVL_CONTIGUOUS
/* Float lanes of this build. */
int kvl_vector_width(void) { return VW; }
#endif

int kvl_paged_decode(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                     int kt, int vt, const uint16_t *k_scales, const uint16_t *v_scales,
                     const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                     const int64_t *rows, int64_t B, void *out, int64_t out_row_stride, int qt,
                     int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale,
                     const int64_t *fp_spans, const void *ov_k, const void *ov_v, int64_t S, int64_t R,
                     const void *k_new, const void *v_new, int64_t new_row_stride, int num_threads) {
    if (B < 1 || Hkv < 1 || H % Hkv != 0 || H / Hkv > MAX_G || D % 8 != 0 || D > MAX_D || bs < 1 ||
        num_threads < 1 || (qt != ELEM_F32 && qt != ELEM_BF16) || kt < 0 || kt > ELEM_FP8 || vt < 0 ||
        vt > ELEM_FP8 || ((kt >= ELEM_I8) != (k_scales != NULL)) || ((vt >= ELEM_I8) != (v_scales != NULL)) ||
        (kt == ELEM_F16) != (vt == ELEM_F16) || (kt < ELEM_I8 && kt != ELEM_F16 && kt != vt) ||
        (fp_spans && (!ov_k || !ov_v || !k_new || !v_new || S < 0 || R < 0)))
        return -1;
    const int64_t G = H / Hkv;
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) {
        if (seq_lens[b] < 1) return -1;
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    }
    const args_t a = {k_cache, v_cache, k_scales, v_scales, ov_k, ov_v, k_new, v_new,
                      new_row_stride, S, R, Hkv, D, bs, qt, scale, vt == ELEM_FP8 ? FP8_UNIT : 1.0f};
    const int64_t qes = qt == ELEM_BF16 ? 2 : 4;
    const int64_t max_fp = fp_spans ? S + R + 1 : 0;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *sc = malloc(sizeof(float) * (G * max_len + 2 * G * D + G * max_fp + max_len));
        int64_t *pos = malloc(sizeof(int64_t) * (max_fp + 1));
        const char **rowp = malloc(sizeof(char *) * 2 * (max_fp + 1));
        if (!sc || !pos || !rowp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < B * Hkv; item++) {
            if (!sc || !pos || !rowp) continue;
            const int64_t b = item / Hkv, kvh = item % Hkv, len = seq_lens[b];
            float *qf = sc + G * max_len, *of = qf + G * D, *fpw = of + G * D, *fv = fpw + G * max_fp;
            const char *qp = (const char *)q + (rows[b] * q_row_stride + kvh * G * D) * qes;
            if (qt == ELEM_BF16)
                for (int64_t i = 0; i < G * D; i++) qf[i] = bf16_to_f32(((const uint16_t *)qp)[i]);
            else
                for (int64_t i = 0; i < G * D; i++) qf[i] = ((const float *)qp)[i];
            fp_t fp = {0, pos, rowp, rowp + max_fp + 1};
            if (fp_spans) {
                const int64_t *sp = fp_spans + 5 * b, base = sp[0], p0 = len - 1;
                const int64_t orow = Hkv * D * qes, off = kvh * D * qes;
                for (int64_t p = sp[1]; p < sp[2] && p < p0; p++) {
                    pos[fp.n] = p;
                    fp.krow[fp.n] = (const char *)ov_k + (base + p) * orow + off;
                    fp.vrow[fp.n++] = (const char *)ov_v + (base + p) * orow + off;
                }
                for (int64_t p = sp[3] > sp[2] ? sp[3] : sp[2]; R > 0 && p < p0; p++) {
                    pos[fp.n] = p;
                    fp.krow[fp.n] = (const char *)ov_k + (base + S + p % R) * orow + off;
                    fp.vrow[fp.n++] = (const char *)ov_v + (base + S + p % R) * orow + off;
                }
                if (sp[4]) {
                    pos[fp.n] = p0;
                    fp.krow[fp.n] = (const char *)k_new + rows[b] * new_row_stride * qes + off;
                    fp.vrow[fp.n++] = (const char *)v_new + rows[b] * new_row_stride * qes + off;
                }
            }
            attend_item(&a, qf, block_tables + b * table_stride, len, of, kt, vt, G, kvh, sc, fv,
                       fp_spans ? &fp : NULL, fpw);
            char *op = (char *)out + (rows[b] * out_row_stride + kvh * G * D) * qes;
            if (qt == ELEM_BF16)
                for (int64_t i = 0; i < G * D; i++) ((uint16_t *)op)[i] = f32_to_bf16(of[i]);
            else
                for (int64_t i = 0; i < G * D; i++) ((float *)op)[i] = of[i];
        }
        free(sc);
        free(pos);
        free(rowp);
    }
    return failed ? -1 : 0;
}
