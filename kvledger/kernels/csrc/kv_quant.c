/* Quantised KV writes: a step's new K/V rows to int8 / fp8 (e4m3) codes with one float16 scale
 * per token and KV head, stored at their slots, in one call per layer instead of a dozen torch
 * ops (kvledger.cache.kv_quant.quantize + four index_copy_).
 *
 * Same arithmetic as kv_quant.quantize, so the codes and scales are bit-identical to it:
 * scale = float16(clamp(absmax / qmax, 2^-24, 65504)) (round to nearest even), then each value
 * x / float(scale) clamped to +-qmax, rounded to nearest even: to an integer (int8), or to e4m3
 * (fp8; the same rounding as c10's float -> Float8_e4m3fn conversion, subnormals included).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "simd.h"

#define SCALE_MIN 5.9604644775390625e-08f /* 2^-24, the smallest positive float16 */
#define SCALE_MAX 65504.0f

static inline uint8_t to_e4m3(float y) {
    union { float f; uint32_t u; } c = {.f = y};
    const uint8_t sign = (uint8_t)((c.u >> 24) & 0x80);
    c.u &= 0x7FFFFFFFu;
    if (c.f < 0.015625f) /* below e4m3's smallest normal 2^-6: subnormal steps of 2^-9 */
        return sign | (uint8_t)nearbyintf(c.f * 512.0f);
    const uint32_t odd = (c.u >> 20) & 1u;
    c.u += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + odd;
    return sign | (uint8_t)(c.u >> 20);
}

static void quantize_row(const void *src, int qt, int64_t D, int fmt, void *codes, uint16_t *scale) {
    float x[256];
    for (int64_t d = 0; d < D; d++)
        x[d] = qt == ELEM_BF16 ? bf16_to_f32(((const uint16_t *)src)[d]) : ((const float *)src)[d];
    float amax = 0.0f;
    for (int64_t d = 0; d < D; d++) amax = fmaxf(amax, fabsf(x[d]));
    const float qmax = fmt == ELEM_I8 ? 127.0f : 448.0f;
    float s = amax / qmax;
    s = s < SCALE_MIN ? SCALE_MIN : (s > SCALE_MAX ? SCALE_MAX : s);
    const uint16_t h = _cvtss_sh(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    *scale = h;
    const float sf = _cvtsh_ss(h);
    for (int64_t d = 0; d < D; d++) {
        float y = x[d] / sf;
        y = y < -qmax ? -qmax : (y > qmax ? qmax : y);
        if (fmt == ELEM_I8)
            ((int8_t *)codes)[d] = (int8_t)nearbyintf(y);
        else
            ((uint8_t *)codes)[d] = to_e4m3(y);
    }
}

/* k, v: T rows of Hkv * D values (row stride src_stride elements, model dtype qt); row t goes
 * to slot slots[t] of codes [num_slots, Hkv, D] and scales [num_slots, Hkv]. */
int kvl_quantize_write(const void *k, const void *v, int64_t src_stride, int qt, const int64_t *slots,
                       int64_t T, int64_t Hkv, int64_t D, void *k_codes, void *v_codes, int kfmt,
                       int vfmt, uint16_t *k_scales, uint16_t *v_scales, int num_threads) {
    if (T < 0 || D < 1 || D > 256 || (qt != ELEM_F32 && qt != ELEM_BF16) || (kfmt != ELEM_I8 && kfmt != ELEM_FP8) ||
        (vfmt != ELEM_I8 && vfmt != ELEM_FP8))
        return -1;
    const int64_t es = qt == ELEM_BF16 ? 2 : 4;
#pragma omp parallel for num_threads(num_threads) if (T * Hkv * D >= (1 << 15))
    for (int64_t i = 0; i < T * Hkv; i++) {
        const int64_t t = i / Hkv, h = i % Hkv, slot = slots[t] * Hkv + h;
        const int64_t off = (t * src_stride + h * D) * es;
        quantize_row((const char *)k + off, qt, D, kfmt, (int8_t *)k_codes + slot * D, k_scales + slot);
        quantize_row((const char *)v + off, qt, D, vfmt, (int8_t *)v_codes + slot * D, v_scales + slot);
    }
    return 0;
}
