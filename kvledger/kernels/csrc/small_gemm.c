/* y[M,N] = x[M,K] W[N,K]^T (+ b) for a few rows of x: the decode-step matmul.
 *
 * With few rows every weight is read once from memory and used M times, so the product is bound by
 * memory bandwidth if the kernel keeps up. kvl_small_gemm_packed (float32) and
 * kvl_small_gemm_bf16_packed (bfloat16 with vdpbf16ps) read W in a blocked layout made once at load
 * (kvl_pack_weight, below): 20-28 GB/s of weights on one Zen 4 core up to 6 rows, where the
 * row-major kernel they replaced managed 9-16 GB/s, and at least oneDNN's packed GEMM's speed up to
 * 64 rows (docs/measurements/cpu_kernels.md, "The few-row GEMM on its own weight layout"). No
 * fast-math: each output is one chain of FMAs over k in order, a GEMM's rounding class.
 *
 * bfloat16: x and W bf16 (half the bytes to stream), float32 accumulation, the bias added in
 * float32, one rounding to bfloat16 at the end (as oneDNN's bf16 GEMM). Without avx512_bf16
 * the row-major kvl_small_gemm_bf16 runs instead: x is widened to float32 once per call and
 * each W vector as it is loaded.
 *
 * Threads: OpenMP (libgomp, the runtime torch already loaded) over contiguous ranges of output
 * tiles. Each output depends only on its own row of x and of W, never on M, the tile or the
 * thread split (batch invariance, tests/test_native.py).
 *
 * Built on first use by kvledger/kernels/native_build.py; K must be a multiple of 8.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"
#include "kernels.h"

/* ---- the blocked layout ------------------------------------------------------------------
 *
 * In the checkpoint's row-major layout every product needs a vector of x, a vector of W and,
 * per output, a horizontal sum; at 4-8 rows those loads and sums, not memory, bound the kernel
 * (bf16 at 6 rows: 95 GFLOP/s per core with W in cache, 10-16 GB/s of weights from memory).
 * kvl_pack_weight lays W out so that one vector holds VW outputs' weights at one k (bfloat16
 * with vdpbf16ps: at one k pair), x is broadcast, and VW outputs accumulate at once with no
 * horizontal sum:
 *
 *   float32:  tile t of NT = NB * VW outputs is W[t NT + b VW + j][k] at [t][k][b][j]
 *   bfloat16: [t][k / 2][b][j][k % 2]  (b < NB, j < VW = 16; rows past N are zero)
 *
 * Each output is then one chain over k in order (bf16: pairs, vdpbf16ps's own rounding), the
 * same whatever the number of rows M, the tile or the thread (batch invariance). A tile's NB
 * weight vectors are adjacent, so W is read as one sequential stream. */
#if VW == 16
#define NB 4 /* MT * NB accumulators + NB weight vectors + a broadcast: 29 of 32 zmm */
#else
#define NB 2 /* 12 + 2 + 1 of 16 ymm */
#endif
#define NT (NB * VW)
#define MT 6 /* rows of x per pass over a tile (the tile stays in L2 for the next pass) */

static int64_t num_tiles(int64_t N) { return (N + NT - 1) / NT; }

/* With MT rows per pass, a tile's first pass streams its weights from memory and the others
 * find them in cache; from PF_MIN_PASSES passes (19+ rows) each pass also requests its share of the
 * next tile's lines (into L1: prefetcht1 gained less), so that tile's first pass no longer waits on
 * memory. The 60M model's decode-step weights (every layer and the LM head, 175 MB float32, beyond
 * the L3), 2 threads, Zen 4: 0.91-0.98x the time at 24-64 rows, float32 and bfloat16; at 8-16 rows,
 * where the product is bound by memory anyway, the extra requests cost 5-30 %, hence the floor
 * (docs/measurements/cpu_kernels.md, "The row-wise GEMM prefetches the next tile"). Prefetching
 * changes no arithmetic: the output bits are the same. */
#define PF_MIN_PASSES 4

/* Cache lines of the next tile to request during one pass over this one, a few per 8 k. */
typedef struct {
    const char *next;
    int64_t left, per8;
} prefetch_t;

