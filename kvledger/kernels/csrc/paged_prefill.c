/* Prefill attention over the paged KV cache: the rows of a request's chunk attended together.
 *
 * A chunk of n query rows ends a context of seq_len tokens whose K/V (this step's rows included)
 * sit in blocks block_tables[c, :] of an unquantised cache [num_blocks, block_size, num_kv_heads,
 * head_dim], float32 or bfloat16 (the model dtype). Row r sits at position seq_len - n + r and
 * attends causally to the len = seq_len - n + r + 1 tokens up to it.
 *
 * Why not a decode per row (paged_decode.c, which these rows took before): a decode holds one
 * query per vector (lanes along head_dim) and reduces every score across its lanes; on a prompt's
 * short contexts those reductions, the query reloads and the per-row set-up cost about as much
 * as the products (~17 cycles per query head and token on Zen 4, the products ~8). Here a
 * vector's VW lanes are VW query vectors, (row, head) pairs of one KV head in row-major order
 * (GQA: the G heads sharing it; a tile spans VW / G rows), held transposed (qT[d * VW + lane]):
 *
 *   scores  for 8 tokens at a time, acc[j] += qT[d] * k_j[d] for d = 0 .. D-1 in order (one
 *           fused multiply-add each, the key element broadcast): a dot product summed in order,
 *           no reduction across lanes; times scale.
 *   softmax per lane, over its own len tokens (lanes masked per token: a tile's rows differ by
 *           one token each): max, p = exp(s - max) (simd.h's vexp), the sum in token order; a
 *           lane past its len gets p = 0.
 *   V       per lane, sum_t p_t V_t in token order, lanes in groups whose accumulators stay in
 *           registers, each V row loaded once per group; then * (1 / sum).
 *
 * Float32 arithmetic, no fast-math; a row's result depends only on its own query and context,
 * never on the rows or requests around it (the summation order is fixed per row). It differs
 * from a decode of the same row in the last bits (another summation order), as the SDPA path
 * for long chunks always did.
 *
 * Tree verification (speculative decoding with several candidate continuations in one chunk,
 * kvl_paged_prefill_tree): row r of chunk c also carries tree[row0[c] + r], a bit per row of its
 * chunk (bit j: row j is r's ancestor or r itself); of the chunk's own tokens it attends only to
 * those, the cached context before the chunk as usual. A masked token is left out of the max and
 * adds an exact zero to the sum and to V, so a row's result is that of the same row in a chain
 * of its ancestors alone, bit for bit. At most 64 rows per chunk then.
 *
 * Work items are (chunk, KV head, tile) over OpenMP threads,
 * dynamically, the tiles of the last rows (the longest contexts) first. Returns 0, or -1 for
 * unsupported arguments (the caller falls back).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "kv_walk.h"
#include "simd.h"
#include "kernels.h"

#define PF_MAX_G 16
#define PF_MAX_D 256
#define PF_MAX_ACC 16 /* V accumulators in registers: lanes per V group x D / VW */
#define PF_TOKENS 8   /* score accumulators: tokens per pass */
/* bf16 V rows are converted once per tile into a buffer of len * D floats while that stays at
 * most this many (4 MiB a thread: a 16K-token context at head_dim 64); past it, each lane group
 * converts the rows it reads (the same values, so the same results). */
#define PF_VBUF_MAX_FLOATS (1 << 20)

#if VW == 16
typedef __mmask16 vmask;
static inline vmask vlt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
static inline vf vsel(vmask m, vf a, vf b) { return _mm512_mask_blend_ps(m, b, a); } /* m ? a : b */
#else
typedef __m256 vmask;
static inline vmask vlt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
static inline vf vsel(vmask m, vf a, vf b) { return _mm256_blendv_ps(b, a, m); }
#endif

typedef struct {
    const char *kc, *vc;
    int64_t Hkv, bs;
    float scale;
} pargs_t;

