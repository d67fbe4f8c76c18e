/* The bfloat16 GEMM of bf16_gemm_cpu.c for x86-64 CPUs with AVX2 and FMA but no AVX-512-BF16:
 * y[m, n] = x[m, k] @ w[n, k]^T (+ bias), the weight in the same packed layout,
 *
 *     packed[b, p, c, i] = w[16 b + c, 2 p + i]      [n / 16, k / 2, 16, 2]
 *
 * so one model file serves both. Without VDPBF16PS each 32-byte load (eight columns, one pair
 * of inputs each) is widened to float32 in registers: the pair's second value is the lane with
 * its low half cleared, the first the lane shifted left by 16. Each is multiplied by a
 * broadcast of x's float32 input (the caller widens x once) and added into float32 with FMA.
 * A 16-column block is two such loads, four widened vectors, four FMAs per row.
 *
 * One row (a batch-1 decode step) runs through a tile of up to four blocks in one pass, the
 * weight read once, in order. More rows go four at a time through one block (eight float32
 * accumulators, four widened weight vectors, two broadcasts: 14 of the 16 vector registers);
 * while the first four rows run over a block, the next block is prefetched into L2, one
 * 64-byte vector per pair, so the later rows and the next block find it there.
 *
 * Sums are float32 from the bias on; each output is rounded to bfloat16 once (nearest even,
 * a NaN stays a NaN). All arguments are integers (pointers as addresses).
 */
#include <immintrin.h>
#include <stdint.h>

#include "_avx2_bf16.h" /* store8 */

#define TILE 4 /* blocks of 16 columns per tile, one row */
#define ROWS 4 /* rows per pass over a block */

static inline __attribute__((always_inline)) __m256 bias8(const uint16_t *bias) {
  if (!bias) return _mm256_setzero_ps();
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)bias));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* a 32-byte weight load's two float32 vectors: the pairs' first inputs, then their second */
#define WIDEN(lo, hi, v)                                                                                     \
  do {                                                                                                       \
    const __m256i v_ = (v);                                                                                  \
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(v_, 16));                                                     \
    hi = _mm256_castsi256_ps(_mm256_and_si256(v_, _mm256_set1_epi32((int)0xFFFF0000)));                     \
  } while (0)

/* one row over `blocks` blocks (a tile) */
static inline __attribute__((always_inline)) void tile_row(const float *x, int64_t pairs, const int blocks,
                                                          const __m256i *w, const uint16_t *bias, uint16_t *y) {
  __m256 acc[TILE][2];
  for (int j = 0; j < blocks; j++) {
    acc[j][0] = bias8(bias ? bias + 16 * j : 0);
    acc[j][1] = bias8(bias ? bias + 16 * j + 8 : 0);
  }
  for (int64_t p = 0; p < pairs; p++) {
    const __m256 x0 = _mm256_broadcast_ss(x + 2 * p), x1 = _mm256_broadcast_ss(x + 2 * p + 1);
    for (int j = 0; j < blocks; j++) {
      const __m256i *v = w + 2 * (j * pairs + p);
      for (int h = 0; h < 2; h++) {
        __m256 lo, hi;
        WIDEN(lo, hi, _mm256_loadu_si256(v + h));
        acc[j][h] = _mm256_fmadd_ps(x1, hi, _mm256_fmadd_ps(x0, lo, acc[j][h]));
      }
    }
  }
  for (int j = 0; j < blocks; j++) {
    store8(y + 16 * j, acc[j][0]);
    store8(y + 16 * j + 8, acc[j][1]);
  }
}

