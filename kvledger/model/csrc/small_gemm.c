/* y[M,N] = x[M,K] W[N,K]^T (+ b) for a few rows of x: the decode-step matmul.
 *
 * With few rows every weight is read once from memory and used M times, so the product is
 * bound by memory bandwidth. Streaming W in its checkpoint (row-major) layout with FMAs
 * reaches 12-16 GB/s on the 2-core CI machine, 1.2-2.5x oneDNN's packed GEMM for M <= 16
 * (docs/benchmarks.md, issue 7). No fast-math: each output is one dot product of length K
 * accumulated in VW lanes (8 AVX2, 16 AVX-512) then summed, the same rounding class as a GEMM.
 *
 * kvl_small_gemm_bf16: bfloat16 x and W (half the bytes to stream), float32 accumulation,
 * the bias added in float32, one rounding to bfloat16 at the end (as oneDNN's bf16 GEMM).
 * With avx512_bf16 the products are vdpbf16ps pairs (x stays bf16); elsewhere x is widened
 * to float32 once per call and each W vector is widened as it is loaded.
 *
 * Threads: the N rows are split into one contiguous range per OpenMP thread (libgomp, the
 * runtime torch already loaded). Rows of x are taken 8 at a time over a block of W small
 * enough to stay in L2, so W comes from memory once even when M > 8. Each output depends only
 * on its own row of x and of W, never on M or the thread split (batch invariance).
 *
 * Built on first use by kvledger/model/native.py; K must be a multiple of 8.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

/* Rows n0..n1 of W against MM rows of x (MM a compile-time constant: accumulators in registers). */
#define DEFINE_TILE(MM)                                                                         \
    static void tile_##MM(const float *x, const float *w, const float *b, float *y, int64_t N, \
                          int64_t K, int64_t n0, int64_t n1) {                                  \
        const int64_t K0 = K - K % VW;                                                          \
        for (int64_t n = n0; n < n1; n++) {                                                     \
            const float *wr = w + n * K;                                                        \
            vf acc[MM];                                                                         \
            for (int m = 0; m < MM; m++) acc[m] = vzero();                                      \
            for (int64_t k = 0; k < K0; k += VW) {                                              \
                vf wv = vload(wr + k);                                                          \
                for (int m = 0; m < MM; m++) acc[m] = vfmadd(vload(x + m * K + k), wv, acc[m]); \
            }                                                                                   \
            if (K0 < K) {                                                                       \
                vf wv = vload_tail(wr + K0, K - K0);                                            \
                for (int m = 0; m < MM; m++)                                                    \
                    acc[m] = vfmadd(vload_tail(x + m * K + K0, K - K0), wv, acc[m]);            \
            }                                                                                   \
            float bias = b ? b[n] : 0.0f;                                                       \
            for (int m = 0; m < MM; m++) y[m * N + n] = vhsum(acc[m]) + bias;                   \
        }                                                                                       \
    }

DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)
DEFINE_TILE(7)
DEFINE_TILE(8)

typedef void (*tile_fn)(const float *, const float *, const float *, float *, int64_t, int64_t,
                        int64_t, int64_t);
static const tile_fn TILES[9] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7, tile_8};

/* Returns 0, or -1 if the shape is not supported (the caller then uses another GEMM). */
int kvl_small_gemm(const float *x, const float *w, const float *b, float *y, int64_t M,
                   int64_t N, int64_t K, int num_threads) {
    if (M < 1 || N < 1 || K < 8 || K % 8 != 0 || num_threads < 1) return -1;
    /* Block of W rows revisited by each group of 8 x rows: 64 KiB-128 KiB, inside L2. */
    const int64_t block = K >= 1024 ? 32 : 64;
#pragma omp parallel num_threads(num_threads)
    {
        int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t per = ((N + nt - 1) / nt + 7) / 8 * 8;
        int64_t n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
        for (int64_t a = n0; a < n1; a += block) {
            int64_t e = a + block < n1 ? a + block : n1;
            for (int64_t m0 = 0; m0 < M; m0 += 8) {
                int64_t mm = M - m0 < 8 ? M - m0 : 8;
                TILES[mm](x + m0 * K, w, b, y + m0 * N, N, K, a, e);
            }
        }
    }
    return 0;
}

/* ---- bfloat16 ------------------------------------------------------------------------------ */