/* Rows are fetched PF_AHEAD tokens before they are read, into L1 (kv_prefetch_next's last
 * argument), through the block table (kv_walk.h): a long context streams from beyond L2 once
 * per tile. */
#define PF_AHEAD 16

/* The cache row of the walker's token for one KV head (`off` into a row of `row` bytes); then
 * the walker moves to the next token. */
static inline const char *walk_next(kv_walk_t *w, const char *cache, const int64_t *table, int64_t bs, int64_t row,
                                    int64_t off) {
    return cache + kv_walk_next(w, table, bs) * row + off;
}

/* D elements of a cache row (element type KT) as floats at dst. */
static inline __attribute__((always_inline)) void row_to_f32(float *dst, const char *p, const int KT, const int64_t D) {
    const int64_t es = KT == ELEM_F32 ? 4 : 2;
    for (int64_t d = 0; d < D; d += VW) vstore_n(dst + d, vload_as_n(p + d * es, KT, D - d), D - d);
}

/* Scores of the tile's lanes against `nt` (<= PF_TOKENS) consecutive tokens, into sc. NT is
 * PF_TOKENS (a compile-time constant: the accumulators stay in registers) or 1. */
static inline __attribute__((always_inline)) void score_tokens(
    const pargs_t *a, const float *qT, kv_walk_t *w, kv_walk_t *ah, int64_t len, const int64_t *table, int64_t kvh,
    float *sc, float *kbuf, const int KT, const int64_t D, const int NT) {
    const int64_t es = KT == ELEM_F32 ? 4 : 2, row = a->Hkv * D * es, off = kvh * D * es;
    const float *k[PF_TOKENS];
    for (int j = 0; j < NT; j++) {
        kv_prefetch_next(ah, len, a->kc, table, a->bs, row, off, D * es, 1);
        const char *p = walk_next(w, a->kc, table, a->bs, row, off);
        if (KT == ELEM_F32) {
            k[j] = (const float *)p;
        } else {
            row_to_f32(kbuf + j * PF_MAX_D, p, KT, D);
            k[j] = kbuf + j * PF_MAX_D;
        }
    }
    vf acc[PF_TOKENS];
    for (int j = 0; j < NT; j++) acc[j] = vzero();
    for (int64_t d = 0; d < D; d++) {
        const vf q = vload(qT + d * VW);
        for (int j = 0; j < NT; j++) acc[j] = vfmadd(q, vset1(k[j][d]), acc[j]);
    }
    const vf scale = vset1(a->scale);
    for (int j = 0; j < NT; j++) vstore(sc + j * VW, vmul(acc[j], scale));
}

/* out[lane] = (sum_t p_t V_t) / sum[lane] for the GN lanes from l0 (p in sc[t * VW + lane], zero
 * past the lane's len), in token order; V rows from the cache (float32, or bfloat16 converted
 * here) or from vbuf (bfloat16 converted once per tile: per lane group, the conversions cost
 * half as much as the products).
 * GN, KT and D are compile-time constants at the call sites. */
