/* Writes of new K/V rows into an unquantised paged cache (kvledger.storage.kv_cache.PagedKVCache).
 *
 * Row t of k and v (Hkv * D elements of the cache's dtype, rows src_stride elements apart, heads
 * packed) goes to slot slots[t] of the caches [num_slots, Hkv, D]: a copy, what torch's
 * index_copy_ does, without its per-call cost (~12 us a call, 16 calls a step: 1 % of a decode
 * step of the 60M model) and with the source rows read in place from the fused qkv output.
 * Every slot is checked before anything is written: -1 leaves the caches untouched.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

int kvl_write_kv(const void *k, const void *v, int64_t src_stride, int64_t es, const int64_t *slots, int64_t T,
                 int64_t row_elems, int64_t num_slots, void *k_cache, void *v_cache, int num_threads) {
    if (T < 0 || row_elems < 1 || (es != 2 && es != 4) || src_stride < row_elems || num_threads < 1) return -1;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    const int64_t bytes = row_elems * es;
#pragma omp parallel for num_threads(num_threads) if (T * bytes >= (1 << 20))
    for (int64_t t = 0; t < T; t++) {
        memcpy((char *)k_cache + slots[t] * bytes, (const char *)k + t * src_stride * es, bytes);
        memcpy((char *)v_cache + slots[t] * bytes, (const char *)v + t * src_stride * es, bytes);
    }
    return 0;
}
