/* W4A8 / W8A8 group products: 4-bit or 8-bit group-wise weights (groups of 32 along K, an fp16
 * scale per group and row; 4 bits may have a uint8 zero point) times activations quantised to int8
 * in the same groups of 32 (llama.cpp's Q4_0 x Q8_0 and Q8_0 x Q8_0 arithmetic), and GGUF's
 * K-quants Q4_K, Q5_K and Q6_K in their own scales. Integer dot products per group, float sums
 * across groups.
 *
 * Why: a decode step streams every weight once. Widening nibbles to floats costs three vector
 * operations per 16 weights and made the float-activation kernel (group_gemm.c) compute-bound,
 * slower than bf16 streaming; here 128 weights cost an and, a shift, an and and two u8 x s8
 * dot-product instructions (vpdpbusd on avx512_vnni and avx_vnni; vpmaddubsw + vpmaddwd elsewhere). The
 * K-quants keep their own bits a weight (4.6, 5.6, 6.6 with their scales; llama.cpp's 4.5, 5.5,
 * 6.6): a wider layout would stream more bytes than llama.cpp does for the same file.
 *
 * Weight layout (model/quant_q4.py, at load): tiles of 16 output rows (rows padded with zero-scale
 * rows); for each group of 32 columns, 4 vectors of 64 bytes: in vector v, row r's 32-bit lane
 * holds columns 4v..4v+3 of the group in its low nibbles and 16+4v..16+4v+3 in its high nibbles.
 * Formats (``fmt``):
 *   Q4   (0): nibbles, the weight (nibble - zero) x scale; scales ``ws`` fp16 [tile][group >> sgs][16],
 *             zeros ``wz`` uint8 [tile][group >> sgs][16] or NULL (every zero 8): one scale (and
 *             zero) per 2^sgs groups of 32, a checkpoint's own group size (GPTQ / AWQ: 64, 128).
 *   Q8   (2): 8 vectors of 64 bytes, vector v holding columns 4v..4v+3 as code + 128; fp16 scales
 *             (per 2^sgs groups, as Q4's).
 *   Q4K  (1), Q5K (3): the weight code x (d x sc) - (dmin x m), llama.cpp's values exactly (a
 *             half's 11 bits times 6 are exact in float32); sc ``ws`` and m ``wz`` uint8
 *             [tile][group][16], d and dmin ``wsup`` fp16 [tile][K/256][32] (d for the 16 rows,
 *             then dmin). Q5K: the nibbles, then one vector of fifth bits a group (byte (r, b):
 *             bit v for column 4v+b, bit 4+v for 16+4v+b).
 *   Q6K  (4): the weight (code - 32) x d x sc, sc an int8 per 16 columns: the nibbles, then two
 *             vectors of high bit pairs a group (the first for columns 0-15, bits 2v..2v+1 of
 *             byte (r, b) for column 4v+b; the second for 16-31); sc ``ws`` int8 [tile][group][32]
 *             (columns 0-15 of the 16 rows, then 16-31), d ``wsup`` fp16 [tile][K/256][16].
 *
 * Arithmetic per (row m, output n), in this order, no contraction (-std=c11): for each group g,
 *   Q4, Q8: d = sum_j code[n][g*32+j] * xq[m][g*32+j] - zero[n][g] * xsum[m][g]   (int32, exact)
 *           acc = acc + (float)d * (scale[n][g] * xs[m][g])
 *   Q4K, Q5K: acc = acc + ((float)d * (S * xs[m][g]) - M * ((float)xsum[m][g] * xs[m][g])),
 *           S = d x sc and M = dmin x m in float32;
 *   Q6K:    t = sc_lo * (lo - 32 * slo) + sc_hi * (hi - 32 * shi)   (int32, exact: the halves' dot
 *           products and the activations' half sums), acc = acc + (float)t * (d * xs[m][g]);
 * then y = acc (+ bias[n]), rounded to the output dtype, into row m of y at stride ``ldy`` (so the
 * pieces of a fused projection whose GGUF types differ, Q4_K_M's qkv, write their columns of one
 * output). Integer sums are exact and the float operations are lane-wise, so every build gives the
 * same bits as the torch reference (model/quant_q4.py ``reference_gemm``) and one row never
 * depends on another.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "act_quant.h"
#include "kernels.h"
#include "simd.h"

#define TR 16 /* output rows per tile */
#define G 32  /* columns per group */

