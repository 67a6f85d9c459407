/* The kernels one source calls from another (decoder_layer.c runs a whole layer through them).
 * Every source that defines one includes this header too, so the compiler checks that the two
 * agree (contig_decode.c's rename of kvl_paged_decode applies here as well).
 */
#ifndef KVLEDGER_KERNELS_H
#define KVLEDGER_KERNELS_H

#include <stdint.h>

int kvl_rms_norm(const float *, const float *, float *, int64_t, int64_t, float, int);
int kvl_rms_norm_bf16(const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t, float, int);
int kvl_add_rms_norm(float *, const float *, const float *, float *, int64_t, int64_t, float, int);
int kvl_add_rms_norm_bf16(uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t, float,
                          int);
int kvl_small_gemm_packed(const float *, const float *, const float *, float *, int64_t, int64_t, int64_t, int);
int kvl_small_gemm_bf16_packed(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t,
                               int64_t, int);
int kvl_small_gemm_bf16(const uint16_t *, const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t, int64_t,
                        int);
int kvl_rope_inplace(float *, int64_t, int64_t, int64_t, int64_t, const int64_t *, const float *, const float *, int);
int kvl_rope_inplace_bf16(uint16_t *, int64_t, int64_t, int64_t, int64_t, const int64_t *, const float *,
                          const float *, int);
int kvl_write_kv(const void *, const void *, int64_t, int64_t, const int64_t *, int64_t, int64_t, int64_t, void *,
                 void *, int);
int kvl_silu_mul(const float *, float *, int64_t, int64_t, int);
int kvl_silu_mul_bf16(const uint16_t *, uint16_t *, int64_t, int64_t, int);
int kvl_paged_decode(const void *, int64_t, const void *, const void *, int, int, const uint16_t *,
                     const uint16_t *, const int64_t *, int64_t, const int64_t *, const int64_t *, int64_t, void *,
                     int64_t, int, int64_t, int64_t, int64_t, int64_t, float, const int64_t *, const void *,
                     const void *, int64_t, int64_t, const void *, const void *, int64_t, int);
int kvl_paged_prefill(const void *, int64_t, const void *, const void *, int, const int64_t *, int64_t,
                      const int64_t *, const int64_t *, const int64_t *, int64_t, void *, int64_t, int, int64_t,
                      int64_t, int64_t, int64_t, float, int);
int kvl_paged_prefill_tree(const void *, int64_t, const void *, const void *, int, const int64_t *, int64_t,
                           const int64_t *, const int64_t *, const int64_t *, int64_t, void *, int64_t, int, int64_t,
                           int64_t, int64_t, int64_t, float, int, const uint64_t *);
int kvl_quantize_rows_i8(const void *, int, int8_t *, float *, int64_t, int64_t, int);
int kvl_int8_gemm(const int8_t *, const float *, const int8_t *, const float *, const int32_t *, const void *, int,
                  void *, int64_t, int64_t, int64_t, int);
int kvl_q4_quantize_act(const void *, int, int8_t *, float *, int32_t *, int64_t, int64_t, int);
int kvl_q4_gemm(const int8_t *, const float *, const int32_t *, const uint8_t *, int, int, const void *,
                const uint8_t *, const uint16_t *, const void *, int, void *, int64_t, int64_t, int64_t, int64_t, int);

#endif
