/* A float32 GEMM for x86-64 CPUs with AVX2 and FMA, for the linear layers of float32 models at
 * decode sizes: y[m, n] = x[m, k] @ w[n, k]^T (+ bias), the weight packed once as
 *
 *     packed[b, i, c] = w[16 b + c, i]      [n / 16, k, 16]
 *
 * so each input i of a 16-column block is one 64-byte line: two 8-wide vectors, multiplied by a
 * broadcast of x[r, i] and added with FMA, in float32 throughout (from the bias on).
 *
 * One row (a batch-1 decode step) runs through a tile of up to four blocks in one pass, the
 * weight read once, in order (eight accumulators). More rows go six at a time through one
 * block (twelve accumulators, two weight vectors, one broadcast: 15 of the 16 vector registers);
 * while the first six rows run over a block, the next block is prefetched into L2, one line per
 * input, so the later rows and the next block find it there. A prefill chunk of hundreds of rows
 * goes CHUNK rows at a time over every block, so those rows of x stay in L2 (one pass over all
 * rows per block read them from L3 again for each block: 0.70-0.86x oneDNN at 512 rows against
 * 0.9-1.2x). All arguments are integers (pointers as addresses).
 */
#include <immintrin.h>
#include <stdint.h>

#define TILE 4 /* blocks of 16 columns per tile, one row */
#define ROWS 6 /* rows per pass over a block */
#define CHUNK 96 /* rows of x kept in L2 while every block passes over them (more than 2 CHUNK rows) */

static inline __attribute__((always_inline)) __m256 bias8(const float *bias) {
  return bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
}

/* one row over `blocks` blocks (a tile) */
static inline __attribute__((always_inline)) void tile_row(const float *x, int64_t k, const int blocks,
                                                          const float *w, const float *bias, float *y) {
  __m256 acc[TILE][2];
  for (int j = 0; j < blocks; j++) {
    acc[j][0] = bias8(bias ? bias + 16 * j : 0);
    acc[j][1] = bias8(bias ? bias + 16 * j + 8 : 0);
  }
  for (int64_t i = 0; i < k; i++) {
    const __m256 xi = _mm256_broadcast_ss(x + i);
    for (int j = 0; j < blocks; j++) {
      const float *v = w + 16 * (j * k + i);
      acc[j][0] = _mm256_fmadd_ps(xi, _mm256_loadu_ps(v), acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(xi, _mm256_loadu_ps(v + 8), acc[j][1]);
    }
  }
  for (int j = 0; j < blocks; j++) {
    _mm256_storeu_ps(y + 16 * j, acc[j][0]);
    _mm256_storeu_ps(y + 16 * j + 8, acc[j][1]);
  }
}

/* `rows` (1-4) rows of x (row stride k) over one block; `prefetch` (or 0): the next block's start */
static inline __attribute__((always_inline)) void block_rows(const float *x, int64_t k, const int rows,
                                                            const float *w, const float *bias, float *y,
                                                            int64_t ldy, const char *prefetch) {
  __m256 acc[ROWS][2];
  const __m256 b0 = bias8(bias), b1 = bias8(bias ? bias + 8 : 0);
  for (int r = 0; r < rows; r++) {
    acc[r][0] = b0;
    acc[r][1] = b1;
  }
  for (int64_t i = 0; i < k; i++) {
    const __m256 w0 = _mm256_loadu_ps(w + 16 * i), w1 = _mm256_loadu_ps(w + 16 * i + 8);
    if (prefetch) _mm_prefetch(prefetch + 64 * i, _MM_HINT_T1);
    for (int r = 0; r < rows; r++) {
      const __m256 xi = _mm256_broadcast_ss(x + r * k + i);
      acc[r][0] = _mm256_fmadd_ps(xi, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xi, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < rows; r++) {
    _mm256_storeu_ps(y + r * ldy, acc[r][0]);
    _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
  }
}

/* Columns of blocks [block0, block1) of y for all m rows. x: [m, k] contiguous float32;
 * w: packed as above; bias: [n] float32 or 0; y: [m, n] contiguous float32. */
void pagedllm_gemm_f32_avx2(intptr_t x_addr, int64_t m, int64_t k, intptr_t w_addr, intptr_t bias_addr, int64_t n,
                            int64_t block0, int64_t block1, intptr_t y_addr) {
  const float *x = (const float *)x_addr;
  const float *w0 = (const float *)w_addr; /* 16 floats per block and input */
  const float *bias0 = (const float *)bias_addr;
  float *y = (float *)y_addr;
  if (m == 1) {
    for (int64_t block = block0; block < block1; block += TILE) {
      const int blocks = (int)(block1 - block < TILE ? block1 - block : TILE);
      const float *w = w0 + 16 * block * k;
      const float *bias = bias0 ? bias0 + 16 * block : 0;
      switch (blocks) {
        case 1: tile_row(x, k, 1, w, bias, y + 16 * block); break;
        case 2: tile_row(x, k, 2, w, bias, y + 16 * block); break;
        case 3: tile_row(x, k, 3, w, bias, y + 16 * block); break;
        default: tile_row(x, k, 4, w, bias, y + 16 * block); break;
      }
    }
    return;
  }
  /* many rows (a prefill chunk): CHUNK rows at a time over all blocks, so those rows of x stay in L2 */
  const int64_t chunk = m > 2 * CHUNK ? CHUNK : m;
  for (int64_t row0 = 0; row0 < m; row0 += chunk) {
    const int64_t row1 = row0 + chunk < m ? row0 + chunk : m;
    for (int64_t block = block0; block < block1; block++) {
      const float *w = w0 + 16 * block * k;
      const float *bias = bias0 ? bias0 + 16 * block : 0;
      const char *next = block + 1 < block1 ? (const char *)(w + 16 * k) : 0;
      for (int64_t row = row0; row < row1; row += ROWS) {
        const int rows = (int)(row1 - row < ROWS ? row1 - row : ROWS);
        const char *prefetch = row == row0 && row1 - row0 > ROWS ? next : 0;
        float *out = y + row * n + 16 * block;
        switch (rows) {
          case 1: block_rows(x + row * k, k, 1, w, bias, out, n, prefetch); break;
          case 2: block_rows(x + row * k, k, 2, w, bias, out, n, prefetch); break;
          case 3: block_rows(x + row * k, k, 3, w, bias, out, n, prefetch); break;
          case 4: block_rows(x + row * k, k, 4, w, bias, out, n, prefetch); break;
          case 5: block_rows(x + row * k, k, 5, w, bias, out, n, prefetch); break;
          default: block_rows(x + row * k, k, 6, w, bias, out, n, prefetch); break;
        }
      }
    }
  }
}
