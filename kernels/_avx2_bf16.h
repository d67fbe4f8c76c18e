/* What the AVX2 kernels (bf16_gemm_avx2.c, w4_gemm_avx2.c) share: rounding float32 sums to bfloat16. */
#ifndef PAGEDLLM_AVX2_BF16_H
#define PAGEDLLM_AVX2_BF16_H
#include <immintrin.h>
#include <stdint.h>

/* eight float32 sums rounded to bfloat16 (nearest even; NaN as the quiet NaN 0x7FC0) */
static inline __attribute__((always_inline)) void store8(uint16_t *y, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128((__m128i *)y, _mm256_castsi256_si128(packed));
}

#endif
