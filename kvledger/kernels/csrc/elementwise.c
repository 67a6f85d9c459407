/* Row-wise ops of the decoder layer, one call each instead of a chain of torch ops.
 *
 * A decode step runs ~40 small torch ops per layer, each costing microseconds of dispatch
 * for a few thousand floats; these kernels do the same arithmetic in one pass.
 *  - kvl_rope_inplace: HF's rotate-half RoPE, (x * cos) + (rotate_half(x) * sin) with the
 *    multiplies and the add rounded separately as torch does (no FMA contraction): bit-identical
 *    to the torch path. cos/sin are looked up from the float32 tables by position.
 *  - kvl_rms_norm: weight * (x * 1/sqrt(mean(x^2) + eps)). The sum of squares is accumulated in
 *    8 lanes, so it can differ from torch's reduction in the last bit.
 *  - kvl_silu_mul: silu(gate) * up = gate / (1 + exp(-gate)) * up over a fused [gate | up] row.
 *    exp is a Cephes-style polynomial (~1 ulp), not torch's Sleef. It runs VW lanes at a time
 *    (16 on AVX-512), finishing a row with the 8-lane loop; the operations are the same, so
 *    the lane count does not change a bit of the result.
 * Float32, no fast-math. Rows are spread over OpenMP threads when there are enough of them.
 *
 * The *_bf16 twins take and return bfloat16 and round to bfloat16 wherever a torch bf16 op
 * stores its result (HF's bf16 forward pass): RoPE with bf16 cos/sin, each product and the sum
 * rounded (bit-identical to the torch bf16 path); RMSNorm normalised in float32, rounded, then
 * times the bf16 weight and rounded; silu(gate) rounded, times up, rounded.
 * The other kernels work on 8 floats at a time on both instruction sets (they are cheap).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "simd.h"
#include "kernels.h"

#define PAR_MIN_FLOATS (1 << 15) /* below this, threads cost more than they save */

/* x: rows of `width` floats, row stride x_stride; rotates the first num_heads * D floats of
 * each row (heads of D floats) in place. Returns -1 if D % 16 != 0. */
int kvl_rope_inplace(float *x, int64_t rows, int64_t x_stride, int64_t num_heads, int64_t D,
                     const int64_t *positions, const float *cos_table, const float *sin_table,
                     int num_threads) {
    if (D % 16 != 0 || rows < 0) return -1;
    const int64_t h = D / 2;
#pragma omp parallel for num_threads(num_threads) if (rows * num_heads * D >= PAR_MIN_FLOATS)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos_table + positions[t] * D, *s = sin_table + positions[t] * D;
        for (int64_t hd = 0; hd < num_heads; hd++) {
            float *p = x + t * x_stride + hd * D;
            for (int64_t i = 0; i < h; i += 8) {
                __m256 x1 = _mm256_loadu_ps(p + i), x2 = _mm256_loadu_ps(p + h + i);
                /* first half: x1 * cos - x2 * sin  == (x1 * cos) + ((-x2) * sin) */
                __m256 lo = _mm256_add_ps(_mm256_mul_ps(x1, _mm256_loadu_ps(c + i)),
                                          _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), x2), _mm256_loadu_ps(s + i)));
                __m256 hi = _mm256_add_ps(_mm256_mul_ps(x2, _mm256_loadu_ps(c + h + i)),
                                          _mm256_mul_ps(x1, _mm256_loadu_ps(s + h + i)));
                _mm256_storeu_ps(p + i, lo);
                _mm256_storeu_ps(p + h + i, hi);
            }
        }
    }
    return 0;
}

/* One row of kvl_rms_norm (shared with kvl_add_rms_norm, so both give the same bits). */
static inline void rms_row(const float *xr, const float *w, float *yr, int64_t n, float eps) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        __m256 v = _mm256_loadu_ps(xr + i);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    float var = hsum8(acc) / (float)n;
    __m256 inv = _mm256_set1_ps(1.0f / __builtin_sqrtf(var + eps));
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(xr + i), inv)));
}

/* y[r] = w * (x[r] * (1 / sqrt(mean(x[r]^2) + eps))) for contiguous rows of n floats. */
int kvl_rms_norm(const float *x, const float *w, float *y, int64_t rows, int64_t n, float eps,
                 int num_threads) {
    if (n % 8 != 0 || rows < 0) return -1;
#pragma omp parallel for num_threads(num_threads) if (rows * n >= PAR_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) rms_row(x + r * n, w, y + r * n, n, eps);
    return 0;
}

/* The residual add of a decoder layer and the RMSNorm after it, in one pass over each row:
 * h[r] += d[r] in place (torch's `residual + h`), then, when w is not NULL, y[r] = rms_norm(h[r])
 * exactly as kvl_rms_norm computes it (the row still in L1). */
int kvl_add_rms_norm(float *h, const float *d, const float *w, float *y, int64_t rows, int64_t n, float eps,
                     int num_threads) {
    if (n % 8 != 0 || rows < 0) return -1;
#pragma omp parallel for num_threads(num_threads) if (rows * n >= PAR_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        float *hr = h + r * n;
        const float *dr = d + r * n;
        for (int64_t i = 0; i < n; i += 8)
            _mm256_storeu_ps(hr + i, _mm256_add_ps(_mm256_loadu_ps(hr + i), _mm256_loadu_ps(dr + i)));
        if (w) rms_row(hr, w, y + r * n, n, eps);
    }
    return 0;
}

