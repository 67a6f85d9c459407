/* One whole decoder layer of the plain Llama family in one call (kvledger.kernels.fused_layer).
 *
 * The layer is the sequence of kernels the Python modules call one by one, in the same order
 * and on the same arguments: RMSNorm, the fused qkv product, RoPE on q and k in place, the K/V
 * write, decode and prefill attention over the paged cache, the o product, the residual add
 * with the second RMSNorm, the gate/up product, SiLU-and-mul, the down product and the last
 * residual add. So its results are the modules' bit for bit; what it removes is the Python
 * between the kernels (module calls, argument checks, allocations): ~15 us a kernel, run with
 * the interpreter's data evicted by the weights each kernel streams. The caller decides that
 * every product of the step takes the native row-wise kernel and that attention needs nothing
 * but the two native kernels; anything else runs through the modules.
 *
 * Structs are filled by the caller: one per layer (weights, cache), one per step (positions,
 * slots, attention plan, scratch buffers of the step's rows).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd.h"

/* A weight as native.GemmWeight holds it (kind 0: blocked (packed) or row-major [n, k]), or a
 * quantised one: kind 1 W8A8 (int8_gemm.c's tiles, scale: float32 per row, aux: int32 code sums),
 * kind 2 q4_gemm.c's tiles (``fmt``, and its scale, aux (wz) and sup (wsup) arguments), kind 3
 * pieces of kind 2 (``parts``, of different formats) writing consecutive column ranges of one
 * output. */
typedef struct kvl_gemm {
    const void *w, *bias; /* bias: NULL or n elements */
    int64_t n, k;
    int64_t blocked;
    int64_t kind, fmt; /* fmt: kind 2's format (q4_gemm.c) */
    const void *scale, *aux;
    const uint16_t *sup; /* kind 2: the K-quants' fp16 scales per 256 columns, or NULL */
    const struct kvl_gemm *parts; /* kind 3: nparts pieces, their n summing to n */
    int64_t nparts;
    int64_t sgs; /* kind 2: a scale per 2^sgs groups of 32 (q4_gemm.c) */
} kvl_gemm_t;

typedef struct {
    const void *norm1, *norm2; /* RMSNorm weights [hidden] */
    kvl_gemm_t qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [num_slots, Hkv, D] */
    int64_t num_slots;
    float eps, scale;
} kvl_layer_t;

typedef struct {
    int64_t T, elem; /* rows, ELEM_F32 or ELEM_BF16 */
    int64_t H, Hkv, D, bs, inter;
    const int64_t *positions, *slots; /* [T] */
    const float *cos, *sin;           /* RoPE tables [max_positions, D] */
    /* decode: nd requests (rows, tables, seq_lens); prefill: np chunks (row0, nrows, ...) */
    int64_t nd, d_stride;
    const int64_t *d_rows, *d_tables, *d_seq_lens;
    int64_t np, p_stride;
    const int64_t *p_row0, *p_nrows, *p_tables, *p_seq_lens;
    int64_t threads, d_threads, p_threads;
    void *x, *qkv, *attn, *gu, *act, *tmp; /* scratch, T rows each */
} kvl_step_t;

/* A quantised product as the modules run it (quant_int8.int8_linear, quant_q4.q4_linear): the
 * activations quantised, then the integer kernel (each piece's, into its columns, for kind 3). */
static int quantised_gemm(const kvl_gemm_t *g, int elem, const void *x, void *y, int64_t m, int threads) {
    const int bf16 = elem == ELEM_BF16;
    const int64_t K = g->k, groups = K / 32;
    int rc = -1;
    int8_t *q = malloc((size_t)(m * K));
    float *s = malloc(sizeof(float) * (size_t)(m * (g->kind == 1 ? 1 : groups)));
    int32_t *sums = g->kind != 1 ? malloc(sizeof(int32_t) * (size_t)(m * groups)) : NULL;
    if (q && s && (g->kind == 1 || sums)) {
        if (g->kind == 1) {
            rc = kvl_quantize_rows_i8(x, bf16, q, s, m, K, threads) ||
                 kvl_int8_gemm(q, s, g->w, g->scale, g->aux, g->bias, bf16, y, m, g->n, K, threads);
        } else {
            rc = kvl_q4_quantize_act(x, bf16, q, s, sums, m, K, threads);
            const kvl_gemm_t *ps = g->kind == 3 ? g->parts : g;
            const int64_t np = g->kind == 3 ? g->nparts : 1;
            for (int64_t i = 0, col = 0; i < np && rc == 0; col += ps[i].n, i++)
                rc = kvl_q4_gemm(q, s, sums, ps[i].w, (int)ps[i].fmt, (int)ps[i].sgs, ps[i].scale, ps[i].aux, ps[i].sup,
                                 ps[i].bias, bf16, (char *)y + col * (bf16 ? 2 : 4), g->n, m, ps[i].n, K, threads);
        }
    }
    free(q);
    free(s);
    free(sums);
    return rc;
}

