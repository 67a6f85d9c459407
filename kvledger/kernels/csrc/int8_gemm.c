/* W8A8 products: int8 weights (per output channel scales) times int8 activations (per row scales,
 * quantised at each call), int32 accumulation, scaled back to float32 or bfloat16.
 *
 * Weight layout (model/quant_int8.pack, at load): tiles of 16 output rows; within a tile, for each group of
 * 4 input columns, 16 x 4 bytes (row r's four codes in 32-bit lane r). A product then broadcasts 4
 * bytes of an activation row and accumulates one 64-byte weight vector into 16 rows' sums at once:
 * the weight streams sequentially and no horizontal reduction is needed.
 *
 * Integer sums are exact, so every build gives the same int32 per output whatever its order:
 *   - avx512 with avx512_vnni, and avx2-vnni (avx_vnni): vpdpbusd, 64 (avx_vnni: 32) u8 x s8
 *     products an instruction. It wants one unsigned operand, so activations are shifted to u8 (q + 128) and 128 * sum_k w[n][k] (``wsum``,
 *     computed at load) taken off again;
 *   - other builds: even and odd bytes widened to int16, pairs summed by vpmaddwd (exact).
 * The epilogue is y = ((float)acc * xs[m]) * ws[n] (+ bias[n]), in that order, no fused
 * multiply-add (-std=c11 turns contraction off), so it is bit-for-bit the torch reference
 * (kvledger/model/quant_int8.py) and one row's result never depends on the other rows.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "act_quant.h"
#include "kernels.h"
#include "simd.h"

int kvl_int8_vnni(void) {
#if defined(KVL_VNNI)
    return 1;
#else
    return 0;
#endif
}

/* Per-row symmetric int8: s = max|x| / 127 (1 for a row of zeros), q = x / s rounded half to
 * even, clamped to [-127, 127]: torch's round(x / s).clamp(-127, 127) on the same floats. */
int kvl_quantize_rows_i8(const void *x, int bf16, int8_t *q, float *s, int64_t M, int64_t K, int num_threads) {
    if (M < 1 || K < 1 || num_threads < 1) return -1;
#pragma omp parallel for num_threads(num_threads) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const float *xf = bf16 ? NULL : (const float *)x + m * K;
        const uint16_t *xh = bf16 ? (const uint16_t *)x + m * K : NULL;
        const void *xm = bf16 ? (const void *)xh : (const void *)xf;
        const int64_t kv = K - K % 8; /* act_quant.h's 8 lanes, then the tail */
        float amax = act_amax8(xm, bf16, kv);
        for (int64_t k = kv; k < K; k++) {
            float v = fabsf(bf16 ? bf16_to_f32(xh[k]) : xf[k]);
            amax = v > amax ? v : amax;
        }
        float sc = amax / 127.0f;
        if (sc == 0.0f) sc = 1.0f;
        s[m] = sc;
        act_codes8(xm, bf16, sc, q + m * K, kv);
        for (int64_t k = kv; k < K; k++) {
            float r = nearbyintf((bf16 ? bf16_to_f32(xh[k]) : xf[k]) / sc);
            q[m * K + k] = (int8_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
        }
    }
    return 0;
}

#define TR 16 /* output rows per tile */

/* acc[m][h] (h: half of the tile on AVX2) += x row m's 4 bytes at column group c times the
 * tile's 64 bytes there. */
