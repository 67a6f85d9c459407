/* Walking one request's context through its block table, a token at a time, and fetching its
 * cache rows ahead of the reads. Shared by paged_decode.c (and contig_decode.c through it) and
 * paged_prefill.c, which differ only in how far ahead they fetch and into which cache level.
 *
 * The blocks of a context are scattered, so the hardware prefetcher stops at every block's end;
 * a row loop instead asks for the row a fixed number of tokens ahead, crossing into the next
 * block through the table, so rows stay in flight at all times.
 */
#ifndef KVLEDGER_KV_WALK_H
#define KVLEDGER_KV_WALK_H

#include <immintrin.h>
#include <stdint.h>

/* Which block holds a request's blk-th block of context. contig_decode.c includes paged_decode.c
 * with KVL_CONTIGUOUS defined, turning it into the contiguous reference kernel: each request's
 * blocks are one run starting at table[0], so the address is affine in blk and no table entry is
 * read per block. Keep every block lookup behind this. */
#ifdef KVL_CONTIGUOUS
#define BLOCK_ID(table, blk) (table[0] + (blk))
#else
#define BLOCK_ID(table, blk) (table[blk])
#endif

/* Token t of the context is row j of the table's block blk; advanced one token per call, so the
 * row loops divide by the block size only once. */
typedef struct {
    int64_t blk, j, t;
} kv_walk_t;

static inline kv_walk_t kv_walk_at(int64_t t, int64_t bs) { return (kv_walk_t){t / bs, t % bs, t}; }

/* The cache slot (block id * bs + row) of token w->t; then w moves to the next token. */
static inline int64_t kv_walk_next(kv_walk_t *w, const int64_t *table, int64_t bs) {
    const int64_t slot = BLOCK_ID(table, w->blk) * bs + w->j;
    if (++w->j == bs) {
        w->j = 0;
        w->blk++;
    }
    w->t++;
    return slot;
}

/* A walker `pd` tokens ahead of a row loop that starts at token 0 and calls kv_prefetch_next once
 * per token, in order. */
static inline kv_walk_t kv_ahead_start(int64_t pd, int64_t bs) { return kv_walk_at(pd, bs); }

/* Prefetch `bytes` at `off` of the cache row of token w->t when it lies inside the context
 * (w->t < len), every line into L1 (l1) or L2; then advance. Returns that row's slot, or -1
 * past the context. */
static inline __attribute__((always_inline)) int64_t kv_prefetch_next(kv_walk_t *w, int64_t len, const char *cache,
                                                                      const int64_t *table, int64_t bs, int64_t row,
                                                                      int64_t off, int64_t bytes, const int l1) {
    if (w->t >= len) {
        w->t++; /* past the context: nothing to fetch, and no table entry to read */
        return -1;
    }
    const int64_t slot = kv_walk_next(w, table, bs);
    const char *p = cache + slot * row + off;
    for (int64_t b = 0; b < bytes; b += 64) {
        if (l1)
            _mm_prefetch(p + b, _MM_HINT_T0);
        else
            _mm_prefetch(p + b, _MM_HINT_T1);
    }
    return slot;
}

#endif
