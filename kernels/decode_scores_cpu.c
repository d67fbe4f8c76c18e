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
 * The whole work item (pagedllm_decode_attention_*) also reads 8-bit caches (kernels/kv_quant.py),
 * as kernels/prefill_attention_cpu.c does: every int8, e4m3 and e5m2 value is exact in bfloat16,
 * so K is widened to bfloat16 pairs as it is loaded and scored as above; an int8 row's float16
 * scale multiplies its lane of the chunk's sixteen scores, and its V row as it is widened to
 * float32 (exact). fp8's per-tensor k_scale is the caller's, in `scale`, and its v_scale in
 * `out_scale` (e4m3 widens to its value / 256, which the caller folds into both). Each format is
 * its own copy (the format a constant): the loops hold no format branch.
 * All arguments are integers (pointers as addresses) or a float, so any caller can bind it.
 */
#include <immintrin.h>
#include <stdint.h>

#include "_cpu_attention.h" /* formats, widening, transpose16 */

/* A library exports the work items its build asks for (-DITEM_BF16, -DITEM_INT8, ...; all of them
 * when none is named; the scores pass goes with bfloat16's): each copy's tiles take seconds to
 * compile, and a process needs only its cache's. */
#if !defined(ITEM_BF16) && !defined(ITEM_INT8) && !defined(ITEM_E4M3) && !defined(ITEM_E5M2)
#define ITEM_BF16
#define ITEM_INT8
#define ITEM_E4M3
#define ITEM_E5M2
#endif

#define MAX_GROUP 16
#define MAX_PAIRS 128 /* head_dim up to 256 */
#ifndef AHEAD
#define AHEAD 2 /* chunks of 16 positions prefetched ahead */
#endif
#ifndef FAR
#define FAR 6 /* chunks ahead whose first row is prefetched alone, to bring its page's translation in */
#endif

/* Blocks lie anywhere in a cache of hundreds of MB, each in pages of its own: the first read of a
 * block misses the TLB, and a prefetch that waits for the page walk comes late. One line of the
 * chunk FAR chunks on starts that walk early (Qwen2.5-0.5B shape, bfloat16, 2 threads, five
 * alternating pairs of runs: 6-16% less time a call at batch 16 and contexts ~1000, 0-20% at ~200). */
static inline void prefetch_far(const uint8_t *cache, const int32_t *table, int64_t pos, int64_t end, int64_t off,
                                int64_t block_stride, int64_t row_stride, int64_t block_size) {
  const int64_t far = pos + FAR * 16;
  if (far < end)
    _mm_prefetch((const char *)(cache + (int64_t)table[far / block_size] * block_stride + far % block_size * row_stride +
                                off),
                 _MM_HINT_T0);
}


/* bytes of one (slot, head) row: int8 rows end with their float16 scale */
ALWAYS int64_t row_bytes(int64_t head_dim, const int fmt) {
  return fmt == BF16 ? 2 * head_dim : fmt == INT8 ? head_dim + 2 : head_dim;
}

/* Scores of the sixteen positions from pos (one block's slots) for G query heads, stored where
 * they fall in [start, end). G is a constant in each copy: the accumulators stay in registers. */
static inline __attribute__((always_inline)) void chunk_scores(const int G, const uint32_t (*qp)[MAX_PAIRS],
                                                              const uint8_t *rows, int64_t row_stride, int64_t pairs,
                                                              int64_t pos, int64_t start, int64_t end, __m512 scale,
                                                              float *scores, int64_t ld, const int fmt) {
  __m512 acc[MAX_GROUP];
  for (int h = 0; h < G; h++) acc[h] = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < pairs; j0 += 16) {
    __m512i col[16];
    for (int s = 0; s < 16; s++) col[s] = load_pairs(rows + s * row_stride, 2 * j0, fmt);
    transpose16(col);
    for (int j = 0; j < 16; j++)
      for (int h = 0; h < G; h++)
        acc[h] = _mm512_dpbf16_ps(acc[h], (__m512bh)_mm512_set1_epi32((int)qp[h][j0 + j]), (__m512bh)col[j]);
  }
  /* lanes of positions in [start, end) only */
  const int64_t first = pos < start ? start - pos : 0, last = end - pos < 16 ? end - pos : 16;
  const __mmask16 keep = (__mmask16)(((1u << last) - 1) & ~((1u << first) - 1));
  if (fmt == INT8) { /* each position's row scale, lane by lane (slots outside the range: masked out) */
    uint16_t bits[16];
    for (int s = 0; s < 16; s++) memcpy(bits + s, rows + s * row_stride + 2 * pairs, 2);
    scale = _mm512_mul_ps(scale, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)bits)));
  }
  for (int h = 0; h < G; h++) _mm512_mask_storeu_ps(scores + h * ld + (pos - start), keep, _mm512_mul_ps(acc[h], scale));
}

