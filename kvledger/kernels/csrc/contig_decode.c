/* Contiguous reference for the paged decode kernel: the price of indirection, measured.
 *
 * This is paged_decode.c compiled a second time with KVL_CONTIGUOUS: the same loops (scores,
 * softmax, V sum, prefetches, block-sized chunks, GQA grouping, thread split) over a cache where
 * each request's context is one contiguous run of blocks beginning at block_tables[b, 0]. The
 * only difference is the block address: first block + blk (affine, no per-block load) instead
 * of block_tables[b, blk] (one load per block, and an address that depends on it). Used by
 * benchmarks/seed_paging.py and tests only; the engine always runs kvl_paged_decode.
 *
 * Exports kvl_contig_decode with kvl_paged_decode's signature; only block_tables[b, 0] is read.
 */
#define KVL_CONTIGUOUS 1
#define kvl_paged_decode kvl_contig_decode
#include "paged_decode.c"
