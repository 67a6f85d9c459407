/* y[M,N] = x[M,K] W[N,K]^T (+ b) for a few rows of x: the decode-step matmul.
 *
 * With few rows every weight is read once from memory and used M times, so the product is
 * bound by memory bandwidth. Streaming W in its checkpoint (row-major) layout with AVX2 FMAs
 * reaches 12-16 GB/s on the 2-core CI machine, 1.2-2.5x oneDNN's packed GEMM for M <= 16
 * (docs/benchmarks.md, issue 7). Float32 throughout, no fast-math: each output is one dot
 * product of length K accumulated in 8 lanes then summed, the same rounding class as a GEMM.
 *
 * Threads: the N rows are split into one contiguous range per OpenMP thread (libgomp, the
 * runtime torch already loaded). Rows of x are taken 8 at a time over a block of W small
 * enough to stay in L2, so W comes from memory once even when M > 8.
 *
 * Built on first use by kvledger/model/native.py; K must be a multiple of 8.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "simd.h"

/* Rows n0..n1 of W against MM rows of x (MM a compile-time constant: accumulators in registers). */
#define DEFINE_TILE(MM)                                                                         \
    static void tile_##MM(const float *x, const float *w, const float *b, float *y, int64_t N, \
                          int64_t K, int64_t n0, int64_t n1) {                                  \
        for (int64_t n = n0; n < n1; n++) {                                                     \
            const float *wr = w + n * K;                                                        \
            __m256 acc[MM];                                                                     \
            for (int m = 0; m < MM; m++) acc[m] = _mm256_setzero_ps();                          \
            for (int64_t k = 0; k < K; k += 8) {                                                \
                __m256 wv = _mm256_loadu_ps(wr + k);                                            \
                for (int m = 0; m < MM; m++)                                                    \
                    acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), wv, acc[m]);       \
            }                                                                                   \
            float bias = b ? b[n] : 0.0f;                                                       \
            for (int m = 0; m < MM; m++) y[m * N + n] = hsum8(acc[m]) + bias;                    \
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
