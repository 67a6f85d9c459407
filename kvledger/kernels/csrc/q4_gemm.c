/* W4A8 / W8A8 group products: 4-bit or 8-bit group-wise weights (groups of 32 along K, an fp16
 * scale per group and row; 4 bits may have a uint8 zero point) times activations quantised to int8
 * in the same groups of 32 (llama.cpp's Q4_0 x Q8_0 and Q8_0 x Q8_0 arithmetic). Integer dot
 * products per group, float sums across groups.
 *
 * Why: a decode step streams every weight once. Widening nibbles to floats costs three vector
 * operations per 16 weights and made the float-activation kernel (group_gemm.c) compute-bound,
 * slower than bf16 streaming; here 128 weights cost an and, a shift, an and and two u8 x s8
 * dot-product instructions (vpdpbusd on avx512_vnni; vpmaddubsw + vpmaddwd elsewhere).
 *
 * Weight layout (model/quant_q4.py ``pack``, at load): tiles of 16 output rows (rows padded with
 * zero-scale rows); for each group of 32 columns, 4 vectors of 64 bytes: in vector v, row r's
 * 32-bit lane holds columns 4v..4v+3 of the group in its low nibbles and 16+4v..16+4v+3 in its
 * high nibbles (values 0..15, the weight being (nibble - zero) x scale). 8 bits: 8 vectors of 64
 * bytes, vector v holding columns 4v..4v+3 as code + 128 (the zero is 128). Scales: fp16, 16 per
 * tile and group; zeros: uint8, 16 per tile and group, or none (every zero 8). GGUF Q4_K's groups
 * (``mins``): float32 scales and mins, 16 of each per tile and group, the weight nibble x scale -
 * min (llama.cpp's d x sc and dmin x m, exact in float32), and then per group
 *   acc = acc + ((float)d * (scale[n][g] * xs[m][g]) - min[n][g] * ((float)xsum[m][g] * xs[m][g])).
 *
 * Arithmetic per (row m, output n), in this order, no contraction (-std=c11): for each group g,
 *   d = sum_j nibble[n][g*32+j] * xq[m][g*32+j] - zero[n][g] * xsum[m][g]   (int32, exact)
 *   acc = acc + (float)d * (scale[n][g] * xs[m][g])
 * then y = acc (+ bias[n]), rounded to the output dtype. Integer sums are exact and the float
 * operations are lane-wise, so every build gives the same bits as the torch reference
 * (model/quant_q4.py ``reference_gemm``) and one row never depends on another.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd.h"

#define TR 16 /* output rows per tile */
#define G 32  /* columns per group */

/* Activations in groups of 32: s = max|x| / 127 (1 for a group of zeros), q = x / s rounded half
 * to even and clamped to [-127, 127], and the group's code sum. */
