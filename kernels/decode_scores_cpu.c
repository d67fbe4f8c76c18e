/* Decode attention scores over a bfloat16 paged cache, for x86-64 CPUs with AVX-512-BF16:
 *
 *     scores[h, p - start] = scale * q[h] . k[p]     for the group's query heads h, start <= p < end
 *
 * (kernels/paged_decode_attention_cpu.py calls it for the first pass of a work item.) A key
 * row holds head_dim bfloat16 values, i.e. head_dim / 2 pairs. Sixteen positions of one block
 * are loaded as sixteen rows of pairs and transposed in registers (16 x 16 32-bit lanes at a
 * time), so that one vector holds pair j of all sixteen positions: one VDPBF16PS then adds
 * q[h]'s pair j (broadcast) times it into sixteen scores at once. The query heads of a KV head
 * share each transposed vector, so the block is read and transposed once for the group.
 *
 * The query arrives in float32 holding bfloat16 values (the model's dtype), so taking its high
 * 16 bits is exact; products are exact in float32 and summed in float32.
 * All arguments are integers (pointers as addresses) or a float, so any caller can bind it.
 */
#include <immintrin.h>
#include <stdint.h>

#define MAX_GROUP 16
#define MAX_PAIRS 128 /* head_dim up to 256 */
#ifndef AHEAD
#define AHEAD 2 /* chunks of 16 positions prefetched ahead */
#endif

/* rows r[0..15] (16 lanes each) -> columns c[0..15]: c[i] lane s = r[s] lane i */
static inline __attribute__((always_inline)) void transpose16(__m512i *r) {
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

/* Scores of the sixteen positions from pos (one block's slots) for G query heads, stored where
 * they fall in [start, end). G is a constant in each copy: the accumulators stay in registers. */
static inline __attribute__((always_inline)) void chunk_scores(const int G, const uint32_t (*qp)[MAX_PAIRS],
                                                              const uint16_t *rows, int64_t row_stride, int64_t pairs,
                                                              int64_t pos, int64_t start, int64_t end, __m512 scale,
                                                              float *scores, int64_t ld) {
  __m512 acc[MAX_GROUP];
  for (int h = 0; h < G; h++) acc[h] = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < pairs; j0 += 16) {
    __m512i col[16];
    for (int s = 0; s < 16; s++) col[s] = _mm512_loadu_si512(rows + s * row_stride + 2 * j0);
    transpose16(col);
    for (int j = 0; j < 16; j++)
      for (int h = 0; h < G; h++)
        acc[h] = _mm512_dpbf16_ps(acc[h], (__m512bh)_mm512_set1_epi32((int)qp[h][j0 + j]), (__m512bh)col[j]);
  }
  /* lanes of positions in [start, end) only */
  const int64_t first = pos < start ? start - pos : 0, last = end - pos < 16 ? end - pos : 16;
  const __mmask16 keep = (__mmask16)(((1u << last) - 1) & ~((1u << first) - 1));
  for (int h = 0; h < G; h++) _mm512_mask_storeu_ps(scores + h * ld + (pos - start), keep, _mm512_mul_ps(acc[h], scale));
}

#define GROUP_CASE(G)                                                                                        \
  case G:                                                                                                    \
    chunk_scores(G, qp, rows, row_stride, pairs, pos, start, end, vscale, scores, ld);                       \
    break;

/* q: [group, head_dim] float32; cache: [*, block_size, kv_heads, head_dim] bfloat16 (as uint16), a
 * block every block_stride and a slot every row_stride elements, each slot's heads contiguous;
 * table: int32 block ids; scores: [group, ld] float32, columns 0 .. end - start - 1 written.
 * head_dim a multiple of 32 (at most 256), block_size a multiple of 16, group 1 to 16. */
void pagedllm_decode_scores_bf16(intptr_t q_addr, int64_t group, intptr_t cache_addr, intptr_t table_addr,
                                 int64_t start, int64_t end, int64_t kv, int64_t block_stride, int64_t row_stride,
                                 int64_t head_dim, int64_t block_size, float scale, intptr_t scores_addr, int64_t ld) {
  const float *q = (const float *)q_addr;
  const uint16_t *cache = (const uint16_t *)cache_addr;
  const int32_t *table = (const int32_t *)table_addr;
  float *scores = (float *)scores_addr;
  const int64_t pairs = head_dim / 2;
  uint32_t qp[MAX_GROUP][MAX_PAIRS];
  for (int64_t h = 0; h < group; h++)
    for (int64_t j = 0; j < pairs; j++) {
      uint32_t lo, hi;
      __builtin_memcpy(&lo, q + h * head_dim + 2 * j, 4);
      __builtin_memcpy(&hi, q + h * head_dim + 2 * j + 1, 4);
      qp[h][j] = (lo >> 16) | (hi & 0xFFFF0000u);
    }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t pos = start - start % 16; pos < end; pos += 16) {
    const uint16_t *rows = cache + (int64_t)table[pos / block_size] * block_stride + pos % block_size * row_stride +
                           kv * head_dim;
    /* the rows of the chunk AHEAD chunks on, line by line: blocks lie anywhere in the cache, so
     * each one starts a stream the hardware prefetcher has yet to find */
    const int64_t ahead = pos + AHEAD * 16;
    if (ahead < end) {
      const char *next = (const char *)(cache + (int64_t)table[ahead / block_size] * block_stride +
                                        ahead % block_size * row_stride + kv * head_dim);
      for (int s = 0; s < 16; s++)
        for (int64_t line = 0; line < head_dim * 2; line += 64) _mm_prefetch(next + s * row_stride * 2 + line, _MM_HINT_T0);
    }
    switch (group) {
      GROUP_CASE(1) GROUP_CASE(2) GROUP_CASE(3) GROUP_CASE(4) GROUP_CASE(5) GROUP_CASE(6) GROUP_CASE(7) GROUP_CASE(8)
      GROUP_CASE(9) GROUP_CASE(10) GROUP_CASE(11) GROUP_CASE(12) GROUP_CASE(13) GROUP_CASE(14) GROUP_CASE(15)
      GROUP_CASE(16)
    }
  }
}
