/* What the CPU attention kernels (decode_scores_cpu.c, prefill_attention_cpu.c) share: the
 * cache formats, their exact widening, and the in-register transpose that lets VDPBF16PS score
 * sixteen key positions at once. Included by both; kernels/_cpu_compile.py hashes it with each
 * source, so a change here rebuilds both. Needs AVX-512 F/BW/VL, BF16 and F16C. */
#ifndef PAGEDLLM_CPU_ATTENTION_H
#define PAGEDLLM_CPU_ATTENTION_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

enum { BF16, INT8, E4M3, E5M2 }; /* cache formats: the `fmt` constant of each compiled copy */
#define ALWAYS static inline __attribute__((always_inline))

/* rows r[0..15] (16 lanes each) -> columns c[0..15]: c[i] lane s = r[s] lane i */
ALWAYS void transpose16(__m512i *r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  /* u[4 i + c], 128-bit lane L: column 4 L + c of rows 4 i .. 4 i + 3 */
  for (int c = 0; c < 4; c++) {
    __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

/* 16 8-bit values -> float32, exactly (e4m3: value / 256, its bits moved into a float16's) */
ALWAYS __m512 widen16(const uint8_t *p, const int fmt) {
  const __m128i b = _mm_loadu_si128((const __m128i *)p);
  if (fmt == INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  __m256i h = _mm256_cvtepu8_epi16(b);
  if (fmt == E4M3)
    h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8),
                        _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7F)), 7));
  else
    h = _mm256_slli_epi16(h, 8); /* e5m2: the high byte of a float16 */
  return _mm512_cvtph_ps(h);
}

/* 32 values from element e of a row as 16 bfloat16 pairs (the order a bfloat16 row holds them) */
ALWAYS __m512i load_pairs(const uint8_t *row, int64_t e, const int fmt) {
  if (fmt == BF16) return _mm512_loadu_si512(row + 2 * e);
  return (__m512i)_mm512_cvtne2ps_pbh(widen16(row + e + 16, fmt), widen16(row + e, fmt));
}

/* an int8 row's float16 scale (the 2 bytes after its head_dim values), in every lane */
ALWAYS __m512 row_scale(const uint8_t *row, int64_t head_dim) {
  uint16_t bits;
  memcpy(&bits, row + head_dim, 2);
  return _mm512_cvtph_ps(_mm256_set1_epi16((short)bits));
}

#endif