int kvl_q4_quantize_act(const void *x, int bf16, int8_t *q, float *s, int32_t *sums, int64_t M, int64_t K,
                        int num_threads) {
    if (M < 1 || K < G || K % G != 0 || num_threads < 1) return -1;
    const int64_t groups = K / G;
#pragma omp parallel for num_threads(num_threads) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            float v[G], amax = 0.0f;
            for (int j = 0; j < G; j++) {
                const int64_t i = m * K + g * G + j;
                v[j] = bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
                const float a = fabsf(v[j]);
                amax = a > amax ? a : amax;
            }
            float sc = amax / 127.0f;
            if (sc == 0.0f) sc = 1.0f;
            int32_t total = 0;
            for (int j = 0; j < G; j++) {
                float r = nearbyintf(v[j] / sc);
                r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
                q[m * K + g * G + j] = (int8_t)r;
                total += (int32_t)r;
            }
            s[m * groups + g] = sc;
            sums[m * groups + g] = total;
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
static inline vq q_dot(vq acc, vq w, vq x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
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
static inline vq q_add(vq a, vq b) { return _mm256_add_epi32(a, b); }
static inline vf q_tofloat(vq d) { return _mm256_cvtepi32_ps(d); }
#endif

#if defined(KVL_AVX512VNNI)
#define SIGNED8 0 /* vpdpbusd takes the stored u8 codes; 128 x the code sum is taken off */
#else
#define SIGNED8 1
#endif

/* acc[m][h] for rows m0..m0+MM-1 of the tile at wt: every group, in order. */
static inline __attribute__((always_inline)) void tile_rows(const int8_t *xq, const float *xs, const int32_t *xsum,
                                                             int64_t K, const uint8_t *wt, const void *ws,
                                                             const uint8_t *wz, const float *wm, const int BITS,
                                                             const int MM, vf acc[4][NH]) {
    const int64_t groups = K / G;
    for (int m = 0; m < MM; m++)
        for (int h = 0; h < NH; h++) acc[m][h] = vzero();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *wg = wt + g * (TR * G * BITS / 8);
        for (int h = 0; h < NH; h++) {
            /* Two integer accumulators a row (summed at the group's end, exactly): each dot
             * product waits on the one before it in its chain, so one chain would leave the
             * decode (one-row) loop bound by vpdpbusd's latency, not by the weights' traffic. */
            vq d[4], e[4];
            for (int m = 0; m < MM; m++) d[m] = e[m] = q_zero();
            if (BITS == 4) {
                for (int v = 0; v < 4; v++) {
                    const vq w = q_load(wg + 64 * v, h), lo = q_lo(w), hi = q_hi(w);
                    for (int m = 0; m < MM; m++) {
                        const int8_t *xg = xq + m * K + g * G + 4 * v;
                        d[m] = q_dot(d[m], lo, q_bcast(xg));
                        e[m] = q_dot(e[m], hi, q_bcast(xg + 16));
                    }
                }
            } else { /* 8 vectors of 16 rows x 4 columns, codes + 128 */
                for (int v = 0; v < 8; v += 2) {
                    const vq w0 = q_load(wg + 64 * v, h), w1 = q_load(wg + 64 * (v + 1), h);
                    for (int m = 0; m < MM; m++) {
                        const int8_t *xg = xq + m * K + g * G + 4 * v;
                        d[m] = SIGNED8 ? q_dot_signed(d[m], w0, q_bcast(xg)) : q_dot(d[m], w0, q_bcast(xg));
                        e[m] = SIGNED8 ? q_dot_signed(e[m], w1, q_bcast(xg + 4)) : q_dot(e[m], w1, q_bcast(xg + 4));
                    }
                }
            }
            for (int m = 0; m < MM; m++) d[m] = q_add(d[m], e[m]);
            if (BITS == 4 && wm) { /* Q4_K: w = nibble x scale - min, float32 scales and mins */
                const vf sw = vload((const float *)ws + g * TR + h * VW), mn = vload(wm + g * TR + h * VW);
                for (int m = 0; m < MM; m++) {
                    const vf sx = vset1(xs[m * groups + g]);
                    const vf t1 = vmul(q_tofloat(d[m]), vmul(sw, sx));
                    const vf t2 = vmul(mn, vmul(vset1((float)xsum[m * groups + g]), sx));
                    acc[m][h] = vadd(acc[m][h], vsub(t1, t2));
                }
                continue;
            }
            const vf sw = vload_f16((const uint16_t *)ws + g * TR + h * VW);
            if (BITS == 8) {
                if (!SIGNED8)
                    for (int m = 0; m < MM; m++) d[m] = q_sub(d[m], 128 * xsum[m * groups + g]);
            } else if (wz) {
                const vq z = q_zeros(wz + g * TR, h);
                for (int m = 0; m < MM; m++) d[m] = q_sub_mul(d[m], z, xsum[m * groups + g]);
            } else { /* every zero 8: one broadcast subtraction */
                for (int m = 0; m < MM; m++) d[m] = q_sub(d[m], 8 * xsum[m * groups + g]);
            }
            for (int m = 0; m < MM; m++)
                acc[m][h] = vadd(acc[m][h], vmul(q_tofloat(d[m]), vmul(sw, vset1(xs[m * groups + g]))));
        }
    }
}

int kvl_q4_gemm(const int8_t *xq, const float *xs, const int32_t *xsum, const uint8_t *wq, int bits,
                const void *ws, const uint8_t *wz, const float *wm, const void *bias, int bf16, void *y, int64_t M,
                int64_t N, int64_t K, int num_threads) {
    if (M < 1 || N < 1 || K < G || K % G != 0 || num_threads < 1 || (bits != 4 && bits != 8)) return -1;
    if (wm && (bits != 4 || wz)) return -1;
    const int64_t tiles = (N + TR - 1) / TR, groups = K / G;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *wt = wq + t * groups * (TR * G * bits / 8);
        const void *st = wm ? (const void *)((const float *)ws + t * groups * TR)
                            : (const void *)((const uint16_t *)ws + t * groups * TR);
        const uint8_t *zt = wz ? wz + t * groups * TR : NULL;
        const float *mt = wm ? wm + t * groups * TR : NULL;
        const int nn = N - t * TR < TR ? (int)(N - t * TR) : TR;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int mm = M - m0 < 4 ? (int)(M - m0) : 4;
            vf acc[4][NH];
            const int8_t *xb = xq + m0 * K;
            const float *sb = xs + m0 * groups;
            const int32_t *ub = xsum + m0 * groups;
            /* constant arguments: the accumulators stay in registers, one loop each */
            if (bits == 4 && mm == 4)
                tile_rows(xb, sb, ub, K, wt, st, zt, mt, 4, 4, acc);
            else if (bits == 4 && mm == 1)
                tile_rows(xb, sb, ub, K, wt, st, zt, mt, 4, 1, acc);
            else if (bits == 4)
                tile_rows(xb, sb, ub, K, wt, st, zt, mt, 4, mm, acc);
            else if (mm == 4)
                tile_rows(xb, sb, ub, K, wt, st, NULL, NULL, 8, 4, acc);
            else if (mm == 1)
                tile_rows(xb, sb, ub, K, wt, st, NULL, NULL, 8, 1, acc);
            else
                tile_rows(xb, sb, ub, K, wt, st, NULL, NULL, 8, mm, acc);
            for (int i = 0; i < mm; i++) {
                float out[TR];
                for (int h = 0; h < NH; h++) vstore(out + h * VW, acc[i][h]);
                for (int j = 0; j < nn; j++) {
                    const int64_t n = t * TR + j;
                    float v = out[j];
                    if (bias) v = v + (bf16 ? bf16_to_f32(((const uint16_t *)bias)[n]) : ((const float *)bias)[n]);
                    if (bf16)
                        ((uint16_t *)y)[(m0 + i) * N + n] = f32_to_bf16(v);
                    else
                        ((float *)y)[(m0 + i) * N + n] = v;
                }
            }
        }
    }
    return 0;
}