/* `rows` (1-4) rows of x (row stride k) over one block; `prefetch` (or 0): the next block's start */
static inline __attribute__((always_inline)) void block_rows(const float *x, int64_t k, const int rows,
                                                            const __m256i *w, const uint16_t *bias, uint16_t *y,
                                                            int64_t ldy, const char *prefetch) {
  const int64_t pairs = k / 2;
  __m256 acc[ROWS][2];
  const __m256 b0 = bias8(bias), b1 = bias8(bias ? bias + 8 : 0);
  for (int r = 0; r < rows; r++) {
    acc[r][0] = b0;
    acc[r][1] = b1;
  }
  for (int64_t p = 0; p < pairs; p++) {
    __m256 lo0, hi0, lo1, hi1;
    WIDEN(lo0, hi0, _mm256_loadu_si256(w + 2 * p));
    WIDEN(lo1, hi1, _mm256_loadu_si256(w + 2 * p + 1));
    if (prefetch) _mm_prefetch(prefetch + 64 * p, _MM_HINT_T1);
    for (int r = 0; r < rows; r++) {
      const __m256 x0 = _mm256_broadcast_ss(x + r * k + 2 * p), x1 = _mm256_broadcast_ss(x + r * k + 2 * p + 1);
      acc[r][0] = _mm256_fmadd_ps(x1, hi0, _mm256_fmadd_ps(x0, lo0, acc[r][0]));
      acc[r][1] = _mm256_fmadd_ps(x1, hi1, _mm256_fmadd_ps(x0, lo1, acc[r][1]));
    }
  }
  for (int r = 0; r < rows; r++) {
    store8(y + r * ldy, acc[r][0]);
    store8(y + r * ldy + 8, acc[r][1]);
  }
}

/* Columns of blocks [block0, block1) of y for all m rows. x: [m, k] contiguous float32 (k even);
 * w: packed as above; bias: [n] bf16 or 0; y: [m, n] contiguous bf16. */
void pagedllm_gemm_bf16_avx2(intptr_t x_addr, int64_t m, int64_t k, intptr_t w_addr, intptr_t bias_addr, int64_t n,
                             int64_t block0, int64_t block1, intptr_t y_addr) {
  const float *x = (const float *)x_addr;
  const __m256i *w0 = (const __m256i *)w_addr; /* two vectors per block and pair */
  const uint16_t *bias0 = (const uint16_t *)bias_addr;
  uint16_t *y = (uint16_t *)y_addr;
  const int64_t pairs = k / 2;
  if (m == 1) {
    for (int64_t block = block0; block < block1; block += TILE) {
      const int blocks = (int)(block1 - block < TILE ? block1 - block : TILE);
      const __m256i *w = w0 + 2 * block * pairs;
      const uint16_t *bias = bias0 ? bias0 + 16 * block : 0;
      switch (blocks) {
        case 1: tile_row(x, pairs, 1, w, bias, y + 16 * block); break;
        case 2: tile_row(x, pairs, 2, w, bias, y + 16 * block); break;
        case 3: tile_row(x, pairs, 3, w, bias, y + 16 * block); break;
        default: tile_row(x, pairs, 4, w, bias, y + 16 * block); break;
      }
    }
    return;
  }
  for (int64_t block = block0; block < block1; block++) {
    const __m256i *w = w0 + 2 * block * pairs;
    const uint16_t *bias = bias0 ? bias0 + 16 * block : 0;
    const char *next = block + 1 < block1 ? (const char *)(w + 2 * pairs) : 0;
    for (int64_t row = 0; row < m; row += ROWS) {
      const int rows = (int)(m - row < ROWS ? m - row : ROWS);
      const char *prefetch = row == 0 && m > ROWS ? next : 0;
      uint16_t *out = y + row * n + 16 * block;
      switch (rows) {
        case 1: block_rows(x + row * k, k, 1, w, bias, out, n, prefetch); break;
        case 2: block_rows(x + row * k, k, 2, w, bias, out, n, prefetch); break;
        case 3: block_rows(x + row * k, k, 3, w, bias, out, n, prefetch); break;
        default: block_rows(x + row * k, k, 4, w, bias, out, n, prefetch); break;
      }
    }
  }
}