static int gemm(const kvl_gemm_t *g, int elem, const void *x, void *y, int64_t m, int threads) {
    if (g->kind != 0) return quantised_gemm(g, elem, x, y, m, threads);
    if (elem == ELEM_F32) return kvl_small_gemm_packed(x, g->w, g->bias, y, m, g->n, g->k, threads);
    if (g->blocked) return kvl_small_gemm_bf16_packed(x, g->w, g->bias, y, m, g->n, g->k, threads);
    return kvl_small_gemm_bf16(x, g->w, g->bias, y, m, g->n, g->k, threads);
}

/* h [T, hidden] in the model dtype, updated in place to the layer's output. 0, or the 1-based
 * index of the kernel that refused its arguments (nothing after it ran). */
int kvl_decoder_layer(const kvl_layer_t *L, const kvl_step_t *S, void *h) {
    const int e = (int)S->elem, th = (int)S->threads;
    const int64_t T = S->T, hidden = L->qkv.k, D = S->D, es = e == ELEM_BF16 ? 2 : 4;
    const int64_t q_size = S->H * D, kv_size = S->Hkv * D, width = q_size + 2 * kv_size;
    char *qkv = S->qkv;
    if (e != ELEM_F32 && e != ELEM_BF16) return 1;
    if ((e == ELEM_F32 ? kvl_rms_norm(h, L->norm1, S->x, T, hidden, L->eps, th)
                       : kvl_rms_norm_bf16(h, L->norm1, S->x, T, hidden, L->eps, th)) != 0)
        return 1;
    if (gemm(&L->qkv, e, S->x, qkv, T, th) != 0) return 2;
    if ((e == ELEM_F32 ? kvl_rope_inplace((float *)qkv, T, width, S->H + S->Hkv, D, S->positions, S->cos, S->sin, th)
                       : kvl_rope_inplace_bf16((uint16_t *)qkv, T, width, S->H + S->Hkv, D, S->positions, S->cos,
                                               S->sin, th)) != 0)
        return 3;
    if (kvl_write_kv(qkv + q_size * es, qkv + (q_size + kv_size) * es, width, es, S->slots, T, kv_size,
                     L->num_slots, L->k_cache, L->v_cache, th) != 0)
        return 4;
    if (S->nd > 0 &&
        kvl_paged_decode(qkv, width, L->k_cache, L->v_cache, e, e, NULL, NULL, S->d_tables, S->d_stride,
                         S->d_seq_lens, S->d_rows, S->nd, S->attn, q_size, e, S->H, S->Hkv, D, S->bs, L->scale,
                         NULL, NULL, NULL, 0, 0, NULL, NULL, 0, (int)S->d_threads) != 0)
        return 5;
    if (S->np > 0 &&
        kvl_paged_prefill(qkv, width, L->k_cache, L->v_cache, e, S->p_tables, S->p_stride, S->p_seq_lens,
                          S->p_row0, S->p_nrows, S->np, S->attn, q_size, e, S->H, S->Hkv, D, S->bs, L->scale,
                          (int)S->p_threads) != 0)
        return 6;
    if (gemm(&L->o, e, S->attn, S->tmp, T, th) != 0) return 7;
    if ((e == ELEM_F32 ? kvl_add_rms_norm(h, S->tmp, L->norm2, S->x, T, hidden, L->eps, th)
                       : kvl_add_rms_norm_bf16(h, S->tmp, L->norm2, S->x, T, hidden, L->eps, th)) != 0)
        return 8;
    if (gemm(&L->gate_up, e, S->x, S->gu, T, th) != 0) return 9;
    if ((e == ELEM_F32 ? kvl_silu_mul(S->gu, S->act, T, S->inter, th)
                       : kvl_silu_mul_bf16(S->gu, S->act, T, S->inter, th)) != 0)
        return 10;
    if (gemm(&L->down, e, S->act, S->tmp, T, th) != 0) return 11;
    if ((e == ELEM_F32 ? kvl_add_rms_norm(h, S->tmp, NULL, NULL, T, hidden, L->eps, th)
                       : kvl_add_rms_norm_bf16(h, S->tmp, NULL, NULL, T, hidden, L->eps, th)) != 0)
        return 12;
    return 0;
}