static inline __attribute__((always_inline)) void tile_rows(const uint8_t *x, int64_t Kp, const int8_t *wt,
                                                             int64_t K4, const int MM, int32_t out[4][TR]) {
#if VW == 16
    __m512i a[4];
    for (int m = 0; m < MM; m++) a[m] = _mm512_setzero_si512();
#if defined(KVL_AVX512VNNI)
    /* Two accumulators a row, even and odd column groups (summed at the end, exactly): one chain
     * would leave the one-row (decode) loop bound by vpdpbusd's latency, as in q4_gemm.c. */
    __m512i b[4];
    for (int m = 0; m < MM; m++) b[m] = _mm512_setzero_si512();
    int64_t c = 0;
    for (; c + 1 < K4; c += 2) {
        const __m512i w0 = _mm512_loadu_si512((const void *)(wt + c * 64));
        const __m512i w1 = _mm512_loadu_si512((const void *)(wt + c * 64 + 64));
        for (int m = 0; m < MM; m++) {
            a[m] = _mm512_dpbusd_epi32(a[m], _mm512_set1_epi32(*(const int32_t *)(x + m * Kp + 4 * c)), w0);
            b[m] = _mm512_dpbusd_epi32(b[m], _mm512_set1_epi32(*(const int32_t *)(x + m * Kp + 4 * c + 4)), w1);
        }
    }
    for (; c < K4; c++) {
        const __m512i w = _mm512_loadu_si512((const void *)(wt + c * 64));
        for (int m = 0; m < MM; m++)
            a[m] = _mm512_dpbusd_epi32(a[m], _mm512_set1_epi32(*(const int32_t *)(x + m * Kp + 4 * c)), w);
    }
    for (int m = 0; m < MM; m++) a[m] = _mm512_add_epi32(a[m], b[m]);
#else
    for (int64_t c = 0; c < K4; c++) {
        const __m512i w = _mm512_loadu_si512((const void *)(wt + c * 64));
        const __m512i we = _mm512_srai_epi16(_mm512_slli_epi16(w, 8), 8), wo = _mm512_srai_epi16(w, 8);
        for (int m = 0; m < MM; m++) {
            const __m512i xb = _mm512_set1_epi32(*(const int32_t *)(x + m * Kp + 4 * c));
            const __m512i xe = _mm512_srai_epi16(_mm512_slli_epi16(xb, 8), 8), xo = _mm512_srai_epi16(xb, 8);
            a[m] = _mm512_add_epi32(a[m], _mm512_add_epi32(_mm512_madd_epi16(xe, we), _mm512_madd_epi16(xo, wo)));
        }
    }
#endif
    for (int m = 0; m < MM; m++) _mm512_storeu_si512((void *)out[m], a[m]);
#else
    __m256i a[4][2];
    for (int m = 0; m < MM; m++) a[m][0] = a[m][1] = _mm256_setzero_si256();
    for (int64_t c = 0; c < K4; c++) {
        for (int h = 0; h < 2; h++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(wt + c * 64 + 32 * h));
#if defined(KVL_VNNI256) /* the halves are two independent chains a row */
            for (int m = 0; m < MM; m++)
                a[m][h] = dpbusd8(a[m][h], _mm256_set1_epi32(*(const int32_t *)(x + m * Kp + 4 * c)), w);
#else
            const __m256i we = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8), wo = _mm256_srai_epi16(w, 8);
            for (int m = 0; m < MM; m++) {
                const __m256i xb = _mm256_set1_epi32(*(const int32_t *)(x + m * Kp + 4 * c));
                const __m256i xe = _mm256_srai_epi16(_mm256_slli_epi16(xb, 8), 8), xo = _mm256_srai_epi16(xb, 8);
                a[m][h] = _mm256_add_epi32(a[m][h], _mm256_add_epi32(_mm256_madd_epi16(xe, we), _mm256_madd_epi16(xo, wo)));
            }
#endif
        }
    }
    for (int m = 0; m < MM; m++) {
        _mm256_storeu_si256((__m256i *)out[m], a[m][0]);
        _mm256_storeu_si256((__m256i *)(out[m] + 8), a[m][1]);
    }
#endif
}

int kvl_int8_gemm(const int8_t *xq, const float *xs, const int8_t *wq, const float *ws, const int32_t *wsum,
                  const void *bias, int bf16, void *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || N < 1 || K < 1 || K > 65536 || num_threads < 1) return -1;
    const int64_t K4 = (K + 3) / 4, Kp = 4 * K4, tiles = (N + TR - 1) / TR;
    uint8_t *xu = malloc((size_t)(M * Kp)); /* activations, columns padded to 4 (weights are 0 there) */
    if (!xu) return -1;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < Kp; k++) {
            const int8_t v = k < K ? xq[m * K + k] : 0;
#if defined(KVL_VNNI)
            xu[m * Kp + k] = (uint8_t)(v ^ 0x80); /* q + 128 */
#else
            xu[m * Kp + k] = (uint8_t)v;
#endif
        }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int8_t *wt = wq + t * K4 * TR * 4;
        const int nn = N - t * TR < TR ? (int)(N - t * TR) : TR;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int mm = M - m0 < 4 ? (int)(M - m0) : 4;
            int32_t acc[4][TR];
            const uint8_t *xb = xu + m0 * Kp;
            if (mm == 4) /* constant row counts: the accumulators stay in registers */
                tile_rows(xb, Kp, wt, K4, 4, acc);
            else if (mm == 1)
                tile_rows(xb, Kp, wt, K4, 1, acc);
            else
                tile_rows(xb, Kp, wt, K4, mm, acc);
            for (int i = 0; i < mm; i++)
                for (int j = 0; j < nn; j++) {
                    const int64_t n = t * TR + j;
#if defined(KVL_VNNI)
                    const int32_t total = acc[i][j] - 128 * wsum[n];
#else
                    const int32_t total = acc[i][j];
#endif
                    float v = ((float)total * xs[m0 + i]) * ws[n];
                    if (bias) v = v + (bf16 ? bf16_to_f32(((const uint16_t *)bias)[n]) : ((const float *)bias)[n]);
                    if (bf16)
                        ((uint16_t *)y)[(m0 + i) * N + n] = f32_to_bf16(v);
                    else
                        ((float *)y)[(m0 + i) * N + n] = v;
                }
        }
    }
    (void)wsum;
    free(xu);
    return 0;
}
