/* Vector helpers shared by the kernels in this folder, for two instruction sets.
 *
 * Every source here is compiled for one instruction set (kvledger/kernels/native_build.py): AVX2+FMA+F16C
 * (8 float lanes), with avx_vnni's dot products where the CPU has them (KVL_AVXVNNI), or AVX-512
 * F/BW/VL/DQ (16 lanes), with -mavx512bf16 plus KVL_AVX512BF16 where the CPU has avx512_bf16 and
 * -mavx512vnni plus KVL_AVX512VNNI where it has avx512_vnni. The kernels are written once against `vf`
 * (VW float lanes) and the v* helpers; which library is loaded is chosen at run time from the
 * CPU's flags (or KVLEDGER_NATIVE_ISA).
 *
 * Element types the kernels read (codes of kvledger.kernels.native.ELEM):
 *   0 float32, 1 bfloat16, 2 float16, 3 int8 (quantised KV codes), 4 fp8 e4m3 (raw bytes).
 * Conversions to float32 are exact: bf16 is the top half of a float32; fp16 via F16C; int8 via
 * int32; e4m3 is rebuilt as the fp16 with the same mantissa and exponent field, which is the
 * value / 256 (e4m3 subnormals become fp16 subnormals, converted exactly by F16C), and callers
 * fold the 256 into the token's scale.
 */
#ifndef KVLEDGER_SIMD_H
#define KVLEDGER_SIMD_H

#include <immintrin.h>
#include <stdint.h>

/* KVL_AVX512: 16 float lanes (AVX-512 F/BW/VL/DQ). Not in the avx2-vnni build's stand-in on an
 * AVX-512 CPU (KVL_VW8): compiled with AVX-512 flags for its 256-bit VNNI instructions, it runs
 * the 8-lane AVX2 code that avx_vnni CPUs run. */
#if defined(__AVX512F__) && !defined(KVL_VW8)
#define KVL_AVX512 1
#endif
/* u8 x s8 (vpdpbusd) and s16 x s16 (vpdpwssd) dot products on 8 int32 lanes: avx_vnni's VEX
 * instructions, or in the stand-in avx512_vnni's EVEX form of the same instructions (same
 * results; only the encoding differs), so that an AVX-512 VNNI CPU tests this path. */
#if defined(KVL_AVXVNNI)
#define KVL_VNNI256 1
#define dpbusd8 _mm256_dpbusd_avx_epi32
#define dpwssd8 _mm256_dpwssd_avx_epi32
#elif defined(KVL_VNNI_EVEX256)
#define KVL_VNNI256 1
#define dpbusd8 _mm256_dpbusd_epi32
#define dpwssd8 _mm256_dpwssd_epi32
#endif
/* KVL_VNNI: this build's int8 products are vpdpbusd (u8 x s8), 512-bit or 256-bit. */
#if defined(KVL_AVX512VNNI) || defined(KVL_VNNI256)
#define KVL_VNNI 1
#endif

enum { ELEM_F32 = 0, ELEM_BF16 = 1, ELEM_F16 = 2, ELEM_I8 = 3, ELEM_FP8 = 4 };
#define FP8_UNIT 256.0f /* e4m3 value = (fp16 rebuilt from its bits) * FP8_UNIT */

/* 8 bf16 <-> 8 floats (plain AVX2: both builds use them, the AVX2 one as its vf versions). */
static inline __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
/* bf16 rounding of 8 floats, round to nearest even (finite inputs), kept as floats (what a torch
 * bf16 op stores, read back). */
static inline __m256 round8_bf16(__m256 v) {
    __m256i x = _mm256_castps_si256(v);
    __m256i r = _mm256_add_epi32(
        x, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1))));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline void store8_bf16(uint16_t *p, __m256 v) {
    __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round8_bf16(v)), 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