static inline __attribute__((always_inline)) void v_lanes(
    const pargs_t *a, const float *sc, const float *sum, const int64_t *lens, const int64_t *table, int64_t l0,
    int64_t kvh, const float *vbuf, float *out, const int KT, const int64_t D, const int64_t GN) {
    const int64_t es = KT == ELEM_F32 ? 4 : 2, row = a->Hkv * D * es, off = kvh * D * es;
    const int64_t DV = (D + VW - 1) / VW;
    int64_t tmax = 0;
    for (int64_t gi = 0; gi < GN; gi++) tmax = lens[l0 + gi] > tmax ? lens[l0 + gi] : tmax;
    vf acc[PF_MAX_ACC > PF_MAX_D / VW ? PF_MAX_ACC : PF_MAX_D / VW];
    for (int64_t i = 0; i < GN * DV; i++) acc[i] = vzero();
    kv_walk_t w = kv_walk_at(0, a->bs);
    kv_walk_t ah = kv_ahead_start(PF_AHEAD, a->bs);
    for (int64_t t = 0; t < tmax; t++) {
        if (!vbuf || KT == ELEM_F32) kv_prefetch_next(&ah, tmax, a->vc, table, a->bs, row, off, D * es, 1);
        const char *raw = walk_next(&w, a->vc, table, a->bs, row, off);
        const float *conv = KT != ELEM_F32 && vbuf ? vbuf + t * D : NULL;
        vf pv[4];
        for (int64_t gi = 0; gi < GN; gi++) pv[gi] = vset1(sc[t * VW + l0 + gi]);
        for (int64_t d = 0; d < DV; d++) {
            const vf vv = conv ? vload_as_n(conv + d * VW, ELEM_F32, D - d * VW)
                               : vload_as_n(raw + d * VW * es, KT, D - d * VW);
            for (int64_t gi = 0; gi < GN; gi++) acc[gi * DV + d] = vfmadd(pv[gi], vv, acc[gi * DV + d]);
        }
    }
    for (int64_t gi = 0; gi < GN; gi++) {
        const vf inv = vset1(1.0f / sum[l0 + gi]);
        for (int64_t d = 0; d < DV; d++) vstore_n(out + (l0 + gi) * D + d * VW, vmul(acc[gi * DV + d], inv), D - d * VW);
    }
}

/* One tile: lens[lane] is the lane's context length (0: unused lane), qT its queries transposed
 * (zero in unused lanes); sc scratch of len_max * VW floats; out VW rows of D floats. */
static inline __attribute__((always_inline)) void tile_attend(
    const pargs_t *a, const float *qT, const int64_t *lens, const int64_t *table, int64_t len_max, int64_t kvh,
    const uint64_t *tree, int64_t t0, float *sc, float *kbuf, float *vbuf, float *out, const int KT,
    const int64_t D) {
    kv_walk_t w = kv_walk_at(0, a->bs);
    kv_walk_t ah = kv_ahead_start(PF_AHEAD, a->bs);
    int64_t t = 0;
    for (; t + PF_TOKENS <= len_max; t += PF_TOKENS)
        score_tokens(a, qT, &w, &ah, len_max, table, kvh, sc + t * VW, kbuf, KT, D, PF_TOKENS);
    for (; t < len_max; t++) score_tokens(a, qT, &w, &ah, len_max, table, kvh, sc + t * VW, kbuf, KT, D, 1);
    float lens_f[VW];
    for (int l = 0; l < VW; l++) lens_f[l] = (float)lens[l];
    const vf lenv = vload(lens_f), zero = vzero();
    /* Tree rows: tm[(t - t0) * VW + lane] is 1 where the lane's row sees the chunk's token t. */
    float tm[tree ? (len_max - t0) * VW : 1];
    if (tree)
        for (t = t0; t < len_max; t++)
            for (int l = 0; l < VW; l++) tm[(t - t0) * VW + l] = (float)((tree[l] >> (t - t0)) & 1);
    vf mx = vset1(-INFINITY);
    for (t = 0; t < len_max; t++) { /* a NaN score is skipped */
        vf m = vsel(vlt(vset1((float)t), lenv), vmax(vload(sc + t * VW), mx), mx);
        if (tree && t >= t0) m = vsel(vlt(zero, vload(tm + (t - t0) * VW)), m, mx);
        mx = m;
    }
    vf total = zero;
    for (t = 0; t < len_max; t++) {
        vf p = vsel(vlt(vset1((float)t), lenv), vexp(vsub(vload(sc + t * VW), mx)), zero);
        if (tree && t >= t0) p = vsel(vlt(zero, vload(tm + (t - t0) * VW)), p, zero);
        vstore(sc + t * VW, p);
        total = vadd(total, p);
    }
    float sum[VW];
    vstore(sum, total);
    if (KT != ELEM_F32 && vbuf) {
        const int64_t es = 2, row = a->Hkv * D * es, off = kvh * D * es;
        w = kv_walk_at(0, a->bs);
        ah = kv_ahead_start(PF_AHEAD, a->bs);
        for (t = 0; t < len_max; t++) {
            kv_prefetch_next(&ah, len_max, a->vc, table, a->bs, row, off, D * es, 1);
            row_to_f32(vbuf + t * D, walk_next(&w, a->vc, table, a->bs, row, off), KT, D);
        }
    }
    const int64_t DV = (D + VW - 1) / VW, cap = PF_MAX_ACC / DV >= 4 ? 4 : (PF_MAX_ACC / DV >= 2 ? 2 : 1);
    for (int64_t l0 = 0; l0 < VW && lens[l0] > 0;) {
        int64_t gn = 0;
        while (gn < cap && l0 + gn < VW && lens[l0 + gn] > 0) gn++;
        if (gn == 4)
            v_lanes(a, sc, sum, lens, table, l0, kvh, vbuf, out, KT, D, 4);
        else if (gn >= 2)
            v_lanes(a, sc, sum, lens, table, l0, kvh, vbuf, out, KT, D, gn = 2);
        else
            v_lanes(a, sc, sum, lens, table, l0, kvh, vbuf, out, KT, D, 1);
        l0 += gn;
    }
}