/* The [N, K] weight the tiles stand for: (code - zero) x scale, rounded to bf16 when asked. */
int kvl_q4_dequantize(const uint8_t *wq, int bits, const void *ws, const uint8_t *wz, const float *wm, void *out,
                      int bf16, int64_t N, int64_t K, int num_threads) {
    if (N < 1 || K < G || K % G != 0 || num_threads < 1 || (bits != 4 && bits != 8)) return -1;
    const int64_t groups = K / G;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int64_t t = n / TR, r = n % TR;
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *wg = wq + (t * groups + g) * (TR * G * bits / 8);
            const int64_t at = (t * groups + g) * TR + r;
            const float s = wm ? ((const float *)ws)[at] : _cvtsh_ss(((const uint16_t *)ws)[at]);
            const int z = bits == 8 ? 128 : (wz ? wz[(t * groups + g) * TR + r] : 8);
            for (int j = 0; j < G; j++) {
                int code;
                if (bits == 8) {
                    code = wg[64 * (j / 4) + 4 * r + j % 4];
                } else {
                    const uint8_t byte = wg[64 * ((j % 16) / 4) + 4 * r + j % 4];
                    code = j < 16 ? (byte & 0x0F) : (byte >> 4);
                }
                const float val = wm ? (float)code * s - wm[at] : (float)(code - z) * s;
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