#define GROUP_CASE(G)                                                                                        \
  case G:                                                                                                    \
    chunk_scores(G, qp, rows, row_stride, pairs, pos, start, end, vscale, scores, ld, fmt);                  \
    break;

/* q: [group, head_dim] float32; cache: [*, block_size, kv_heads, row] of format fmt, a block every
 * block_stride and a slot every row_stride bytes, each slot's heads contiguous (row_bytes each);
 * table: int32 block ids; scores: [group, ld] float32, columns 0 .. end - start - 1 written.
 * head_dim a multiple of 32 (at most 256), block_size a multiple of 16, group 1 to 16. */
ALWAYS void scores_kv(const float *q, const uint16_t *q16, int64_t group, const uint8_t *cache, const int32_t *table,
                      int64_t start, int64_t end, int64_t kv, int64_t block_stride, int64_t row_stride,
                      int64_t head_dim, int64_t block_size, float scale, float *scores, int64_t ld, const int fmt) {
  const int64_t pairs = head_dim / 2, head = row_bytes(head_dim, fmt);
  uint32_t qp[MAX_GROUP][MAX_PAIRS];
  for (int64_t h = 0; h < group; h++)
    for (int64_t j = 0; j < pairs; j++) {
      uint32_t lo, hi;
      if (q16) { /* the query's own bfloat16 bits (q unused) */
        qp[h][j] = (uint32_t)q16[h * head_dim + 2 * j] | (uint32_t)q16[h * head_dim + 2 * j + 1] << 16;
        continue;
      }
      __builtin_memcpy(&lo, q + h * head_dim + 2 * j, 4);
      __builtin_memcpy(&hi, q + h * head_dim + 2 * j + 1, 4);
      qp[h][j] = (lo >> 16) | (hi & 0xFFFF0000u);
    }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t pos = start - start % 16; pos < end; pos += 16) {
    const uint8_t *rows = cache + (int64_t)table[pos / block_size] * block_stride + pos % block_size * row_stride +
                          kv * head;
    /* the rows of the chunk AHEAD chunks on, line by line: blocks lie anywhere in the cache, so
     * each one starts a stream the hardware prefetcher has yet to find */
    prefetch_far(cache, table, pos, end, kv * head, block_stride, row_stride, block_size);
    const int64_t ahead = pos + AHEAD * 16;
    if (ahead < end) {
      const char *next = (const char *)(cache + (int64_t)table[ahead / block_size] * block_stride +
                                        ahead % block_size * row_stride + kv * head);
      for (int s = 0; s < 16; s++)
        for (int64_t line = 0; line < head; line += 64) _mm_prefetch(next + s * row_stride + line, _MM_HINT_T0);
    }
    switch (group) {
      GROUP_CASE(1) GROUP_CASE(2) GROUP_CASE(3) GROUP_CASE(4) GROUP_CASE(5) GROUP_CASE(6) GROUP_CASE(7) GROUP_CASE(8)
      GROUP_CASE(9) GROUP_CASE(10) GROUP_CASE(11) GROUP_CASE(12) GROUP_CASE(13) GROUP_CASE(14) GROUP_CASE(15)
      GROUP_CASE(16)
    }
  }
}

/* the scores pass over a bfloat16 cache: strides in elements */
#ifdef ITEM_BF16
void pagedllm_decode_scores_bf16(intptr_t q_addr, int64_t group, intptr_t cache_addr, intptr_t table_addr,
                                 int64_t start, int64_t end, int64_t kv, int64_t block_stride, int64_t row_stride,
                                 int64_t head_dim, int64_t block_size, float scale, intptr_t scores_addr, int64_t ld) {
  scores_kv((const float *)q_addr, 0, group, (const uint8_t *)cache_addr, (const int32_t *)table_addr, start, end, kv,
            2 * block_stride, 2 * row_stride, head_dim, block_size, scale, (float *)scores_addr, ld, BF16);
}
#endif

/* ---- the rest of a work item: softmax, then the weighted sum of the value rows ---- */

/* exp of sixteen float32, the polynomial of kernels/_fast_exp.py (Cephes' expf) in the same steps */
static inline __attribute__((always_inline)) __m512 exp16(__m512 x) {
  const __mmask16 big = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72284f), _CMP_GT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.72284f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.442695f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  /* 2^n as 2^(n - 1) * 2: n reaches 128 where exp(x) is still below the float32 maximum */
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(126)), 23);
  const __m512 out = _mm512_mul_ps(_mm512_mul_ps(y, _mm512_castsi512_ps(bits)), _mm512_set1_ps(2.0f));
  return _mm512_mask_blend_ps(big, out, _mm512_set1_ps(__builtin_inff()));
}

static inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

/* in place: row[0 .. n - 1] (n >= 1) becomes exp(row - max) / sum, summed in float32 */
static void softmax_row(float *row, int64_t n) {
  __m512 top = _mm512_set1_ps(-__builtin_inff());
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, row + i));
  }
  const __m512 vtop = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + i), vtop));
    _mm512_mask_storeu_ps(row + i, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(row + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + i), inv));
  }
}

/* start the reads of the sixteen rows (one KV head's, head bytes each) of the chunk at pos, if it holds a position before end */
static inline void prefetch_chunk(const uint8_t *cache, const int32_t *table, int64_t pos, int64_t end, int64_t off,
                                  int64_t block_stride, int64_t row_stride, int64_t head, int64_t block_size) {
  if (pos >= end) return;
  const char *rows = (const char *)(cache + (int64_t)table[pos / block_size] * block_stride + pos % block_size * row_stride + off);
  for (int s = 0; s < 16; s++)
    for (int64_t line = 0; line < head; line += 64) _mm_prefetch(rows + s * row_stride + line, _MM_HINT_T0);
}

/* the first line of each chunk of positions start .. end - 1 (one KV head's rows, off bytes into a
 * slot): every page walk of the range starts at once and overlaps the work, where the prefetches
 * ahead would each wait for its own (Qwen2.5-0.5B shape, bfloat16, 2 threads, three alternating
 * pairs of runs: 13-14% less time a call at batch 16 and contexts ~1000, 1-10% at ~200) */
static void prefetch_first_lines(const uint8_t *cache, const int32_t *table, int64_t start, int64_t end, int64_t off,
                                 int64_t block_stride, int64_t row_stride, int64_t block_size) {
  for (int64_t pos = start - start % 16; pos < end; pos += 16)
    _mm_prefetch((const char *)(cache + (int64_t)table[pos / block_size] * block_stride + pos % block_size * row_stride +
                                off),
                 _MM_HINT_T0);
}

/* out[h, d0 .. d0 + 16 T - 1] = sum over positions p in [start, end) of probs[h, p - start] * v[p, d]
 * for the G query heads of one KV head (whose row starts off bytes into a slot). A value row is
 * widened exactly (bfloat16 bits shifted left 16; 8-bit values as widen16, an int8 row times its
 * scale) and the sums are float32: G x T accumulators stay in registers, each probability is
 * broadcast from memory. G, T and the format are constants in each copy. */
ALWAYS void values_tile(const int G, const int T, const float *probs, int64_t ld, const uint8_t *cache,
                        const int32_t *table, int64_t start, int64_t end, int64_t off, int64_t d0, int64_t block_stride,
                        int64_t row_stride, int64_t head_dim, int64_t block_size, float *out, const int fmt) {
  __m512 acc[MAX_GROUP][16];
  for (int h = 0; h < G; h++)
    for (int t = 0; t < T; t++) acc[h][t] = _mm512_setzero_ps();
  for (int64_t pos = start - start % 16; pos < end; pos += 16) {
    const uint8_t *rows = cache + (int64_t)table[pos / block_size] * block_stride + pos % block_size * row_stride + off;
    if (d0 == 0) {
      prefetch_far(cache, table, pos, end, off, block_stride, row_stride, block_size);
      prefetch_chunk(cache, table, pos + AHEAD * 16, end, off, block_stride, row_stride, row_bytes(head_dim, fmt),
                     block_size);
    }
    const int64_t first = pos < start ? start - pos : 0, last = end - pos < 16 ? end - pos : 16;
    const float *p = probs + (pos - start);
    for (int64_t s = first; s < last; s++) {
      const uint8_t *row = rows + s * row_stride;
      const __m512 r = fmt == INT8 ? row_scale(row, head_dim) : _mm512_set1_ps(1.0f);
      for (int t = 0; t < T; t++) {
        __m512 v;
        if (fmt == BF16) {
          const __m256i raw = _mm256_loadu_si256((const __m256i *)(row + 2 * (d0 + 16 * t)));
          v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
        } else {
          v = widen16(row + d0 + 16 * t, fmt);
          if (fmt == INT8) v = _mm512_mul_ps(v, r); /* int8 x float16: exact in float32 */
        }
        for (int h = 0; h < G; h++) acc[h][t] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * ld + s]), v, acc[h][t]);
      }
    }
  }
  for (int h = 0; h < G; h++)
    for (int t = 0; t < T; t++) _mm512_storeu_ps(out + h * head_dim + d0 + 16 * t, acc[h][t]);
}

#define MAX_ACC 28 /* accumulators a tile may keep in the 32 vector registers */
#define TILE(G, T)                                                                                                  \
  case T:                                                                                                           \
    for (int64_t d0 = 0; d0 < head_dim; d0 += 16 * T)                                                               \
      values_tile(G, T, probs, ld, cache, table, start, end, off, d0, block_stride, row_stride, head_dim, block_size, \
                  out, fmt);                                                                                        \
    break;
#define TILES_1(G) TILE(G, 1)
#define TILES_2(G) TILES_1(G) TILE(G, 2)
#define TILES_4(G) TILES_2(G) TILE(G, 4)
#define TILES_8(G) TILES_4(G) TILE(G, 8)
#define TILES_16(G) TILES_8(G) TILE(G, 16)
#define VALUES_CASE(G, TILES) \
  case G:                     \
    switch (tile) { TILES(G) } \
    break;

/* the weighted sum for one KV head's group of query heads, in tiles of head_dim that fit the registers */
ALWAYS void values_kv(int64_t group, const float *probs, int64_t ld, const uint8_t *cache, const int32_t *table,
                      int64_t start, int64_t end, int64_t off, int64_t block_stride, int64_t row_stride,
                      int64_t head_dim, int64_t block_size, float *out, const int fmt) {
  const int64_t vectors = head_dim / 16;
  int64_t tile = 1; /* the widest power-of-two tile that divides the row and fits MAX_ACC accumulators */
  while (vectors % (2 * tile) == 0 && group * 2 * tile <= MAX_ACC) tile *= 2;
  switch (group) {
    VALUES_CASE(1, TILES_16) VALUES_CASE(2, TILES_8) VALUES_CASE(3, TILES_8) VALUES_CASE(4, TILES_4)
    VALUES_CASE(5, TILES_4) VALUES_CASE(6, TILES_4) VALUES_CASE(7, TILES_4) VALUES_CASE(8, TILES_2)
    VALUES_CASE(9, TILES_2) VALUES_CASE(10, TILES_2) VALUES_CASE(11, TILES_2) VALUES_CASE(12, TILES_2)
    VALUES_CASE(13, TILES_2) VALUES_CASE(14, TILES_2) VALUES_CASE(15, TILES_1) VALUES_CASE(16, TILES_1)
  }
}

/* float32 times factor -> bfloat16 bits, rounded to nearest even as torch rounds (NaN -> 0x7FC0) */
static void round_to_bf16(const float *x, float factor, uint16_t *out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i bits = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(factor)));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(_mm512_castsi512_ps(bits), _mm512_castsi512_ps(bits), _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtepi32_epi16(r));
  }
}

/* One work item of decode attention over a cache of format fmt: for each of its KV heads kv0, kv0 + 1, ...
 * the scores of its group of query heads (as scores_kv), their softmax, and the weighted sum of the
 * value rows, for positions start .. end - 1, times out_scale, rounded to bfloat16 once.
 * q, out: [heads, head_dim] bfloat16 (as uint16); k/v caches as in scores_kv (strides in bytes),
 * each with its own strides; scratch: group * (end - start) float32. heads a multiple of group; an
 * empty range gives zeros. */
ALWAYS void attention_item(intptr_t q_addr, int64_t heads, int64_t group, intptr_t k_addr, intptr_t v_addr,
                           intptr_t table_addr, int64_t start, int64_t end, int64_t kv0, int64_t k_block_stride,
                           int64_t k_row_stride, int64_t v_block_stride, int64_t v_row_stride, int64_t head_dim,
                           int64_t block_size, float scale, float out_scale, intptr_t scratch_addr, intptr_t out_addr,
                           const int fmt) {
  const uint16_t *q = (const uint16_t *)q_addr;
  const uint8_t *k = (const uint8_t *)k_addr, *v = (const uint8_t *)v_addr;
  const int32_t *table = (const int32_t *)table_addr;
  float *scratch = (float *)scratch_addr, sums[MAX_GROUP * 2 * MAX_PAIRS];
  uint16_t *out = (uint16_t *)out_addr;
  const int64_t ld = end - start, head = row_bytes(head_dim, fmt);
  if (ld <= 0) {
    for (int64_t i = 0; i < heads * head_dim; i++) out[i] = 0;
    return;
  }
  for (int64_t g = 0; g < heads / group; g++) {
    const int64_t kv = kv0 + g;
    prefetch_first_lines(k, table, start, end, kv * head, k_block_stride, k_row_stride, block_size);
    prefetch_first_lines(v, table, start, end, kv * head, v_block_stride, v_row_stride, block_size);
    scores_kv(0, q + g * group * head_dim, group, k, table, start, end, kv, k_block_stride, k_row_stride, head_dim,
              block_size, scale, scratch, ld, fmt);
    /* the first value chunks come in while the softmax runs */
    for (int a = 0; a < AHEAD; a++)
      prefetch_chunk(v, table, start - start % 16 + 16 * a, end, kv * head, v_block_stride, v_row_stride, head,
                     block_size);
    for (int64_t h = 0; h < group; h++) softmax_row(scratch + h * ld, ld);
    values_kv(group, scratch, ld, v, table, start, end, kv * head, v_block_stride, v_row_stride, head_dim, block_size,
              sums, fmt);
    round_to_bf16(sums, out_scale, out + g * group * head_dim, group * head_dim);
  }
}

/* the exported copies, one per cache format: the arguments of attention_item, without fmt */
#define ITEM(name, fmt)                                                                                             \
  void name(intptr_t q, int64_t heads, int64_t group, intptr_t k, intptr_t v, intptr_t table, int64_t start,        \
            int64_t end, int64_t kv0, int64_t kbs, int64_t krs, int64_t vbs, int64_t vrs, int64_t head_dim,         \
            int64_t block_size, float scale, float out_scale, intptr_t scratch, intptr_t out) {                     \
    attention_item(q, heads, group, k, v, table, start, end, kv0, kbs, krs, vbs, vrs, head_dim, block_size, scale,  \
                   out_scale, scratch, out, fmt);                                                                   \
  }
#ifdef ITEM_BF16
ITEM(pagedllm_decode_attention_bf16, BF16)
#endif
#ifdef ITEM_INT8
ITEM(pagedllm_decode_attention_int8, INT8)
#endif
#ifdef ITEM_E4M3
ITEM(pagedllm_decode_attention_e4m3, E4M3)
#endif
#ifdef ITEM_E5M2
ITEM(pagedllm_decode_attention_e5m2, E5M2)
#endif