static inline __attribute__((always_inline)) void prefetch_some(prefetch_t *pf) {
    for (int64_t i = 0; i < pf->per8 && pf->left > 0; i++, pf->left--, pf->next += 64)
        _mm_prefetch(pf->next, _MM_HINT_T0);
}

/* The tile's outputs for rows m0..m0+MM-1: acc (float32 sums) + bias, stored as float32
 * (bf16 = 0), rounded to bfloat16 (1), or rounded to bfloat16 and stored as the float32 of that
 * value (2: what a bfloat16 result converted to float32 holds, without the conversion's pass),
 * the columns past N dropped. */
static inline __attribute__((always_inline)) void store_tile(const int MM, vf acc[MT][NB], const float *bias,
                                                             void *y, int bf16, int64_t N, int64_t n0) {
    for (int m = 0; m < MM; m++)
        for (int b = 0; b < NB; b++) {
            int64_t n = n0 + b * VW;
            if (n >= N) break;
            float tmp[VW];
            vf v = vadd(acc[m][b], vload(bias + b * VW));
            int64_t cnt = N - n < VW ? N - n : VW;
            if (bf16 == 2) {
                float *yr = (float *)y + m * N + n;
                if (cnt == VW) {
                    vstore(yr, vround_bf16(v));
                } else {
                    vstore(tmp, v);
                    for (int64_t j = 0; j < cnt; j++) yr[j] = bf16_to_f32(f32_to_bf16(tmp[j]));
                }
            } else if (bf16) {
                uint16_t *yr = (uint16_t *)y + m * N + n;
                if (cnt == VW) {
                    vstore_bf16(yr, v);
                } else {
                    vstore(tmp, v);
                    for (int64_t j = 0; j < cnt; j++) yr[j] = f32_to_bf16(tmp[j]);
                }
            } else {
                float *yr = (float *)y + m * N + n;
                if (cnt == VW) {
                    vstore(yr, v);
                } else {
                    vstore(tmp, v);
                    for (int64_t j = 0; j < cnt; j++) yr[j] = tmp[j];
                }
            }
        }
}

static inline __attribute__((always_inline)) void tile_f32(const int MM, const float *x, const float *wt,
                                                           const float *bias, float *y, int64_t N,
                                                           int64_t K, int64_t n0, prefetch_t pf) {
    vf acc[MT][NB];
    for (int m = 0; m < MM; m++)
        for (int b = 0; b < NB; b++) acc[m][b] = vzero();
    for (int64_t k0 = 0; k0 < K; k0 += 8) {
        prefetch_some(&pf);
        for (int64_t k = k0, ke = k0 + 8 < K ? k0 + 8 : K; k < ke; k++) {
            vf w[NB];
            for (int b = 0; b < NB; b++) w[b] = vload(wt + (k * NB + b) * VW);
            for (int m = 0; m < MM; m++) {
                vf xb = vset1(x[m * K + k]);
                for (int b = 0; b < NB; b++) acc[m][b] = vfmadd(xb, w[b], acc[m][b]);
            }
        }
    }
    store_tile(MM, acc, bias, y, 0, N, n0);
}

#define DEFINE_TILE(MM)                                                                        \
    static void tile_f32_##MM(const float *x, const float *wt, const float *bias, float *y,   \
                              int64_t N, int64_t K, int64_t n0, prefetch_t pf) {               \
        tile_f32(MM, x, wt, bias, y, N, K, n0, pf);                                            \
    }
DEFINE_TILE(1)
DEFINE_TILE(2)
DEFINE_TILE(3)
DEFINE_TILE(4)
DEFINE_TILE(5)
DEFINE_TILE(6)
typedef void (*tile_f32_fn)(const float *, const float *, const float *, float *, int64_t, int64_t, int64_t,
                            prefetch_t);
static const tile_f32_fn TILES_F32[MT + 1] = {0, tile_f32_1, tile_f32_2, tile_f32_3, tile_f32_4, tile_f32_5, tile_f32_6};

