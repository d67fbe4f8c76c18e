/* A bfloat16 GEMM for x86-64 CPUs with AVX-512-BF16: y[m, n] = x[m, k] @ w[n, k]^T (+ bias).
 *
 * The weight is packed once (bf16_gemm_cpu.py, pack) into blocks of 16 output columns;
 * inside a block, each 64-byte vector holds one pair of inputs (k, k + 1) for those 16
 * columns, so one VDPBF16PS multiplies a broadcast pair of x by 16 columns at once and adds
 * into float32:
 *
 *     packed[b, p, c, i] = w[16 b + c, 2 p + i]      [n / 16, k / 2, 16, 2]
 *
 * A tile is up to four blocks (64 columns). Rows go through it four at a time: 16 float32
 * accumulators, four weight loads and four broadcasts for 16 multiply-adds per pair. While
 * one tile is computed, the tile after it is prefetched into L2, its vectors spread over the
 * tile's loop iterations: the weight stream and the arithmetic overlap, which is what lets
 * 16 rows run at the memory's speed rather than the sum of the two. (Up to four rows, one
 * pass reads each tile once and the hardware prefetcher keeps up alone.)
 *
 * Sums are float32 from the bias on; each output is rounded to bfloat16 once (nearest even).
 * All arguments are integers (pointers as addresses), so any caller can bind it.
 */
#include <immintrin.h>
#include <stdint.h>

#define TILE 4 /* blocks of 16 columns per tile */
#define ROWS 4 /* rows per pass over a tile */

static inline __attribute__((always_inline)) __m512 bias16(const uint16_t *bias) {
  if (!bias) return _mm512_setzero_ps();
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bias));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline __attribute__((always_inline)) void tile_rows(const uint32_t *x, int64_t pairs, const int rows,
                                                           const int blocks, const __m512i *w, const uint16_t *bias,
                                                           uint16_t *y, int64_t ldy, const char *prefetch,
                                                           const int per_step) {
  __m512 acc[ROWS][TILE];
  for (int j = 0; j < blocks; j++) {
    __m512 b = bias16(bias ? bias + 16 * j : 0);
    for (int r = 0; r < rows; r++) acc[r][j] = b;
  }
  for (int64_t p = 0; p < pairs; p++) {
    __m512bh wv[TILE];
    for (int j = 0; j < blocks; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * pairs + p);
    for (int q = 0; q < per_step; q++) _mm_prefetch(prefetch + (p * per_step + q) * 64, _MM_HINT_T1);
    for (int r = 0; r < rows; r++) {
      __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[r * pairs + p]);
      for (int j = 0; j < blocks; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xb, wv[j]);
    }
  }
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < blocks; j++)
      _mm256_storeu_si256((__m256i *)(y + r * ldy + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
}

/* PF: how many vectors of the next tile each iteration prefetches (a constant 0 compiles the
 * prefetch out of the loop: a run-time 0 still costs the loop its unrolling, measured 15%) */
#define CASE(R, B, PF)                                                                                       \
  case (R) * 8 + (B):                                                                                        \
    tile_rows(x + row * pairs, pairs, R, B, w, bias, y + row * n + 16 * block, n, prefetch, PF);             \
    break;
#define CASES(PF)                                                                                            \
  CASE(1, 1, PF) CASE(1, 2, PF) CASE(1, 3, PF) CASE(1, 4, PF) CASE(2, 1, PF) CASE(2, 2, PF) CASE(2, 3, PF)   \
  CASE(2, 4, PF) CASE(3, 1, PF) CASE(3, 2, PF) CASE(3, 3, PF) CASE(3, 4, PF) CASE(4, 1, PF) CASE(4, 2, PF)   \
  CASE(4, 3, PF) CASE(4, 4, PF)

/* Columns of blocks [block0, block1) of y for all m rows. x: [m, k] contiguous bf16 (k even);
 * w: packed as above (pack aligns it to 64 bytes; any alignment works); bias: [n] bf16 or 0;
 * y: [m, n] contiguous bf16. */
void pagedllm_gemm_bf16(intptr_t x_addr, int64_t m, int64_t k, intptr_t w_addr, intptr_t bias_addr, int64_t n,
                        int64_t block0, int64_t block1, intptr_t y_addr) {
  const uint32_t *x0 = (const uint32_t *)x_addr;
  const __m512i *w0 = (const __m512i *)w_addr;
  const uint16_t *bias0 = (const uint16_t *)bias_addr;
  uint16_t *y = (uint16_t *)y_addr;
  const int64_t pairs = k / 2;
  const int64_t groups = (m + ROWS - 1) / ROWS;
  for (int64_t block = block0; block < block1; block += TILE) {
    const int blocks = (int)(block1 - block < TILE ? block1 - block : TILE);
    const __m512i *w = w0 + block * pairs;
    const uint16_t *bias = bias0 ? bias0 + 16 * block : 0;
    const int64_t next = block1 - (block + blocks) < TILE ? block1 - (block + blocks) : TILE;
    /* the next tile's next * pairs vectors, per_step of them per loop iteration of the first groups;
     * none where one group of rows passes over the tile: the weight is then read once, in order,
     * which the hardware prefetcher follows on its own (software prefetches only cost there) */
    const int spread = groups > 1 ? (int)((next + groups - 1) / groups) : 0;
    for (int64_t g = 0; g < groups; g++) {
      const int64_t row = g * ROWS;
      const int rows = (int)(m - row < ROWS ? m - row : ROWS);
      const int per_step = g * spread < next ? spread : 0;
      const char *prefetch = (const char *)(w + blocks * pairs + g * spread * pairs);
      const uint32_t *x = x0;
      if (per_step == 0) {
        switch (rows * 8 + blocks) { CASES(0) }
      } else if (per_step == 1) {
        switch (rows * 8 + blocks) { CASES(1) }
      } else {
        switch (rows * 8 + blocks) { CASES(per_step) }
      }
    }
  }
}