#if defined(KVL_AVX512)
#define VW 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vfnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline vf vfloor(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
/* Lanes summed pairwise in a fixed order (the result depends only on v). */
static inline float vhsum(vf v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vf vpow2i(vf fx) { /* 2^fx for integral fx in float range */
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23));
}
/* the first n (< 16) floats at p, the rest zero */
static inline vf vload_tail(const float *p, int64_t n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
static inline vf vload_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vf vload_bf16_tail(const uint16_t *p, int64_t n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p)), 16));
}
static inline vf vload_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vf vload_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vf vload_fp8(const uint8_t *p) {
    __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                                _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
    return _mm512_cvtph_ps(h);
}
/* bf16 rounding of VW floats, kept as floats (what a torch bf16 op stores, read back). */
static inline vf vround_bf16(vf v) {
    __m512i x = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(
        x, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1))));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u)));
}
/* float32 -> bfloat16, round to nearest even (finite inputs), VW values. */
static inline void vstore_bf16(uint16_t *p, vf v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(vround_bf16(v)), 16)));
}
#else
#define VW 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vfmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vfnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf vfloor(vf a) { return _mm256_floor_ps(a); }
static inline float vhsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vf vpow2i(vf fx) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23));
}
static inline vf vload_tail(const float *p, int64_t n) { /* n < 8: never needed (K % 8 == 0) */
    (void)n;
    return _mm256_loadu_ps(p);
}
static inline vf vload_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf vload_bf16_tail(const uint16_t *p, int64_t n) {
    (void)n;
    return vload_bf16(p);
}
static inline vf vload_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vf vload_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vf vload_fp8(const uint8_t *p) {
    __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7),
                             _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
    return _mm256_cvtph_ps(h);
}
static inline void vstore_bf16(uint16_t *p, vf v) { store8_bf16(p, v); }
static inline vf vround_bf16(vf v) { return round8_bf16(v); }
#endif

/* int16 dot products, for int8 KV codes against a query rounded to int16 (paged_decode.c):
 * IW int16 lanes per vector, products summed in pairs into int32 lanes (exact). */
#if defined(KVL_AVX512)
#define IW 32
typedef __m512i vi;
static inline vi vi_zero(void) { return _mm512_setzero_si512(); }
static inline vi vi_load16(const int16_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline vi vi_load_i8(const int8_t *p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
#if defined(KVL_AVX512VNNI)
static inline vi vi_dot(vi acc, vi a, vi b) { return _mm512_dpwssd_epi32(acc, a, b); } /* one vpdpwssd */
#else
static inline vi vi_dot(vi acc, vi a, vi b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
#endif
static inline int32_t vi_hsum(vi v) { return _mm512_reduce_add_epi32(v); }
#else
#define IW 16
typedef __m256i vi;
static inline vi vi_zero(void) { return _mm256_setzero_si256(); }
static inline vi vi_load16(const int16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vi vi_load_i8(const int8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
#if defined(KVL_VNNI256)
static inline vi vi_dot(vi acc, vi a, vi b) { return dpwssd8(acc, a, b); }
#else
static inline vi vi_dot(vi acc, vi a, vi b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
#endif
static inline int32_t vi_hsum(vi v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}
#endif

#if defined(KVL_AVX512)
/* The lane sums of 16 vectors at once, in 15 shuffle-add steps instead of 16 separate
 * reductions (4 each, plus moves out of the vector unit): lane 4m + r of the result is the sum of
 * v[4r + m]'s lanes, each a fixed pairwise tree (the result depends only on v). One body for
 * float and int32 lanes (ADD; the shuffles only move 32-bit lanes, so they act on either). */
#define KVL_VHSUM16(T, ADD, TO_PS, FROM_PS)                                                        \
    T c[8], d[4], e[2];                                                                           \
    for (int i = 0; i < 8; i++) /* lanes 0-7: v[2i]'s partials, 8-15: v[2i+1]'s */               \
        c[i] = ADD(FROM_PS(_mm512_shuffle_f32x4(TO_PS(v[2 * i]), TO_PS(v[2 * i + 1]), 0x44)),     \
                   FROM_PS(_mm512_shuffle_f32x4(TO_PS(v[2 * i]), TO_PS(v[2 * i + 1]), 0xEE)));    \
    for (int i = 0; i < 4; i++) /* 128-bit lane m: v[4i + m]'s partials */                       \
        d[i] = ADD(FROM_PS(_mm512_shuffle_f32x4(TO_PS(c[2 * i]), TO_PS(c[2 * i + 1]), 0x88)),     \
                   FROM_PS(_mm512_shuffle_f32x4(TO_PS(c[2 * i]), TO_PS(c[2 * i + 1]), 0xDD)));    \
    for (int i = 0; i < 2; i++) /* lane m: two of v[8i + m]'s, two of v[8i + 4 + m]'s */         \
        e[i] = ADD(FROM_PS(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(TO_PS(d[2 * i])),  \
                                                               _mm512_castps_pd(TO_PS(d[2 * i + 1]))))), \
                   FROM_PS(_mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(TO_PS(d[2 * i])),  \
                                                               _mm512_castps_pd(TO_PS(d[2 * i + 1])))))); \
    return ADD(FROM_PS(_mm512_shuffle_ps(TO_PS(e[0]), TO_PS(e[1]), 0x88)),                        \
               FROM_PS(_mm512_shuffle_ps(TO_PS(e[0]), TO_PS(e[1]), 0xDD)))
#define KVL_ID(x) (x)
static inline __attribute__((always_inline)) __m512 vhsum16(const __m512 *v) {
    KVL_VHSUM16(__m512, _mm512_add_ps, KVL_ID, KVL_ID);
}
static inline __attribute__((always_inline)) __m512i vhsum16_epi32(const __m512i *v) {
    KVL_VHSUM16(__m512i, _mm512_add_epi32, _mm512_castsi512_ps, _mm512_castps_si512);
}
#endif

/* VW elements of type `elem` at p (element offset already applied by the caller) as floats. */
static inline __attribute__((always_inline)) vf vload_as(const void *p, int elem) {
    switch (elem) {
    case ELEM_BF16: return vload_bf16((const uint16_t *)p);
    case ELEM_F16: return vload_f16((const uint16_t *)p);
    case ELEM_I8: return vload_i8((const int8_t *)p);
    case ELEM_FP8: return vload_fp8((const uint8_t *)p);
    default: return vload((const float *)p);
    }
}

/* The first min(n, VW) elements (AVX-512 with n < 16: masked, the other lanes zero; head_dim
 * is a multiple of 8, so AVX2 never needs a partial vector). */
static inline __attribute__((always_inline)) vf vload_as_n(const void *p, int elem, int64_t n) {
#if defined(KVL_AVX512)
    if (n < VW) {
        const __mmask16 m = (__mmask16)((1u << n) - 1);
        switch (elem) {
        case ELEM_BF16:
            return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
        case ELEM_F16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
        case ELEM_I8: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
        case ELEM_FP8: {
            __m256i b = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p));
            __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                                        _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
            return _mm512_cvtph_ps(h);
        }
        default: return _mm512_maskz_loadu_ps(m, p);
        }
    }
#else
    (void)n;
#endif
    return vload_as(p, elem);
}
static inline __attribute__((always_inline)) void vstore_n(float *p, vf v, int64_t n) {
#if defined(KVL_AVX512)
    if (n < VW) {
        _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v);
        return;
    }
