/* Structured outputs: the argmax of a logits row over the tokens a grammar's packed bitmask
 * allows, in one read-only pass (no masked copy of the row, no second argmax).
 *
 * Bit j of 32-bit word w allows token 32 * w + j (xgrammar's packed layout). A word of zeros
 * is skipped whole, so a row whose grammar allows a handful of tokens costs a few hundred word
 * reads, not a pass over the vocabulary. Tokens past the mask's width are allowed, as
 * xgrammar's apply_token_bitmask_inplace leaves them. Equal to
 * logits.masked_fill(~allowed, -inf).argmax(): the first index of the largest allowed value,
 * index 0 when every allowed value is -inf.
 *
 * Rows are independent: with two or more of them and enough logits they are spread over
 * OpenMP threads (the intra-op pool's size, as for the other kernels), one row per iteration,
 * each writing only its own out[k], so the result does not depend on the thread count.
 */
#include <omp.h>
#include <stdint.h>

/* Below this many logits in all, threads cost more than they save (a row of a 32k vocabulary
 * takes ~10-20 us; waking the pool a few). */
#define PAR_MIN_LOGITS (1 << 16)

int kvl_masked_argmax(const float *logits, int64_t logits_stride, int64_t vocab,
                      const int32_t *mask, int64_t mask_stride, int64_t mask_words,
                      const int64_t *rows, int64_t nrows, int64_t *out, int num_threads) {
    if (vocab <= 0 || mask_words < 0 || nrows < 0) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (nrows > 1 && nrows * vocab >= PAR_MIN_LOGITS)
    for (int64_t k = 0; k < nrows; k++) {
        const float *x = logits + rows[k] * logits_stride;
        const uint32_t *m = (const uint32_t *)(mask + rows[k] * mask_stride);
        int64_t words = mask_words * 32 > vocab ? (vocab + 31) / 32 : mask_words;
        int64_t best_i = -1;
        float best = 0.0f;
        for (int64_t w = 0; w < words; w++) {
            uint32_t bits = m[w];
            while (bits) {
                int64_t t = w * 32 + __builtin_ctz(bits);
                bits &= bits - 1;
                if (t >= vocab) break;
                float v = x[t];
                if (best_i < 0 ? v > -__builtin_inff() : v > best) {
                    best = v;
                    best_i = t;
                }
            }
        }
        for (int64_t t = mask_words * 32; t < vocab; t++) { /* beyond the mask: allowed */
            float v = x[t];
            if (best_i < 0 ? v > -__builtin_inff() : v > best) {
                best = v;
                best_i = t;
            }
        }
        out[k] = best_i < 0 ? 0 : best_i;
    }
    return 0;
}