/* The tile's bias as NT float32 (zero past N or without a bias). */
static void tile_bias(const void *b, int bf16, int64_t N, int64_t n0, float *out) {
    for (int64_t j = 0; j < NT; j++) {
        int64_t n = n0 + j;
        out[j] = (!b || n >= N) ? 0.0f : bf16 ? bf16_to_f32(((const uint16_t *)b)[n]) : ((const float *)b)[n];
    }
}

/* Element count of W in the blocked layout (NT-row tiles, the last one zero-padded). */
int64_t kvl_packed_weight_numel(int64_t N, int64_t K) { return num_tiles(N) * NT * K; }

/* Outputs per tile of the blocked layout (its row n sits in tile n / NT, lane n % NT). */
int kvl_packed_tile_width(void) { return NT; }

/* Lay W [N, K] (elem_size 4: float32, 2: bfloat16) out for kvl_small_gemm*_packed; returns -1 if
 * the layout does not exist for this build (bfloat16 without vdpbf16ps) or K is odd. */
int kvl_pack_weight(const void *w, void *out, int64_t N, int64_t K, int elem_size) {
    if (K < 2 || K % 2 != 0) return -1;
#if !defined(KVL_AVX512BF16)
    if (elem_size == 2) return -1;
#endif
    if (elem_size != 4 && elem_size != 2) return -1;
    for (int64_t t = 0; t < num_tiles(N); t++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t i = 0; i < NT; i++) {
                const int64_t n = t * NT + i, src = n * K + k;
                if (elem_size == 4) /* [t][k][i] */
                    ((float *)out)[(t * K + k) * NT + i] = n < N ? ((const float *)w)[src] : 0.0f;
                else /* [t][k / 2][i][k % 2] */
                    ((uint16_t *)out)[t * NT * K + (k / 2) * NT * 2 + i * 2 + k % 2] =
                        n < N ? ((const uint16_t *)w)[src] : 0;
            }
    return 0;
}

/* 1 if this build has the blocked bfloat16 kernel (vdpbf16ps), else 0 (row-major bf16 kernel). */
int kvl_bf16_packed_available(void) {
#if defined(KVL_AVX512BF16)
    return 1;
#else
    return 0;
#endif
}

#if defined(KVL_AVX512BF16)
static inline __attribute__((always_inline)) void tile_bf16p(const int MM, const uint16_t *x,
                                                             const uint16_t *wt, const float *bias,
                                                             void *y, int out, int64_t N, int64_t K,
                                                             int64_t n0, prefetch_t pf) {
    vf acc[MT][NB];
    for (int m = 0; m < MM; m++)
        for (int b = 0; b < NB; b++) acc[m][b] = vzero();
    for (int64_t k0 = 0; k0 < K; k0 += 8) {
        prefetch_some(&pf);
        for (int64_t k = k0, ke = k0 + 8 < K ? k0 + 8 : K; k < ke; k += 2) {
            __m512bh w[NB];
            for (int b = 0; b < NB; b++) w[b] = (__m512bh)_mm512_loadu_si512(wt + (k * NB + 2 * b) * VW);
            for (int m = 0; m < MM; m++) {
                int32_t pair;
                __builtin_memcpy(&pair, x + m * K + k, 4);
                __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                for (int b = 0; b < NB; b++) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], xb, w[b]);
            }
        }
    }
    store_tile(MM, acc, bias, y, out, N, n0);
}
#define DEFINE_TILE_BF16P(MM)                                                                  \
    static void tile_bf16p_##MM(const uint16_t *x, const uint16_t *wt, const float *bias,     \
                                void *y, int out, int64_t N, int64_t K, int64_t n0, prefetch_t pf) { \
        tile_bf16p(MM, x, wt, bias, y, out, N, K, n0, pf);                                     \
    }
DEFINE_TILE_BF16P(1)
DEFINE_TILE_BF16P(2)
DEFINE_TILE_BF16P(3)
DEFINE_TILE_BF16P(4)
DEFINE_TILE_BF16P(5)
DEFINE_TILE_BF16P(6)
typedef void (*tile_bf16p_fn)(const uint16_t *, const uint16_t *, const float *, void *, int, int64_t, int64_t,
                              int64_t, prefetch_t);