#if defined(KVL_AVX512BF16)
/* vdpbf16ps: 32 bf16 products per instruction, summed in pairs into 16 float32 lanes. */
#define DEFINE_TILE_BF16(MM)                                                                    \
    static void tile_bf16_##MM(const uint16_t *x, const uint16_t *w, const uint16_t *b,        \
                               uint16_t *y, int64_t N, int64_t K, int64_t n0, int64_t n1) {     \
        const int64_t K0 = K - K % 32;                                                          \
        const __mmask32 tail = (__mmask32)((1ull << (K - K0)) - 1);                             \
        for (int64_t n = n0; n < n1; n++) {                                                     \
            const uint16_t *wr = w + n * K;                                                     \
            __m512 acc[MM];                                                                     \
            for (int m = 0; m < MM; m++) acc[m] = _mm512_setzero_ps();                          \
            for (int64_t k = 0; k < K0; k += 32) {                                              \
                __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k);                             \
                for (int m = 0; m < MM; m++)                                                    \
                    acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(x + m * K + k), wv); \
            }                                                                                   \
            if (K0 < K) {                                                                       \
                __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + K0);                \
                for (int m = 0; m < MM; m++)                                                    \
                    acc[m] = _mm512_dpbf16_ps(                                                  \
                        acc[m], (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * K + K0), wv);  \
            }                                                                                   \
            float bias = b ? bf16_to_f32(b[n]) : 0.0f;                                          \
            for (int m = 0; m < MM; m++) y[m * N + n] = f32_to_bf16(vhsum(acc[m]) + bias);      \
        }                                                                                       \
    }
#define BF16_X_IS_FLOAT 0
typedef uint16_t xbf_t;
#else
/* Widening: x (already float32, converted once per call) times W widened as it is loaded. */
#define DEFINE_TILE_BF16(MM)                                                                    \
    static void tile_bf16_##MM(const float *x, const uint16_t *w, const uint16_t *b,           \
                               uint16_t *y, int64_t N, int64_t K, int64_t n0, int64_t n1) {     \
        const int64_t K0 = K - K % VW;                                                          \
        for (int64_t n = n0; n < n1; n++) {                                                     \
            const uint16_t *wr = w + n * K;                                                     \
            vf acc[MM];                                                                         \
            for (int m = 0; m < MM; m++) acc[m] = vzero();                                      \
            for (int64_t k = 0; k < K0; k += VW) {                                              \
                vf wv = vload_bf16(wr + k);                                                     \
                for (int m = 0; m < MM; m++) acc[m] = vfmadd(vload(x + m * K + k), wv, acc[m]); \
            }                                                                                   \
            if (K0 < K) {                                                                       \
                vf wv = vload_bf16_tail(wr + K0, K - K0);                                       \
                for (int m = 0; m < MM; m++)                                                    \
                    acc[m] = vfmadd(vload_tail(x + m * K + K0, K - K0), wv, acc[m]);            \
            }                                                                                   \
            float bias = b ? bf16_to_f32(b[n]) : 0.0f;                                          \
            for (int m = 0; m < MM; m++) y[m * N + n] = f32_to_bf16(vhsum(acc[m]) + bias);      \
        }                                                                                       \
    }
#define BF16_X_IS_FLOAT 1
typedef float xbf_t;
#endif

DEFINE_TILE_BF16(1)
DEFINE_TILE_BF16(2)
DEFINE_TILE_BF16(3)
DEFINE_TILE_BF16(4)
DEFINE_TILE_BF16(5)
DEFINE_TILE_BF16(6)
DEFINE_TILE_BF16(7)
DEFINE_TILE_BF16(8)

typedef void (*tile_bf16_fn)(const xbf_t *, const uint16_t *, const uint16_t *, uint16_t *, int64_t,
                             int64_t, int64_t, int64_t);
static const tile_bf16_fn TILES_BF16[9] = {0, tile_bf16_1, tile_bf16_2, tile_bf16_3, tile_bf16_4,
                                           tile_bf16_5, tile_bf16_6, tile_bf16_7, tile_bf16_8};

int kvl_small_gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y,
                        int64_t M, int64_t N, int64_t K, int num_threads) {
    if (M < 1 || N < 1 || K < 8 || K % 8 != 0 || num_threads < 1) return -1;
#if BF16_X_IS_FLOAT
    float *xs = malloc(sizeof(float) * M * K);
    if (!xs) return -1;
    for (int64_t i = 0; i < M * K; i++) xs[i] = bf16_to_f32(x[i]);
#else
    const uint16_t *xs = x;
#endif
    const int64_t block = K >= 1024 ? 64 : 128; /* W rows per L2 block (half the bytes of fp32) */
#pragma omp parallel num_threads(num_threads)
    {
        int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t per = ((N + nt - 1) / nt + 7) / 8 * 8;
        int64_t n0 = t * per, n1 = n0 + per < N ? n0 + per : N;
        for (int64_t a = n0; a < n1; a += block) {
            int64_t e = a + block < n1 ? a + block : n1;
            for (int64_t m0 = 0; m0 < M; m0 += 8) {
                int64_t mm = M - m0 < 8 ? M - m0 : 8;
                TILES_BF16[mm](xs + m0 * K, w, b, y + m0 * N, N, K, a, e);
            }
        }
    }
#if BF16_X_IS_FLOAT
    free(xs);
#endif
    return 0;
}