/* Activations in groups of 32: s = max|x| / 127 (1 for a group of zeros), q = x / s rounded half
 * to even and clamped to [-127, 127], and the group's code sum (act_quant.h). */
int kvl_q4_quantize_act(const void *x, int bf16, int8_t *q, float *s, int32_t *sums, int64_t M, int64_t K,
                        int num_threads) {
    if (M < 1 || K < G || K % G != 0 || num_threads < 1) return -1;
    const int64_t groups = K / G;
#pragma omp parallel for num_threads(num_threads) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t i = m * K + g * G;
            const void *xg = bf16 ? (const void *)((const uint16_t *)x + i) : (const void *)((const float *)x + i);
            float sc = act_amax8(xg, bf16, G) / 127.0f;
            if (sc == 0.0f) sc = 1.0f;
            s[m * groups + g] = sc;
            sums[m * groups + g] = act_codes8(xg, bf16, sc, q + i, G);
        }
    return 0;
}

#if VW == 16
typedef __m512i vq; /* one 64-byte weight vector: a whole tile's 16 lanes */
#define NH 1        /* vectors per 16 rows */
static inline vq q_load(const uint8_t *p, int h) { (void)h; return _mm512_loadu_si512((const void *)p); }
static inline vq q_lo(vq w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
static inline vq q_hi(vq w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F)); }
static inline vq q_bcast(const int8_t *x) { return _mm512_set1_epi32(*(const int32_t *)x); }
static inline vq q_zero(void) { return _mm512_setzero_si512(); }
#if defined(KVL_AVX512VNNI)
static inline vq q_dot(vq acc, vq w, vq x) { return _mm512_dpbusd_epi32(acc, w, x); }
#else
static inline vq q_dot(vq acc, vq w, vq x) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
}
#endif
/* 8-bit codes stored + 128 (u8) times s8 activations without vpdpbusd: vpmaddubsw's int16 pairs
 * would saturate (255 x 127 x 2), so the signed code's magnitude multiplies the activation with
 * the code's sign (|code| <= 128, 128 x 127 x 2 fits): the sum is of code x x, no zero taken off. */
static inline vq q_dot_signed(vq acc, vq w, vq x) {
    const vq c = _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
    const vq sx = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(c), _mm512_setzero_si512(), x);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(c), sx), _mm512_set1_epi16(1)));
}
static inline vq q_zeros(const uint8_t *z, int h) {
    (void)h;
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)z));
}
static inline vq q_sub_mul(vq d, vq z, int32_t s) { return _mm512_sub_epi32(d, _mm512_mullo_epi32(z, _mm512_set1_epi32(s))); }
static inline vq q_sub(vq d, int32_t s) { return _mm512_sub_epi32(d, _mm512_set1_epi32(s)); }
static inline vq q_mul(vq a, vq b) { return _mm512_mullo_epi32(a, b); }
/* the bits of mask m of each byte after shifting the 16-bit lanes left by s (right for s < 0):
 * the K-quants' high bits moved under the nibble (a shift of at most 4 each way leaves bits 4-5 of
 * every byte its own) */
static inline vq q_bits(vq w, int s, int m) {
    const vq t = s >= 0 ? _mm512_slli_epi16(w, (unsigned)s) : _mm512_srli_epi16(w, (unsigned)-s);
    return _mm512_and_si512(t, _mm512_set1_epi8((char)m));
}
static inline vq q_or(vq a, vq b) { return _mm512_or_si512(a, b); }
static inline vf q_u8_float(const uint8_t *p, int h) {
    (void)h;
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vq q_scales8(const uint8_t *p, int h) { /* 16 int8 sub-scales as int32 lanes */
    (void)h;
    return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
}
static inline vq q_add(vq a, vq b) { return _mm512_add_epi32(a, b); }
static inline vf q_tofloat(vq d) { return _mm512_cvtepi32_ps(d); }
static inline void q_store(int32_t *p, vq v) { _mm512_storeu_si512((void *)p, v); }
#else
typedef __m256i vq; /* half a tile: 8 lanes */
#define NH 2
static inline vq q_load(const uint8_t *p, int h) { return _mm256_loadu_si256((const __m256i *)(p + 32 * h)); }
static inline vq q_lo(vq w) { return _mm256_and_si256(w, _mm256_set1_epi8(0x0F)); }
static inline vq q_hi(vq w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(0x0F)); }
static inline vq q_bcast(const int8_t *x) { return _mm256_set1_epi32(*(const int32_t *)x); }
static inline vq q_zero(void) { return _mm256_setzero_si256(); }
#if defined(KVL_VNNI256)
static inline vq q_dot(vq acc, vq w, vq x) { return dpbusd8(acc, w, x); }
#else
static inline vq q_dot(vq acc, vq w, vq x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
#endif
static inline vq q_dot_signed(vq acc, vq w, vq x) { /* as the AVX-512 one, with vpsignb */
    const vq c = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(x, c)),
                                                   _mm256_set1_epi16(1)));
}
static inline vq q_zeros(const uint8_t *z, int h) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(z + 8 * h)));
}
static inline vq q_sub_mul(vq d, vq z, int32_t s) { return _mm256_sub_epi32(d, _mm256_mullo_epi32(z, _mm256_set1_epi32(s))); }
static inline vq q_sub(vq d, int32_t s) { return _mm256_sub_epi32(d, _mm256_set1_epi32(s)); }
static inline vq q_mul(vq a, vq b) { return _mm256_mullo_epi32(a, b); }
static inline vq q_bits(vq w, int s, int m) {
    const vq t = s >= 0 ? _mm256_slli_epi16(w, s) : _mm256_srli_epi16(w, -s);
    return _mm256_and_si256(t, _mm256_set1_epi8((char)m));
}
static inline vq q_or(vq a, vq b) { return _mm256_or_si256(a, b); }
static inline vf q_u8_float(const uint8_t *p, int h) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h))));
}
static inline vq q_scales8(const uint8_t *p, int h) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h)));
}
static inline vq q_add(vq a, vq b) { return _mm256_add_epi32(a, b); }
static inline vf q_tofloat(vq d) { return _mm256_cvtepi32_ps(d); }
#endif

#if defined(KVL_VNNI)
#define SIGNED8 0 /* vpdpbusd takes the stored u8 codes; 128 x the code sum is taken off */
#else
#define SIGNED8 1
#endif

enum { Q4 = 0, Q4K, Q8, Q5K, Q6K }; /* the formats (``fmt``) */

/* bytes of codes a group of 16 rows */
static inline int64_t group_bytes(int fmt) { return fmt == Q8 ? 512 : fmt == Q5K ? 320 : fmt == Q6K ? 384 : 256; }

/* acc[m][h] for rows m0..m0+MM-1 of the tile at wt: every group, in order. hs: Q6K's activation
 * half sums [M][groups][2]. */
static inline __attribute__((always_inline)) void tile_rows(const int8_t *xq, const float *xs, const int32_t *xsum,
                                                             const int32_t *hs, int64_t K, const uint8_t *wt,
                                                             const void *ws, const uint8_t *wz, const uint16_t *wsup,
                                                             const int sgs, const int FMT, const int MM,
                                                             vf acc[4][NH]) {
    const int64_t groups = K / G, GB = group_bytes(FMT);
    for (int m = 0; m < MM; m++)
        for (int h = 0; h < NH; h++) acc[m][h] = vzero();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *wg = wt + g * GB;
        for (int h = 0; h < NH; h++) {
            /* Two integer accumulators a row (summed at the group's end, exactly): each dot
             * product waits on the one before it in its chain, so one chain would leave the
             * decode (one-row) loop bound by vpdpbusd's latency, not by the weights' traffic.
             * Q6K: d holds columns 0-15, e 16-31 (their scales differ). */
            vq d[4], e[4];
            for (int m = 0; m < MM; m++) d[m] = e[m] = q_zero();
            if (FMT == Q8) { /* 8 vectors of 16 rows x 4 columns, codes + 128 */
                for (int v = 0; v < 8; v += 2) {
                    const vq w0 = q_load(wg + 64 * v, h), w1 = q_load(wg + 64 * (v + 1), h);
                    for (int m = 0; m < MM; m++) {
                        const int8_t *xg = xq + m * K + g * G + 4 * v;
                        d[m] = SIGNED8 ? q_dot_signed(d[m], w0, q_bcast(xg)) : q_dot(d[m], w0, q_bcast(xg));
                        e[m] = SIGNED8 ? q_dot_signed(e[m], w1, q_bcast(xg + 4)) : q_dot(e[m], w1, q_bcast(xg + 4));
                    }
                }
            } else {
                vq hb0 = q_zero(), hb1 = q_zero();
                if (FMT == Q5K) hb0 = q_load(wg + 256, h);
                if (FMT == Q6K) hb0 = q_load(wg + 256, h), hb1 = q_load(wg + 320, h);
                for (int v = 0; v < 4; v++) {
                    const vq w = q_load(wg + 64 * v, h);
                    vq lo = q_lo(w), hi = q_hi(w);
                    if (FMT == Q5K) { /* codes <= 31, <= 63: no int16 pair saturates without VNNI */
                        lo = q_or(lo, q_bits(hb0, 4 - v, 0x10));
                        hi = q_or(hi, q_bits(hb0, -v, 0x10));
                    } else if (FMT == Q6K) {
                        lo = q_or(lo, q_bits(hb0, 4 - 2 * v, 0x30));
                        hi = q_or(hi, q_bits(hb1, 4 - 2 * v, 0x30));
                    }
                    for (int m = 0; m < MM; m++) {
                        const int8_t *xg = xq + m * K + g * G + 4 * v;
                        d[m] = q_dot(d[m], lo, q_bcast(xg));
                        e[m] = q_dot(e[m], hi, q_bcast(xg + 16));
                    }
                }
            }
            if (FMT == Q6K) {
                const vq slo = q_scales8((const uint8_t *)ws + g * 2 * TR, h);
                const vq shi = q_scales8((const uint8_t *)ws + g * 2 * TR + TR, h);
                const vf sw = vload_f16(wsup + (g / 8) * TR + h * VW);
                for (int m = 0; m < MM; m++) {
                    const int32_t *hm = hs + (m * groups + g) * 2;
                    const vq t = q_add(q_mul(q_sub(d[m], 32 * hm[0]), slo), q_mul(q_sub(e[m], 32 * hm[1]), shi));
                    acc[m][h] = vadd(acc[m][h], vmul(q_tofloat(t), vmul(sw, vset1(xs[m * groups + g]))));
                }
                continue;
            }
            for (int m = 0; m < MM; m++) d[m] = q_add(d[m], e[m]);
            if (FMT == Q4K || FMT == Q5K) { /* w = code x (d x sc) - (dmin x m) */
                const uint16_t *sup = wsup + (g / 8) * 2 * TR + h * VW;
                const vf sw = vmul(vload_f16(sup), q_u8_float((const uint8_t *)ws + g * TR, h));
                const vf mn = vmul(vload_f16(sup + TR), q_u8_float(wz + g * TR, h));
                for (int m = 0; m < MM; m++) {
                    const vf sx = vset1(xs[m * groups + g]);
                    const vf t1 = vmul(q_tofloat(d[m]), vmul(sw, sx));
                    const vf t2 = vmul(mn, vmul(vset1((float)xsum[m * groups + g]), sx));
                    acc[m][h] = vadd(acc[m][h], vsub(t1, t2));
                }
                continue;
            }
            /* Q4, Q8: the scale (and zero) of this group's run of 2^sgs. A scale a group streamed
             * beside the codes cost more than its bytes: bench-230m's 4-bit products with the
             * scale a group at 0.77-0.81x the time with one per 4 groups (8 % fewer bytes; see
             * docs/measurements/quantised_weights.md, "A scale per checkpoint group"). */
            const int64_t gs = g >> sgs;
            const vf sw = vload_f16((const uint16_t *)ws + gs * TR + h * VW);
            if (FMT == Q8) {
                if (!SIGNED8)
                    for (int m = 0; m < MM; m++) d[m] = q_sub(d[m], 128 * xsum[m * groups + g]);
            } else if (wz) {
                const vq z = q_zeros(wz + gs * TR, h);
                for (int m = 0; m < MM; m++) d[m] = q_sub_mul(d[m], z, xsum[m * groups + g]);
            } else { /* every zero 8: one broadcast subtraction */
                for (int m = 0; m < MM; m++) d[m] = q_sub(d[m], 8 * xsum[m * groups + g]);
            }
            for (int m = 0; m < MM; m++)
                acc[m][h] = vadd(acc[m][h], vmul(q_tofloat(d[m]), vmul(sw, vset1(xs[m * groups + g]))));
        }
    }
}

/* constant format and row count: the accumulators stay in registers, one loop each */
#define TILE_ROWS_MM(FMT)                                                                         \
    do {                                                                                          \
        if (mm == 4)                                                                              \
            tile_rows(xb, sb, ub, hb, K, wt, st, zt, pt, sgs, FMT, 4, acc);                       \
        else if (mm == 1)                                                                         \
            tile_rows(xb, sb, ub, hb, K, wt, st, zt, pt, sgs, FMT, 1, acc);                       \
        else                                                                                      \
            tile_rows(xb, sb, ub, hb, K, wt, st, zt, pt, sgs, FMT, mm, acc);                      \
    } while (0)

/* The arguments a format needs are there (and K whole K-quant blocks, and whole runs of 2^sgs
 * groups, which only Q4 and Q8 have). */
static int valid_format(int fmt, int sgs, const uint8_t *wz, const uint16_t *wsup, int64_t K) {
    if (sgs < 0 || sgs > 8 || (K / G) % (1 << sgs) != 0 || (sgs && fmt != Q4 && fmt != Q8)) return 0;
    if (fmt == Q4) return wsup == NULL;
    if (fmt == Q8) return wz == NULL && wsup == NULL;
    if (fmt == Q4K || fmt == Q5K) return wz && wsup && K % 256 == 0;
    if (fmt == Q6K) return wz == NULL && wsup && K % 256 == 0;
    return 0;
}

/* bytes of ``ws`` and ``wz`` a group of 16 rows (element size times count) */
static inline int64_t scale_bytes(int fmt) { return fmt == Q6K ? 2 * TR : fmt == Q4K || fmt == Q5K ? TR : 2 * TR; }

int kvl_q4_gemm(const int8_t *xq, const float *xs, const int32_t *xsum, const uint8_t *wq, int fmt, int sgs,
                const void *ws, const uint8_t *wz, const uint16_t *wsup, const void *bias, int bf16, void *y,
                int64_t ldy, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || N < 1 || K < G || K % G != 0 || num_threads < 1 || ldy < N || !valid_format(fmt, sgs, wz, wsup, K))
        return -1;
    const int64_t tiles = (N + TR - 1) / TR, groups = K / G, gb = group_bytes(fmt), sbytes = scale_bytes(fmt);
    const int64_t sgroups = groups >> sgs; /* scales (and zeros) a tile's row */
    const int64_t pb = fmt == Q6K ? TR : 2 * TR; /* wsup's fp16 values a tile and 256 columns */
    int32_t *hs = NULL; /* Q6K: the activations' sums per 16 columns */
    if (fmt == Q6K) {
        hs = malloc(sizeof(int32_t) * (size_t)(M * groups * 2));
        if (!hs) return -1;
        for (int64_t i = 0; i < M * groups * 2; i++) {
            int32_t t = 0;
            for (int j = 0; j < 16; j++) t += xq[i * 16 + j];
            hs[i] = t;
        }
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *wt = wq + t * groups * gb;
        const void *st = (const uint8_t *)ws + t * sgroups * sbytes;
        const uint8_t *zt = wz ? wz + t * sgroups * TR : NULL;
        const uint16_t *pt = wsup ? wsup + t * (K / 256) * pb : NULL;
        const int nn = N - t * TR < TR ? (int)(N - t * TR) : TR;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int mm = M - m0 < 4 ? (int)(M - m0) : 4;
            vf acc[4][NH];
            const int8_t *xb = xq + m0 * K;
            const float *sb = xs + m0 * groups;
            const int32_t *ub = xsum + m0 * groups, *hb = hs ? hs + m0 * groups * 2 : NULL;
            switch (fmt) {
            case Q4: TILE_ROWS_MM(Q4); break;
            case Q4K: TILE_ROWS_MM(Q4K); break;
            case Q8: TILE_ROWS_MM(Q8); break;
            case Q5K: TILE_ROWS_MM(Q5K); break;
            default: TILE_ROWS_MM(Q6K); break;
            }
            for (int i = 0; i < mm; i++) {
                float out[TR];
                for (int h = 0; h < NH; h++) vstore(out + h * VW, acc[i][h]);
                for (int j = 0; j < nn; j++) {
                    const int64_t n = t * TR + j;
                    float v = out[j];
                    if (bias) v = v + (bf16 ? bf16_to_f32(((const uint16_t *)bias)[n]) : ((const float *)bias)[n]);
                    if (bf16)
                        ((uint16_t *)y)[(m0 + i) * ldy + n] = f32_to_bf16(v);
                    else
                        ((float *)y)[(m0 + i) * ldy + n] = v;
                }
            }
        }
    }
    free(hs);
    return 0;
}

/* The code of column j (0..31) of row r in a group's bytes wg. */
static inline int code_at(const uint8_t *wg, int fmt, int64_t r, int j) {
    if (fmt == Q8) return wg[64 * (j / 4) + 4 * r + j % 4];
    const int v = (j % 16) / 4, b = 4 * (int)r + j % 4, high = j >= 16;
    int code = high ? wg[64 * v + b] >> 4 : wg[64 * v + b] & 0x0F;
    if (fmt == Q5K) code |= ((wg[256 + b] >> (high ? 4 + v : v)) & 1) << 4;
    if (fmt == Q6K) code |= ((wg[256 + 64 * high + b] >> (2 * v)) & 3) << 4;
    return code;
}

/* The [N, K] weight the tiles stand for, rounded to bf16 when asked (the formulas above). */
int kvl_q4_dequantize(const uint8_t *wq, int fmt, int sgs, const void *ws, const uint8_t *wz, const uint16_t *wsup,
                      void *out, int bf16, int64_t N, int64_t K, int num_threads) {
    if (N < 1 || K < G || K % G != 0 || num_threads < 1 || !valid_format(fmt, sgs, wz, wsup, K)) return -1;
    const int64_t groups = K / G, gb = group_bytes(fmt), pb = fmt == Q6K ? TR : 2 * TR;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int64_t t = n / TR, r = n % TR;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *wg = wq + (t * groups + g) * gb;
            const int64_t at = (t * groups + g) * TR + r; /* the K-quants' sc and m */
            const int64_t as = (t * (groups >> sgs) + (g >> sgs)) * TR + r; /* Q4's, Q8's scale and zero */
            const uint16_t *sup = wsup ? wsup + (t * (K / 256) + g / 8) * pb + r : NULL;
            for (int j = 0; j < G; j++) {
                const int code = code_at(wg, fmt, r, j);
                float val;
                if (fmt == Q4K || fmt == Q5K)
                    val = (float)code * (_cvtsh_ss(sup[0]) * (float)((const uint8_t *)ws)[at]) -
                          _cvtsh_ss(sup[TR]) * (float)wz[at];
                else if (fmt == Q6K)
                    val = (float)(code - 32) *
                          (_cvtsh_ss(sup[0]) * (float)((const int8_t *)ws)[(t * groups + g) * 2 * TR + (j / 16) * TR + r]);
                else
                    val = (float)(code - (fmt == Q8 ? 128 : wz ? wz[as] : 8)) * _cvtsh_ss(((const uint16_t *)ws)[as]);
                const int64_t i = n * K + g * G + j;
                if (bf16)
                    ((uint16_t *)out)[i] = f32_to_bf16(val);
                else
                    ((float *)out)[i] = val;
            }
        }
    }
    return 0;
}