#define PF_CALL(KT_, DD) tile_attend(a, qT, lens, table, len_max, kvh, tree, t0, sc, kbuf, vbuf, out, KT_, DD)
static void tile_any(const pargs_t *a, const float *qT, const int64_t *lens, const int64_t *table, int64_t len_max,
                     int64_t kvh, const uint64_t *tree, int64_t t0, float *sc, float *kbuf, float *vbuf, float *out,
                     int kt, int64_t D) {
    if (kt == ELEM_F32) {
        if (D == 32) { PF_CALL(ELEM_F32, 32); return; }
        if (D == 64) { PF_CALL(ELEM_F32, 64); return; }
        if (D == 128) { PF_CALL(ELEM_F32, 128); return; }
        PF_CALL(ELEM_F32, D);
        return;
    }
    if (D == 32) { PF_CALL(ELEM_BF16, 32); return; }
    if (D == 64) { PF_CALL(ELEM_BF16, 64); return; }
    if (D == 128) { PF_CALL(ELEM_BF16, 128); return; }
    PF_CALL(ELEM_BF16, D);
}

/* q [T, H, D] rows of q_row_stride elements and out [T, H * D] rows of out_row_stride, both in
 * the model dtype qt (float32 or bfloat16), which is also the cache's (kt); chunk c's rows are
 * row0[c] .. row0[c] + nrows[c] - 1, its context seq_lens[c] tokens in block_tables[c, :].
 * tree: NULL (causal), or a bit mask per row of q (see the top of this file); a chunk whose first
 * row's mask is 0 is causal. */