static const tile_bf16p_fn TILES_BF16P[MT + 1] = {0, tile_bf16p_1, tile_bf16p_2, tile_bf16p_3,
                                                  tile_bf16p_4, tile_bf16p_5, tile_bf16p_6};
#endif

/* The drivers' loop: tiles split over the threads in contiguous ranges, each tile meeting the
 * rows of x MT at a time (es: element size, 4 float32, 2 bfloat16; f32_out: bfloat16 results
 * stored as float32, store_tile's mode 2). */
static int run_tiles(int es, const void *x, const void *wp, const void *b, void *y, int64_t M,
                     int64_t N, int64_t K, int num_threads, int f32_out) {
    if (M < 1 || N < 1 || K < 2 || K % 2 != 0 || num_threads < 1) return -1;
    const int64_t T = num_tiles(N), tile_bytes = NT * K * es, lines = tile_bytes / 64;
    const int64_t passes = (M + MT - 1) / MT;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < T; t++) {
        float bias[NT];
        tile_bias(b, es == 2, N, t * NT, bias);
        const char *wt = (const char *)wp + t * tile_bytes;
        for (int64_t m0 = 0; m0 < M; m0 += MT) {
            const int64_t mm = M - m0 < MT ? M - m0 : MT;
            /* this pass's share of the next tile, in proportion to its rows */
            prefetch_t pf = {wt + tile_bytes + m0 * lines / M * 64, 0, 0};
            if (passes >= PF_MIN_PASSES && t + 1 < T) {
                pf.left = (m0 + mm) * lines / M - m0 * lines / M;
                pf.per8 = (pf.left * 8 + K - 1) / K;
            }
            const char *xm = (const char *)x + m0 * K * es;
            char *ym = (char *)y + m0 * N * (f32_out ? 4 : es);
#if defined(KVL_AVX512BF16)
            if (es == 2) {
                TILES_BF16P[mm]((const uint16_t *)xm, (const uint16_t *)wt, bias, ym, f32_out ? 2 : 1, N, K, t * NT, pf);
                continue;
            }
#endif
            TILES_F32[mm]((const float *)xm, (const float *)wt, bias, (float *)ym, N, K, t * NT, pf);
        }
    }
    return 0;
}

/* y[M,N] = x[M,K] W^T (+ b), float32, W in the blocked layout (kvl_pack_weight). */
int kvl_small_gemm_packed(const float *x, const float *wp, const float *b, float *y, int64_t M,
                          int64_t N, int64_t K, int num_threads) {
    return run_tiles(4, x, wp, b, y, M, N, K, num_threads, 0);
}

/* bfloat16 x, blocked W, bias: float32 accumulation, one rounding to bfloat16 at the end (as
 * oneDNN's bf16 GEMM). -1 where the build has no vdpbf16ps (use kvl_small_gemm_bf16). */
int kvl_small_gemm_bf16_packed(const uint16_t *x, const uint16_t *wp, const uint16_t *b, uint16_t *y,
                               int64_t M, int64_t N, int64_t K, int num_threads) {
#if defined(KVL_AVX512BF16)
    return run_tiles(2, x, wp, b, y, M, N, K, num_threads, 0);
#else
    (void)x, (void)wp, (void)b, (void)y, (void)M, (void)N, (void)K, (void)num_threads;
    return -1;
#endif
}

/* The same product with y float32: each result rounded to bfloat16 and stored as that value's
 * float32 (the LM head: sampling reads float32 logits, and the bf16 -> float32 pass over
 * [rows, vocab] cost ~2 % of a 60-decode step of the 60M model). -1 without vdpbf16ps. */
int kvl_small_gemm_bf16_packed_f32out(const uint16_t *x, const uint16_t *wp, const uint16_t *b, float *y,
                                      int64_t M, int64_t N, int64_t K, int num_threads) {
#if defined(KVL_AVX512BF16)
    return run_tiles(2, x, wp, b, y, M, N, K, num_threads, 1);
#else
    (void)x, (void)wp, (void)b, (void)y, (void)M, (void)N, (void)K, (void)num_threads;
    return -1;
#endif
}

/* ---- bfloat16, row-major (builds without vdpbf16ps) ----------------------------------------- */

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
