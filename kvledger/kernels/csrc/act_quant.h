/* Activations rounded to int8 codes at each product (W8A8 per row in int8_gemm.c, W4A8 per group
 * of 32 in q4_gemm.c), 8 lanes at a time (plain AVX2, so both builds share it).
 *
 * Why vectors: a decode step rounds every layer's inputs four times; the scalar loops (a division
 * and a rounding call an element) took ~2 % of a 4-bit decode step of the 226M model. The
 * arithmetic is the scalar loops' lane by lane: |x| and its running maximum in the same form
 * (a > amax ? a : amax; the maximum is exact whatever the order), the IEEE quotient x / s
 * (vdivps rounds as divss does), rounding half to even (the default mode nearbyintf uses), the
 * clamp to +-127: the same codes, bit for bit, as the torch references (model/quant_int8.py,
 * model/quant_q4.py ``quantize_act``). */
#ifndef KVL_ACT_QUANT_H
#define KVL_ACT_QUANT_H

#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

/* 8 activations from element i of x (bfloat16 or float32) as floats. */
static inline __m256 act_load8(const void *x, int bf16, int64_t i) {
    return bf16 ? load8_bf16((const uint16_t *)x + i) : _mm256_loadu_ps((const float *)x + i);
}

/* max |x[i]| for i in [0, n), n a multiple of 8. */
static inline float act_amax8(const void *x, int bf16, int64_t n) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 amax = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) amax = _mm256_max_ps(_mm256_and_ps(act_load8(x, bf16, i), abs_mask), amax);
    float lanes[8], m = 0.0f;
    _mm256_storeu_ps(lanes, amax);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    return m;
}

/* q[i] = clamp(round_half_even(x[i] / s), -127, 127) for i in [0, n), n a multiple of 8; returns
 * the codes' sum. */
static inline int32_t act_codes8(const void *x, int bf16, float s, int8_t *q, int64_t n) {
    const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    __m256i sum = _mm256_setzero_si256();
    for (int64_t i = 0; i < n; i += 8) {
        __m256 r = _mm256_round_ps(_mm256_div_ps(act_load8(x, bf16, i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i c = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        sum = _mm256_add_epi32(sum, c);
        const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
        _mm_storel_epi64((__m128i *)(q + i), _mm_packs_epi16(w, w));
    }
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
}

#endif
