/* W8A8 products: int8 weights (per output channel scales) times int8 activations (per row scales,
 * quantised here at each call), int32 accumulation, scaled back to float32 or bfloat16.
 *
 * Integer sums are exact, so every build gives the same int32 per output whatever its order:
 *   - avx512 with avx512_vnni: vpdpbusd, 64 u8 x s8 products a instruction. It wants one unsigned
 *     operand, so activations are shifted to u8 (q + 128) and 128 * sum_k w[n][k] (``wsum``,
 *     computed at load) taken off again;
 *   - other builds: both operands widened to int16, pairs summed by vpmaddwd (exact).
 * The epilogue is y = ((float)acc * xs[m]) * ws[n] (+ bias[n]), in that order, no fused
 * multiply-add (-std=c11 turns contraction off), so it is bit-for-bit the torch reference
 * (kvledger/model/quant_int8.py) and one row's result never depends on the other rows.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

int kvl_int8_vnni(void) {
#if defined(KVL_AVX512VNNI)
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
        float amax = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            float v = fabsf(bf16 ? bf16_to_f32(xh[k]) : xf[k]);
            amax = v > amax ? v : amax;
        }
        float sc = amax / 127.0f;
        if (sc == 0.0f) sc = 1.0f;
        s[m] = sc;
        for (int64_t k = 0; k < K; k++) {
            float r = nearbyintf((bf16 ? bf16_to_f32(xh[k]) : xf[k]) / sc);
            q[m * K + k] = (int8_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
        }
    }
    return 0;
}

/* acc[i][j] = sum_k x[i][k] * w[j][k] for MM rows of x and NN rows of w (x already shifted to u8
 * on the VNNI build). */
static inline __attribute__((always_inline)) void dot_block(const uint8_t *x, const int8_t *w, int64_t K,
                                                             const int MM, const int NN, int32_t acc[4][4]) {
#if defined(KVL_AVX512VNNI)
    __m512i a[4][4];
    for (int i = 0; i < MM; i++)
        for (int j = 0; j < NN; j++) a[i][j] = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        __m512i wv[4];
        for (int j = 0; j < NN; j++) wv[j] = _mm512_loadu_si512((const void *)(w + j * K + k));
        for (int i = 0; i < MM; i++) {
            __m512i xv = _mm512_loadu_si512((const void *)(x + i * K + k));
            for (int j = 0; j < NN; j++) a[i][j] = _mm512_dpbusd_epi32(a[i][j], xv, wv[j]);
        }
    }
    if (k < K) {
        const __mmask64 tail = (__mmask64)((~0ull) >> (64 - (K - k)));
        __m512i wv[4];
        for (int j = 0; j < NN; j++) wv[j] = _mm512_maskz_loadu_epi8(tail, w + j * K + k);
        for (int i = 0; i < MM; i++) {
            __m512i xv = _mm512_maskz_loadu_epi8(tail, x + i * K + k);
            for (int j = 0; j < NN; j++) a[i][j] = _mm512_dpbusd_epi32(a[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < MM; i++)
        for (int j = 0; j < NN; j++) acc[i][j] = _mm512_reduce_add_epi32(a[i][j]);
#else
    const int8_t *xs = (const int8_t *)x;
    vi a[4][4];
    for (int i = 0; i < MM; i++)
        for (int j = 0; j < NN; j++) a[i][j] = vi_zero();
    const int64_t K0 = K - K % IW;
    for (int64_t k = 0; k < K0; k += IW) {
        vi wv[4];
        for (int j = 0; j < NN; j++) wv[j] = vi_load_i8(w + j * K + k);
        for (int i = 0; i < MM; i++) {
            vi xv = vi_load_i8(xs + i * K + k);
            for (int j = 0; j < NN; j++) a[i][j] = vi_dot(a[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < MM; i++)
        for (int j = 0; j < NN; j++) {
            int32_t t = vi_hsum(a[i][j]);
            for (int64_t k = K0; k < K; k++) t += (int32_t)xs[i * K + k] * (int32_t)w[j * K + k];
            acc[i][j] = t;
        }
#endif
}

int kvl_int8_gemm(const int8_t *xq, const float *xs, const int8_t *wq, const float *ws, const int32_t *wsum,
                  const void *bias, int bf16, void *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || N < 1 || K < 1 || K > 65536 || num_threads < 1) return -1;
#if defined(KVL_AVX512VNNI)
    uint8_t *xu = malloc((size_t)(M * K));
    if (!xu) return -1;
    for (int64_t i = 0; i < M * K; i++) xu[i] = (uint8_t)(xq[i] ^ 0x80); /* q + 128 */
#else
    const uint8_t *xu = (const uint8_t *)xq;
#endif
    const int64_t nblocks = (N + 3) / 4;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t n0 = b * 4;
        const int nn = N - n0 < 4 ? (int)(N - n0) : 4;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int mm = M - m0 < 4 ? (int)(M - m0) : 4;
            int32_t acc[4][4];
            const uint8_t *xb = xu + m0 * K;
            const int8_t *wb = wq + n0 * K;
            if (nn == 4 && mm == 4) /* constant tile sizes: the accumulators stay in registers */
                dot_block(xb, wb, K, 4, 4, acc);
            else if (nn == 4 && mm == 1)
                dot_block(xb, wb, K, 1, 4, acc);
            else if (nn == 4 && mm == 2)
                dot_block(xb, wb, K, 2, 4, acc);
            else if (nn == 4 && mm == 3)
                dot_block(xb, wb, K, 3, 4, acc);
            else
                dot_block(xb, wb, K, mm, nn, acc);
            for (int i = 0; i < mm; i++)
                for (int j = 0; j < nn; j++) {
                    const int64_t n = n0 + j;
#if defined(KVL_AVX512VNNI)
                    const int32_t total = acc[i][j] - 128 * wsum[n];
#else
                    (void)wsum;
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
#if defined(KVL_AVX512VNNI)
    free(xu);
#endif
    return 0;
}