#else
    (void)n;
#endif
    vstore(p, v);
}

static inline int64_t elem_size(int elem) { return elem == ELEM_F32 ? 4 : (elem <= ELEM_F16 ? 2 : 1); }

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)h << 16};
    return c.f;
}
static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } c = {.f = f};
    return (uint16_t)((c.u + 0x7FFFu + ((c.u >> 16) & 1u)) >> 16);
}

/* e^x, Cephes expf's range reduction and polynomial (~1 ulp), x clamped to [-87, 88]: below,
 * the result is ~1e-38 instead of a denormal; above, finite instead of inf. */
static inline vf vexp(vf x) {
    x = vmin(vmax(x, vset1(-87.0f)), vset1(88.0f));
    vf fx = vfloor(vfmadd(x, vset1(1.44269504088896341f), vset1(0.5f)));
    x = vfnmadd(fx, vset1(0.693359375f), x);
    x = vfnmadd(fx, vset1(-2.12194440e-4f), x);
    vf y = vset1(1.9875691500e-4f);
    y = vfmadd(y, x, vset1(1.3981999507e-3f));
    y = vfmadd(y, x, vset1(8.3334519073e-3f));
    y = vfmadd(y, x, vset1(4.1665795894e-2f));
    y = vfmadd(y, x, vset1(1.6666665459e-1f));
    y = vfmadd(y, x, vset1(5.0000001201e-1f));
    y = vfmadd(y, vmul(x, x), vadd(x, vset1(1.0f)));
    return vmul(y, vpow2i(fx));
}

/* 8-lane AVX2 versions, for the kernels that work on 8 floats at a time on both ISAs. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 h = _mm_movehdup_ps(s);
    s = _mm_add_ps(s, h);
    h = _mm_movehl_ps(h, s);
    return _mm_cvtss_f32(_mm_add_ss(s, h));
}
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 fx = _mm256_floor_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif
