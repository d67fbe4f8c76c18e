/* The 4-bit weight-only GEMM of w4_gemm_cpu.c for x86-64 CPUs with AVX2 and FMA but no AVX-512-BF16:
 *
 *     y[m, n] = sum_k x[m, k] * scale[g, n] * (q[n, k] - zero[g, n]),   g = k / group
 *
 * on the same packed weight and meta, so one loaded model serves both (its W4A8 product, at the end of
 * this file, reads a layout of its own, w4_pack.pack_spans, with the same meta):
 *
 *     packed[b, p, c] = q[16 b + c, 2 p] | q[16 b + c, 2 p + 1] << 4      [n / 16, k / 2, 16]
 *     meta[b, g, 0 | 1, c] = scale, 128 + zero                            float32
 *
 * x comes in as float32, its odd inputs divided by 16 (exact: the caller widens x once, times
 * [1, 1/16, 1, 1/16, ...]). Eight bytes of a pair (eight columns) widen to 32-bit lanes; the even
 * input's level is the lane's low nibble, converted to float32 exactly; the odd input's is taken
 * as the lane's high nibble in place, 16 q, which the divided x undoes, so no weight is shifted.
 * A 16-column block's pair is two such widenings, four conversions and four FMAs per row. Per group the kernel sums S = sum_k x[k] q[k] in float32
 * and then folds the zero point in:
 *
 *     acc += scale[g] * (S - zero[g] * xsum[g]),    xsum[g] = sum over the group's k of x[k]
 *
 * One row (a batch-1 decode step) runs through a tile of up to four blocks in one pass (eight
 * sums in registers), the weight read once, in order. More rows go four at a time through one
 * block (eight sums, four widened weight vectors, two broadcasts: 14 of the 16 vector registers),
 * the next block prefetched into L2 by the first pass. Each output is rounded to bfloat16 once
 * (nearest even, a NaN stays a NaN). All arguments are integers (pointers as addresses).
 */
#include <immintrin.h>
#include <stdint.h>

#include "_avx2_bf16.h" /* store8 */

#define TILE 4        /* blocks of 16 columns per tile, one row */
#define ROWS 4        /* rows per pass over a block */
#define LOCAL_SUMS 1024 /* the most group sums a call computes itself (xsum_addr 0), on its stack */

/* eight columns' levels of one pair (8 bytes at w): the even input's q, and 16 times the odd one's */
#define WIDEN(even, odd16, w)                                                                  \
  do {                                                                                         \
    const __m256i v_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w)));            \
    even = _mm256_cvtepi32_ps(_mm256_and_si256(v_, _mm256_set1_epi32(0x0F)));                  \
    odd16 = _mm256_cvtepi32_ps(_mm256_and_si256(v_, _mm256_set1_epi32(0xF0)));                 \
  } while (0)

/* acc[c] += scale[c] * (s[c] - (offset[c] - 128) * xsum), eight columns of a block's meta */
static inline __attribute__((always_inline)) __m256 fold(__m256 acc, __m256 s, const float *meta, float xsum) {
  const __m256 zero = _mm256_sub_ps(_mm256_loadu_ps(meta + 16), _mm256_set1_ps(128.0f));
  return _mm256_fmadd_ps(_mm256_loadu_ps(meta), _mm256_fnmadd_ps(zero, _mm256_set1_ps(xsum), s), acc);
}

/* one row over `blocks` blocks (a tile); w and meta at the tile's first block */
static inline __attribute__((always_inline)) void tile_row(const float *x, int64_t pairs, const int blocks,
                                                          const uint8_t *w, const float *meta, int64_t groups,
                                                          int64_t group_pairs, const float *xsum, uint16_t *y) {
  __m256 acc[TILE][2];
  for (int j = 0; j < blocks; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m256 s[TILE][2];
    for (int j = 0; j < blocks; j++) s[j][0] = s[j][1] = _mm256_setzero_ps();
    for (int64_t p = g * group_pairs; p < (g + 1) * group_pairs; p++) {
      const __m256 x0 = _mm256_broadcast_ss(x + 2 * p), x1 = _mm256_broadcast_ss(x + 2 * p + 1);
      for (int j = 0; j < blocks; j++)
        for (int h = 0; h < 2; h++) {
          __m256 even, odd16;
          WIDEN(even, odd16, w + (j * pairs + p) * 16 + 8 * h);
          s[j][h] = _mm256_fmadd_ps(x1, odd16, _mm256_fmadd_ps(x0, even, s[j][h]));
        }
    }
    for (int j = 0; j < blocks; j++)
      for (int h = 0; h < 2; h++) acc[j][h] = fold(acc[j][h], s[j][h], meta + (j * groups + g) * 32 + 8 * h, xsum[g]);
  }
  for (int j = 0; j < blocks; j++) {
    store8(y + 16 * j, acc[j][0]);
    store8(y + 16 * j + 8, acc[j][1]);
  }
}

/* `rows` (1-4) rows of x (row stride k) over one block; `prefetch` (or 0): the next block's start */
static inline __attribute__((always_inline)) void block_rows(const float *x, int64_t k, const int rows,
                                                            const uint8_t *w, const float *meta, int64_t groups,
                                                            int64_t group_pairs, const float *xsum, uint16_t *y,
                                                            int64_t ldy, const char *prefetch) {
  __m256 acc[ROWS][2];
  for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m256 s[ROWS][2];
    for (int r = 0; r < rows; r++) s[r][0] = s[r][1] = _mm256_setzero_ps();
    for (int64_t p = g * group_pairs; p < (g + 1) * group_pairs; p++) {
      __m256 even0, odd0, even1, odd1;
      WIDEN(even0, odd0, w + p * 16);
      WIDEN(even1, odd1, w + p * 16 + 8);
      /* NOTE: a pair is 16 bytes: every fourth pair fetches the next block's line at the same offset */
      if (prefetch && (p & 3) == 0) _mm_prefetch(prefetch + 16 * p, _MM_HINT_T1);
      for (int r = 0; r < rows; r++) {
        const __m256 x0 = _mm256_broadcast_ss(x + r * k + 2 * p), x1 = _mm256_broadcast_ss(x + r * k + 2 * p + 1);
        s[r][0] = _mm256_fmadd_ps(x1, odd0, _mm256_fmadd_ps(x0, even0, s[r][0]));
        s[r][1] = _mm256_fmadd_ps(x1, odd1, _mm256_fmadd_ps(x0, even1, s[r][1]));
      }
    }
    for (int r = 0; r < rows; r++)
      for (int h = 0; h < 2; h++) acc[r][h] = fold(acc[r][h], s[r][h], meta + g * 32 + 8 * h, xsum[r * groups + g]);
  }
  for (int r = 0; r < rows; r++) {
    store8(y + r * ldy, acc[r][0]);
    store8(y + r * ldy + 8, acc[r][1]);
  }
}

/* xsum[r, g] = sum of x[r, k] over group g's k, float32, from the divided x (odd inputs times 16 again,
 * exact), eight lanes at a time (a group's tail pair by pair; a group starts at an even input) */
static void group_sums(const float *x, int64_t m, int64_t k, int64_t group, float *xsum) {
  const int64_t groups = k / group;
  const __m256 undo = _mm256_setr_ps(1.0f, 16.0f, 1.0f, 16.0f, 1.0f, 16.0f, 1.0f, 16.0f);
  for (int64_t r = 0; r < m; r++)
    for (int64_t g = 0; g < groups; g++) {
      const float *v = x + r * k + g * group;
      __m256 acc = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= group; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(v + i), undo, acc);
      float lanes[8];
      _mm256_storeu_ps(lanes, acc);
      float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
      for (; i < group; i += 2) sum += v[i] + 16.0f * v[i + 1];
      xsum[r * groups + g] = sum;
    }
}

/* Columns of blocks [block0, block1) of y for all m rows. x: [m, k] contiguous float32, odd inputs
 * divided by 16 (k even);
 * w, meta: packed as above; xsum: [m, k / group] float32, or 0 where m * (k / group) <= LOCAL_SUMS
 * (the call sums x's groups itself); group: even, dividing k; y: [m, n] contiguous bf16. */
void pagedllm_gemm_w4_avx2(intptr_t x_addr, int64_t m, int64_t k, intptr_t w_addr, intptr_t meta_addr,
                           intptr_t xsum_addr, int64_t group, int64_t n, int64_t block0, int64_t block1,
                           intptr_t y_addr) {
  const float *x = (const float *)x_addr;
  const uint8_t *w0 = (const uint8_t *)w_addr;
  const float *meta0 = (const float *)meta_addr;
  float local[LOCAL_SUMS];
  const float *xsum = (const float *)xsum_addr;
  if (!xsum) {
    group_sums(x, m, k, group, local);
    xsum = local;
  }
  uint16_t *y = (uint16_t *)y_addr;
  const int64_t pairs = k / 2, groups = k / group, group_pairs = group / 2;
  if (m == 1) {
    for (int64_t block = block0; block < block1; block += TILE) {
      const int blocks = (int)(block1 - block < TILE ? block1 - block : TILE);
      const uint8_t *w = w0 + block * pairs * 16;
      const float *meta = meta0 + block * groups * 32;
      switch (blocks) {
        case 1: tile_row(x, pairs, 1, w, meta, groups, group_pairs, xsum, y + 16 * block); break;
        case 2: tile_row(x, pairs, 2, w, meta, groups, group_pairs, xsum, y + 16 * block); break;
        case 3: tile_row(x, pairs, 3, w, meta, groups, group_pairs, xsum, y + 16 * block); break;
        default: tile_row(x, pairs, 4, w, meta, groups, group_pairs, xsum, y + 16 * block); break;
      }
    }
    return;
  }
  for (int64_t block = block0; block < block1; block++) {
    const uint8_t *w = w0 + block * pairs * 16;
    const float *meta = meta0 + block * groups * 32;
    const char *next = block + 1 < block1 ? (const char *)(w + pairs * 16) : 0;
    for (int64_t row = 0; row < m; row += ROWS) {
      const int rows = (int)(m - row < ROWS ? m - row : ROWS);
      const char *prefetch = row == 0 && m > ROWS ? next : 0;
      const float *xs = xsum + row * groups;
      uint16_t *out = y + row * n + 16 * block;
      switch (rows) {
        case 1: block_rows(x + row * k, k, 1, w, meta, groups, group_pairs, xs, out, n, prefetch); break;
        case 2: block_rows(x + row * k, k, 2, w, meta, groups, group_pairs, xs, out, n, prefetch); break;
        case 3: block_rows(x + row * k, k, 3, w, meta, groups, group_pairs, xs, out, n, prefetch); break;
        default: block_rows(x + row * k, k, 4, w, meta, groups, group_pairs, xs, out, n, prefetch); break;
      }
    }
  }
}

/* ---- W4A8 on AVX2: a 4-bit weight in spans times x rounded to int8 ----
 *
 * x is quantized per row and group as w4_gemm_cpu.c's pagedllm_quantize_s8 does (sx = max |x| / 127,
 * xq = round(x / sx), nearest even, in -127..127; stats [m, k / group, 2]: sx, then the sum of xq).
 * The weight comes in its own layout (w4_pack.pack_spans, same meta): span t of a block is 32 bytes
 * for inputs 4t..4t+3 of its 16 columns, byte 2c + e holding q[c, 4t + e] | q[c, 4t + 2 + e] << 4.
 * A span's low nibbles are pair 2t's levels with column c's two in 16-bit lane c, and its high
 * nibbles pair 2t + 1's. VPMADDUBSW multiplies each by x's int8 pair broadcast to every lane (a
 * two-byte broadcast load, no shuffle) and adds a column's two products in its lane; both go into
 * one 16-bit sum per column, at most 2 * 2 * 15 * 127 in size per span, so four spans (16 inputs)
 * fit before the sums widen into each column's 32-bit one (exact); per group
 *
 *     acc += scale[g] * sx[r, g] * (S - zero[g] * xqsum[r, g]),   S = sum_k q[k] xq[k]
 *
 * One row runs through a tile of four blocks; more rows go four at a time through one block.
 * NOTE: the span layout spares a byte unpack per pair of pairs and a shuffle of x per row against the
 * pairs layout of pack(): 14-23% less time per Qwen2.5-0.5B layer at 4-64 rows, where the product is
 * bound by its vector work, the same at one row (python -m benchmarks.quant_linear --kernels w4a8-tiles). */
#define SPANS_16 4 /* spans whose products a 16-bit sum holds */

static inline __attribute__((always_inline)) void tile_s8(const int8_t *xq, int64_t k, const int rows,
                                                         const int blocks, const uint8_t *w, int64_t spans,
                                                         const float *meta, int64_t groups, int64_t group_spans,
                                                         const float *xs, uint16_t *y, int64_t ldy) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  __m256 acc[ROWS][TILE][2];
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < blocks; j++) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m256i s32[ROWS][TILE][2];
    for (int r = 0; r < rows; r++)
      for (int j = 0; j < blocks; j++) s32[r][j][0] = s32[r][j][1] = _mm256_setzero_si256();
    for (int64_t t0 = g * group_spans; t0 < (g + 1) * group_spans; t0 += SPANS_16) {
      __m256i s16[ROWS][TILE];
      for (int r = 0; r < rows; r++)
        for (int j = 0; j < blocks; j++) s16[r][j] = _mm256_setzero_si256();
      for (int64_t t = t0; t < t0 + SPANS_16; t++) {
        __m256i x0[ROWS], x1[ROWS];
        for (int r = 0; r < rows; r++) {
          int16_t a, b;
          __builtin_memcpy(&a, xq + r * k + 4 * t, 2);
          __builtin_memcpy(&b, xq + r * k + 4 * t + 2, 2);
          x0[r] = _mm256_set1_epi16(a);
          x1[r] = _mm256_set1_epi16(b);
        }
        for (int j = 0; j < blocks; j++) {
          const __m256i v = _mm256_loadu_si256((const __m256i *)(w + (j * spans + t) * 32));
          const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
          for (int r = 0; r < rows; r++)
            s16[r][j] = _mm256_add_epi16(
                s16[r][j], _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0[r]), _mm256_maddubs_epi16(hi, x1[r])));
        }
      }
      for (int r = 0; r < rows; r++)
        for (int j = 0; j < blocks; j++) {
          s32[r][j][0] = _mm256_add_epi32(s32[r][j][0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(s16[r][j])));
          s32[r][j][1] = _mm256_add_epi32(s32[r][j][1], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s16[r][j], 1)));
        }
    }
    for (int r = 0; r < rows; r++) {
      const __m256 sx = _mm256_set1_ps(xs[(r * groups + g) * 2]), qsum = _mm256_set1_ps(xs[(r * groups + g) * 2 + 1]);
      for (int j = 0; j < blocks; j++)
        for (int h = 0; h < 2; h++) {
          const float *mt = meta + (j * groups + g) * 32 + 8 * h;
          const __m256 zero = _mm256_sub_ps(_mm256_loadu_ps(mt + 16), _mm256_set1_ps(128.0f));
          const __m256 folded = _mm256_fnmadd_ps(zero, qsum, _mm256_cvtepi32_ps(s32[r][j][h]));
          acc[r][j][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(mt), sx), folded, acc[r][j][h]);
        }
    }
  }
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < blocks; j++) {
      store8(y + r * ldy + 16 * j, acc[r][j][0]);
      store8(y + r * ldy + 16 * j + 8, acc[r][j][1]);
    }
}

#define CASE_S8(R, B)                                                                                      \
  case (R) * 8 + (B):                                                                                      \
    tile_s8(xq + row * k, k, R, B, w, spans, meta, groups, group_spans, xs + row * groups * 2,             \
            y + row * n + 16 * block, n);                                                                  \
    break;

/* Columns of blocks [block0, block1) of y for all m rows, from xq [m, k] int8 and xs [m, k / group, 2]
 * float32 as pagedllm_quantize_s8_avx2 writes them; w in spans (pack_spans), meta as above; group a
 * multiple of 16 dividing k; y: [m, n] contiguous bf16. */
void pagedllm_gemm_w4a8_avx2(intptr_t xq_addr, intptr_t xs_addr, int64_t m, int64_t k, intptr_t w_addr,
                             intptr_t meta_addr, int64_t group, int64_t n, int64_t block0, int64_t block1,
                             intptr_t y_addr) {
  const int8_t *xq = (const int8_t *)xq_addr;
  const float *xs = (const float *)xs_addr;
  const uint8_t *w0 = (const uint8_t *)w_addr;
  const float *meta0 = (const float *)meta_addr;
  uint16_t *y = (uint16_t *)y_addr;
  const int64_t spans = k / 4, groups = k / group, group_spans = group / 4;
  const int tile = m == 1 ? TILE : 1;
  for (int64_t block = block0; block < block1; block += tile) {
    const int blocks = (int)(block1 - block < tile ? block1 - block : tile);
    const uint8_t *w = w0 + block * spans * 32;
    const float *meta = meta0 + block * groups * 32;
    for (int64_t row = 0; row < m; row += ROWS) {
      const int rows = (int)(m - row < ROWS ? m - row : ROWS);
      switch (rows * 8 + blocks) {
        CASE_S8(1, 1) CASE_S8(1, 2) CASE_S8(1, 3) CASE_S8(1, 4)
        CASE_S8(2, 1) CASE_S8(3, 1) CASE_S8(4, 1)
      }
    }
  }
}

/* xq [m, k] int8 and xs [m, k / group, 2] float32 (sx, then the sum of the group's xq) from x [m, k]
 * bfloat16, as pagedllm_quantize_s8 rounds them (nearest even; a group of zeros gets sx = 0, xq = 0);
 * group a multiple of 16. */
void pagedllm_quantize_s8_avx2(intptr_t x_addr, int64_t m, int64_t k, int64_t group, intptr_t xq_addr,
                               intptr_t xs_addr) {
  const uint16_t *x = (const uint16_t *)x_addr;
  int8_t *xq = (int8_t *)xq_addr;
  float *xs = (float *)xs_addr;
  const int64_t groups = k / group;
  const __m256 sign = _mm256_set1_ps(-0.0f);
#define WIDEN_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
  for (int64_t r = 0; r < m; r++)
    for (int64_t g = 0; g < groups; g++) {
      const uint16_t *v = x + r * k + g * group;
      __m256 amax = _mm256_setzero_ps();
      for (int64_t i = 0; i < group; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, WIDEN_BF16(v + i)));
      float lanes[8];
      _mm256_storeu_ps(lanes, amax);
      float top = 0.0f;
      for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
      const __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
      __m256i total = _mm256_setzero_si256();
      for (int64_t i = 0; i < group; i += 16) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(WIDEN_BF16(v + i), inv));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(WIDEN_BF16(v + i + 8), inv));
        total = _mm256_add_epi32(total, _mm256_add_epi32(a, b));
        const __m256i q16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
        _mm_storeu_si128((__m128i *)(xq + r * k + g * group + i),
                         _mm_packs_epi16(_mm256_castsi256_si128(q16), _mm256_extracti128_si256(q16, 1)));
      }
      int32_t sums[8];
      _mm256_storeu_si256((__m256i *)sums, total);
      int32_t sum = 0;
      for (int i = 0; i < 8; i++) sum += sums[i];
      xs[(r * groups + g) * 2] = top / 127.0f;
      xs[(r * groups + g) * 2 + 1] = (float)sum;
    }
#undef WIDEN_BF16
}