int kvl_paged_prefill_tree(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache, int kt,
                           const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                           const int64_t *row0, const int64_t *nrows, int64_t C, void *out, int64_t out_row_stride,
                           int qt, int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale, int num_threads,
                           const uint64_t *tree) {
    if (C < 1 || Hkv < 1 || H % Hkv != 0 || H / Hkv > PF_MAX_G || D % 8 != 0 || D > PF_MAX_D || bs < 1 ||
        num_threads < 1 || (qt != ELEM_F32 && qt != ELEM_BF16) || kt != qt)
        return -1;
    const int64_t G = H / Hkv;
    int64_t max_len = 1, items = 0;
    for (int64_t c = 0; c < C; c++) {
        if (nrows[c] < 1 || seq_lens[c] < nrows[c] || (tree && tree[row0[c]] && nrows[c] > 64)) return -1;
        if (seq_lens[c] > max_len) max_len = seq_lens[c];
        items += Hkv * ((nrows[c] * G + VW - 1) / VW);
    }
    /* Item i -> (chunk, KV head, tile); each chunk's last tiles first. */
    int64_t *item = malloc(sizeof(int64_t) * 3 * items);
    if (!item) return -1;
    for (int64_t c = 0, i = 0; c < C; c++)
        for (int64_t t = (nrows[c] * G + VW - 1) / VW - 1; t >= 0; t--)
            for (int64_t h = 0; h < Hkv; h++, i++) {
                item[3 * i] = c;
                item[3 * i + 1] = h;
                item[3 * i + 2] = t;
            }
    const pargs_t a = {k_cache, v_cache, Hkv, bs, scale};
    const int64_t qes = qt == ELEM_BF16 ? 2 : 4;
    const int64_t vbuf_floats = kt != ELEM_F32 && max_len * D <= PF_VBUF_MAX_FLOATS ? max_len * D : 0;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *buf = malloc(sizeof(float) * (max_len * VW + 2 * D * VW + PF_TOKENS * PF_MAX_D + vbuf_floats));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            if (!buf) continue;
            const int64_t c = item[3 * i], kvh = item[3 * i + 1], lane0 = item[3 * i + 2] * VW;
            const int64_t n = nrows[c], L = seq_lens[c];
            const int tree_c = tree && tree[row0[c]] != 0; /* a causal chunk's rows carry 0 */
            float *sc = buf, *qT = sc + max_len * VW, *of = qT + D * VW, *kbuf = of + D * VW;
            float *vbuf = vbuf_floats ? kbuf + PF_TOKENS * PF_MAX_D : NULL;
            int64_t lens[VW], len_max = 0;
            uint64_t lane_tree[VW];
            for (int l = 0; l < VW; l++) {
                const int64_t idx = lane0 + l, r = idx / G, g = idx % G;
                lens[l] = idx < n * G ? L - n + r + 1 : 0;
                lane_tree[l] = tree_c && lens[l] ? tree[row0[c] + r] : 0;
                if (lens[l] > len_max) len_max = lens[l];
                if (!lens[l]) {
                    for (int64_t d = 0; d < D; d++) qT[d * VW + l] = 0.0f;
                    continue;
                }
                const char *qp = (const char *)q + ((row0[c] + r) * q_row_stride + (kvh * G + g) * D) * qes;
                for (int64_t d = 0; d < D; d++)
                    qT[d * VW + l] = qt == ELEM_BF16 ? bf16_to_f32(((const uint16_t *)qp)[d]) : ((const float *)qp)[d];
            }
            tile_any(&a, qT, lens, block_tables + c * table_stride, len_max, kvh, tree_c ? lane_tree : NULL, L - n, sc,
                     kbuf, vbuf, of, kt, D);
            for (int l = 0; l < VW && lens[l]; l++) {
                const int64_t idx = lane0 + l, r = idx / G, g = idx % G;
                char *op = (char *)out + ((row0[c] + r) * out_row_stride + (kvh * G + g) * D) * qes;
                if (qt == ELEM_BF16)
                    for (int64_t d = 0; d < D; d++) ((uint16_t *)op)[d] = f32_to_bf16(of[l * D + d]);
                else
                    for (int64_t d = 0; d < D; d++) ((float *)op)[d] = of[l * D + d];
            }
        }
        free(buf);
    }
    free(item);
    return failed ? -1 : 0;
}

int kvl_paged_prefill(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache, int kt,
                      const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,
                      const int64_t *row0, const int64_t *nrows, int64_t C, void *out, int64_t out_row_stride,
                      int qt, int64_t H, int64_t Hkv, int64_t D, int64_t bs, float scale, int num_threads) {
    return kvl_paged_prefill_tree(q, q_row_stride, k_cache, v_cache, kt, block_tables, table_stride, seq_lens, row0,
                                  nrows, C, out, out_row_stride, qt, H, Hkv, D, bs, scale, num_threads, NULL);
}