/* out[r, i] = silu(gu[r, i]) * gu[r, inter + i] for rows of 2 * inter floats. */
int kvl_silu_mul(const float *gu, float *out, int64_t rows, int64_t inter, int num_threads) {
    if (inter % 8 != 0 || rows < 0) return -1;
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= PAR_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
        for (; i + VW <= inter; i += VW) { /* the 8-lane loop's operations, VW lanes at a time */
            vf x = vload(g + i);
            vf silu = vdiv(x, vadd(vset1(1.0f), vexp(vsub(vzero(), x))));
            vstore(o + i, vmul(silu, vload(u + i)));
        }
        for (; i < inter; i += 8) {
            __m256 x = _mm256_loadu_ps(g + i);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
            __m256 silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
    }
    return 0;
}

/* ---- bfloat16 twins ---------------------------------------------------------------------- */

int kvl_rope_inplace_bf16(uint16_t *x, int64_t rows, int64_t x_stride, int64_t num_heads, int64_t D,
                          const int64_t *positions, const float *cos_table, const float *sin_table,
                          int num_threads) {
    if (D % 16 != 0 || rows < 0) return -1;
    const int64_t h = D / 2;
#pragma omp parallel for num_threads(num_threads) if (rows * num_heads * D >= PAR_MIN_FLOATS)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos_table + positions[t] * D, *s = sin_table + positions[t] * D;
        for (int64_t hd = 0; hd < num_heads; hd++) {
            uint16_t *p = x + t * x_stride + hd * D;
            for (int64_t i = 0; i < h; i += 8) {
                __m256 x1 = load8_bf16(p + i), x2 = load8_bf16(p + h + i);
                __m256 c1 = round8_bf16(_mm256_loadu_ps(c + i)), s1 = round8_bf16(_mm256_loadu_ps(s + i));
                __m256 c2 = round8_bf16(_mm256_loadu_ps(c + h + i)), s2 = round8_bf16(_mm256_loadu_ps(s + h + i));
                __m256 lo = _mm256_add_ps(round8_bf16(_mm256_mul_ps(x1, c1)),
                                          round8_bf16(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), x2), s1)));
                __m256 hi = _mm256_add_ps(round8_bf16(_mm256_mul_ps(x2, c2)), round8_bf16(_mm256_mul_ps(x1, s2)));
                store8_bf16(p + i, lo);
                store8_bf16(p + h + i, hi);
            }
        }
    }
    return 0;
}

static inline void rms_row_bf16(const uint16_t *xr, const uint16_t *w, uint16_t *yr, int64_t n, float eps) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        __m256 v = load8_bf16(xr + i);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    float var = hsum8(acc) / (float)n;
    __m256 inv = _mm256_set1_ps(1.0f / __builtin_sqrtf(var + eps));
    for (int64_t i = 0; i < n; i += 8)
        store8_bf16(yr + i, _mm256_mul_ps(load8_bf16(w + i), round8_bf16(_mm256_mul_ps(load8_bf16(xr + i), inv))));
}

int kvl_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t n,
                      float eps, int num_threads) {
    if (n % 8 != 0 || rows < 0) return -1;
#pragma omp parallel for num_threads(num_threads) if (rows * n >= PAR_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) rms_row_bf16(x + r * n, w, y + r * n, n, eps);
    return 0;
}

/* h[r] += d[r], the sum rounded to bfloat16 (a torch bf16 add), then the RMSNorm when w is set. */
int kvl_add_rms_norm_bf16(uint16_t *h, const uint16_t *d, const uint16_t *w, uint16_t *y, int64_t rows, int64_t n,
                          float eps, int num_threads) {
    if (n % 8 != 0 || rows < 0) return -1;
#pragma omp parallel for num_threads(num_threads) if (rows * n >= PAR_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *hr = h + r * n;
        const uint16_t *dr = d + r * n;
        for (int64_t i = 0; i < n; i += 8) store8_bf16(hr + i, _mm256_add_ps(load8_bf16(hr + i), load8_bf16(dr + i)));
        if (w) rms_row_bf16(hr, w, y + r * n, n, eps);
    }
    return 0;
}

int kvl_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t inter, int num_threads) {
    if (inter % 8 != 0 || rows < 0) return -1;
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= PAR_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
        int64_t i = 0;
        for (; i + VW <= inter; i += VW) {
            vf x = vload_bf16(g + i);
            vf silu = vround_bf16(vdiv(x, vadd(vset1(1.0f), vexp(vsub(vzero(), x)))));
            vstore_bf16(o + i, vmul(silu, vload_bf16(u + i)));
        }
        for (; i < inter; i += 8) {
            __m256 x = load8_bf16(g + i);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
            __m256 silu = round8_bf16(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
            store8_bf16(o + i, _mm256_mul_ps(silu, load8_bf16(u + i)));
        }
    }
    return 0;
}
