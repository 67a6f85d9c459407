/* Group-wise weights, 32 weights sharing one float32 scale, times float32 / bfloat16 activations:
 *   - 4 bits: codes -8..7 stored as nibbles 0..15 with 8 added, two a byte: byte j of a group
 *     holds its weights j (low nibble) and j + 16 (high), llama.cpp's Q4_0 order;
 *   - 8 bits: int8 codes, 32 bytes a group (llama.cpp's Q8_0 values).
 * 4-bit groups may carry their own zero point (``zeros``, uint8 per group: GPTQ / AWQ's
 * asymmetric codes, w = (nibble - zero) x scale); without them every zero is 8.
 *
 * Decode steps stream every weight once, so 4 bits a weight is a quarter of bf16's traffic: the
 * nibbles are unpacked in registers, scaled, and multiplied with float accumulation; nothing is
 * written back. Products of many rows (prefill) are compute-bound instead: the weight is
 * dequantised once per product (kvl_int4_dequantize) and the float GEMM runs on it.
 * Each build sums in its own fixed order (VW lanes, then a fixed lane tree), so an output row
 * depends only on its own input row.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define G 32 /* weights per group */

/* 16 int8 lanes (values -8..7) as floats times s, in 16 / VW vectors. */
static inline void widen16(__m128i q, float s, vf out[16 / VW]) {
#if VW == 16
    out[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(s));
#else
    out[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_set1_ps(s));
    out[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), _mm256_set1_ps(s));
#endif
}

/* One group's 32 weights, scaled, as 32 / VW float vectors in element order. */
static inline void group_weights(const uint8_t *b, const int bits, float s, int zero, vf w[G / VW]) {
    if (bits == 8) {
        widen16(_mm_loadu_si128((const __m128i *)b), s, w);
        widen16(_mm_loadu_si128((const __m128i *)(b + 16)), s, w + 16 / VW);
        return;
    }
    const __m128i bytes = _mm_loadu_si128((const __m128i *)b);
    const __m128i mask = _mm_set1_epi8(0x0F), z = _mm_set1_epi8((char)zero);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(bytes, mask), z); /* -15..15: exact in int8 */
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), z);
    widen16(lo, s, w);
    widen16(hi, s, w + 16 / VW);
}

static inline __attribute__((always_inline)) void row_tile(const float *x, const uint8_t *qw, const float *sc,
                                                            const uint8_t *zr, int64_t K, const int bits,
                                                            const int MM, float out[4]) {
    vf acc[4];
    for (int m = 0; m < MM; m++) acc[m] = vzero();
    const int64_t groups = K / G;
    for (int64_t g = 0; g < groups; g++) {
        vf w[G / VW];
        group_weights(qw + g * (G * bits / 8), bits, sc[g], zr ? zr[g] : 8, w);
        for (int m = 0; m < MM; m++)
            for (int v = 0; v < G / VW; v++) acc[m] = vfmadd(vload(x + m * K + g * G + v * VW), w[v], acc[m]);
    }
    for (int m = 0; m < MM; m++) out[m] = vhsum(acc[m]);
}

int kvl_group_gemm(const void *x, int bf16, const uint8_t *qw, int bits, const float *scales, const uint8_t *zeros,
                   const void *bias, void *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || N < 1 || K < G || K % G != 0 || num_threads < 1 || (bits != 4 && bits != 8)) return -1;
    const float *xf = (const float *)x;
    float *xs = NULL;
    if (bf16) { /* activations widened once per call */
        xs = malloc(sizeof(float) * M * K);
        if (!xs) return -1;
        for (int64_t i = 0; i < M * K; i++) xs[i] = bf16_to_f32(((const uint16_t *)x)[i]);
        xf = xs;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wr = qw + n * (K * bits / 8);
        const float *sr = scales + n * (K / G);
        const uint8_t *zr = zeros ? zeros + n * (K / G) : NULL;
        const float b = bias ? (bf16 ? bf16_to_f32(((const uint16_t *)bias)[n]) : ((const float *)bias)[n]) : 0.0f;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int mm = M - m0 < 4 ? (int)(M - m0) : 4;
            float out[4];
            if (bits == 4 && mm == 4) /* constant arguments: one specialised loop each */
                row_tile(xf + m0 * K, wr, sr, zr, K, 4, 4, out);
            else if (bits == 4 && mm == 1)
                row_tile(xf + m0 * K, wr, sr, zr, K, 4, 1, out);
            else if (bits == 8 && mm == 4)
                row_tile(xf + m0 * K, wr, sr, zr, K, 8, 4, out);
            else if (bits == 8 && mm == 1)
                row_tile(xf + m0 * K, wr, sr, zr, K, 8, 1, out);
            else
                row_tile(xf + m0 * K, wr, sr, zr, K, bits, mm, out);
            for (int i = 0; i < mm; i++) {
                const float v = out[i] + b;
                if (bf16)
                    ((uint16_t *)y)[(m0 + i) * N + n] = f32_to_bf16(v);
                else
                    ((float *)y)[(m0 + i) * N + n] = v;
            }
        }
    }
    free(xs);
    return 0;
}

/* The weight as floats (code x its group's scale, exactly), rounded to bf16 when asked. */
int kvl_group_dequantize(const uint8_t *qw, int bits, const float *scales, const uint8_t *zeros, void *out,
                         int bf16, int64_t N, int64_t K, int num_threads) {
    if (N < 1 || K < G || K % G != 0 || num_threads < 1 || (bits != 4 && bits != 8)) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < K / G; g++) {
            const uint8_t *b = qw + n * (K * bits / 8) + g * (G * bits / 8);
            const float s = scales[n * (K / G) + g];
            const int z = zeros ? zeros[n * (K / G) + g] : 8;
            for (int j = 0; j < G; j++) {
                int code;
                if (bits == 8)
                    code = (int8_t)b[j];
                else
                    code = (j < G / 2 ? (b[j] & 0x0F) : (b[j - G / 2] >> 4)) - z;
                const float v = (float)code * s;
                const int64_t i = n * K + g * G + j;
                if (bf16)
                    ((uint16_t *)out)[i] = f32_to_bf16(v);
                else
                    ((float *)out)[i] = v;
            }
        }
    return 0;
}
