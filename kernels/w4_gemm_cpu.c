/* A 4-bit weight-only GEMM (W4A16) for x86-64 CPUs with AVX-512-BF16:
 *
 *     y[m, n] = sum_k x[m, k] * scale[g, n] * (q[n, k] - zero[g, n]),   g = k / group
 *
 * with x and y bfloat16 and q, zero 4-bit levels. The weight is packed once (w4_gemm_cpu.py,
 * pack) into blocks of 16 output columns; for each pair of inputs (2p, 2p + 1), 16 bytes hold
 * the block's 16 columns, the even input in the low nibble:
 *
 *     packed[b, p, c] = q[16 b + c, 2 p] | q[16 b + c, 2 p + 1] << 4      [n / 16, k / 2, 16]
 *
 * Each byte widens to a 32-bit lane holding two bfloat16 values, 128 + q (exact: 0x4300 | q),
 * low half the even input: the pair layout VDPBF16PS multiplies a broadcast pair of x by.
 * Per group the kernel sums S = sum_k x[k] (128 + q[k]) in float32 and then folds it in:
 *
 *     acc += scale[g] * (S - (128 + zero[g]) * xsum[g]),    xsum[g] = sum over the group's k of x[k]
 *
 * Per block and group, meta holds scale then 128 + zero, 16 columns each, float32:
 * meta[b, g, 0 | 1, c]. Tiles (four blocks, rows four at a time) and the next tile's prefetch
 * into L2 follow bf16_gemm_cpu.c. Each output is rounded to bfloat16 once (nearest even).
 * All arguments are integers (pointers as addresses), so any caller can bind it.
 */
#include <immintrin.h>
#include <stdint.h>

#define TILE 4 /* blocks of 16 columns per tile */
#define ROWS 4 /* rows per pass over a tile */

/* Two bfloat16 lanes 128 + lo, 128 + hi from the 16 packed bytes of a block's pair. */
static inline __attribute__((always_inline)) __m512bh widen(const uint8_t *w) {
  __m512i v = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)w));
  v = _mm512_or_si512(v, _mm512_slli_epi32(v, 12)); /* the high nibble to bits 16..19 */
  /* (v & 0x000F000F) | 0x43004300 */
  return (__m512bh)_mm512_ternarylogic_epi32(v, _mm512_set1_epi32(0x000F000F), _mm512_set1_epi32(0x43004300), 0xEA);
}

static inline __attribute__((always_inline)) void tile_rows(const uint32_t *x, int64_t pairs, const int rows,
                                                           const int blocks, const uint8_t *w, const float *meta,
                                                           int64_t groups, int64_t group_pairs, const float *xsum,
                                                           uint16_t *y, int64_t ldy, const char *prefetch,
                                                           const int per_step, const char *prefetch_meta) {
  float acc[ROWS][TILE][16] __attribute__((aligned(64)));
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < blocks; j++) _mm512_store_ps(acc[r][j], _mm512_setzero_ps());
  for (int64_t g = 0; g < groups; g++) {
    __m512 s[ROWS][TILE];
    for (int r = 0; r < rows; r++)
      for (int j = 0; j < blocks; j++) s[r][j] = _mm512_setzero_ps();
    for (int64_t p = g * group_pairs; p < (g + 1) * group_pairs; p++) {
      __m512bh wv[TILE];
      for (int j = 0; j < blocks; j++) wv[j] = widen(w + (j * pairs + p) * 16);
      /* NOTE: a pair is 16 bytes of a block: every fourth pair fetches the next per_step lines of
       * this row group's per_step blocks of the next tile (one run of bytes), all of it in one pass */
      if ((p & 3) == 0)
        for (int q = 0; q < per_step; q++) _mm_prefetch(prefetch + (p * per_step * 16 + q * 64), _MM_HINT_T1);
      for (int r = 0; r < rows; r++) {
        __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[r * pairs + p]);
        for (int j = 0; j < blocks; j++) s[r][j] = _mm512_dpbf16_ps(s[r][j], xb, wv[j]);
      }
    }
    if (prefetch_meta)
      for (int j = 0; j < per_step; j++) {
        _mm_prefetch(prefetch_meta + (j * groups + g) * 128, _MM_HINT_T1);
        _mm_prefetch(prefetch_meta + (j * groups + g) * 128 + 64, _MM_HINT_T1);
      }
    for (int j = 0; j < blocks; j++) {
      const float *m = meta + (j * groups + g) * 32;
      const __m512 scale = _mm512_load_ps(m), offset = _mm512_load_ps(m + 16);
      for (int r = 0; r < rows; r++) {
        __m512 folded = _mm512_fnmadd_ps(offset, _mm512_set1_ps(xsum[r * groups + g]), s[r][j]);
        _mm512_store_ps(acc[r][j], _mm512_fmadd_ps(scale, folded, _mm512_load_ps(acc[r][j])));
      }
    }
  }
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < blocks; j++)
      _mm256_storeu_si256((__m256i *)(y + r * ldy + 16 * j), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc[r][j])));
}

/* Each tile of TILE blocks in [block0, block1) (w and meta at its first block, a block BLOCK_BYTES of
 * weight), and each pass of up to ROWS rows over it (row, rows); per_step blocks of the next tile are
 * prefetched by that pass, from prefetch and prefetch_meta: the next tile's blocks spread over the
 * first row groups' passes. BODY runs the pass. Needs m, groups, w0, meta0, block0 and block1. */
#define EACH_TILE_PASS(BLOCK_BYTES, BODY)                                                                        \
  do {                                                                                                           \
    const int64_t row_groups = (m + ROWS - 1) / ROWS;                                                            \
    for (int64_t block = block0; block < block1; block += TILE) {                                                \
      const int blocks = (int)(block1 - block < TILE ? block1 - block : TILE);                                   \
      const uint8_t *w = w0 + block * (BLOCK_BYTES);                                                             \
      const float *meta = meta0 + block * groups * 32;                                                           \
      const int64_t next = block1 - (block + blocks) < TILE ? block1 - (block + blocks) : TILE;                  \
      const int spread = (int)((next + row_groups - 1) / (row_groups ? row_groups : 1));                         \
      for (int64_t rg = 0; rg < row_groups; rg++) {                                                              \
        const int64_t row = rg * ROWS;                                                                           \
        const int rows = (int)(m - row < ROWS ? m - row : ROWS);                                                 \
        const int per_step =                                                                                     \
            rg * spread < next ? (int)(next - rg * spread < spread ? next - rg * spread : spread) : 0;           \
        const char *prefetch = (const char *)(w + (blocks + rg * spread) * (BLOCK_BYTES));                       \
        const char *prefetch_meta = per_step ? (const char *)(meta + (blocks + rg * spread) * groups * 32) : 0;  \
        BODY                                                                                                     \
      }                                                                                                          \
    }                                                                                                            \
  } while (0)

#define CASE(R, B)                                                                                                \
  case (R) * 8 + (B):                                                                                             \
    tile_rows(x0 + row * pairs, pairs, R, B, w, meta, groups, group_pairs, xsum0 + row * groups, y + row * n + 16 * block, \
              n, prefetch, per_step, prefetch_meta);                                                             \
    break;

/* xsum[r, g] = sum of x[r, k] over group g's k, float32: bfloat16 widens exactly, 16 lanes at a
 * time, the tail of a group not a multiple of 16 one by one. */
static void group_sums(const uint16_t *x, int64_t m, int64_t k, int64_t group, float *xsum) {
  const int64_t groups = k / group;
  for (int64_t r = 0; r < m; r++)
    for (int64_t g = 0; g < groups; g++) {
      const uint16_t *v = x + r * k + g * group;
      __m512 acc = _mm512_setzero_ps();
      int64_t i = 0;
      for (; i + 16 <= group; i += 16)
        acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(
                                     _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + i))), 16)));
      float sum = _mm512_reduce_add_ps(acc);
      for (; i < group; i++) {
        uint32_t bits = (uint32_t)v[i] << 16;
        float f;
        __builtin_memcpy(&f, &bits, 4);
        sum += f;
      }
      xsum[r * groups + g] = sum;
    }
}

#define LOCAL_SUMS 1024 /* the most group sums a call computes itself (xsum_addr 0), on its stack */

/* Columns of blocks [block0, block1) of y for all m rows. x: [m, k] contiguous bf16 (k even);
 * w: packed as above, meta: [n / 16, k / group, 2, 16] float32 (both 64-byte aligned);
 * xsum: [m, k / group] float32, or 0 where m * (k / group) <= LOCAL_SUMS: each call then sums
 * the groups of x itself (a few hundred adds at decode sizes, less than a separate pass costs to
 * start); group: even, dividing k; y: [m, n] contiguous bf16. */
void pagedllm_gemm_w4(intptr_t x_addr, int64_t m, int64_t k, intptr_t w_addr, intptr_t meta_addr, intptr_t xsum_addr,
                      int64_t group, int64_t n, int64_t block0, int64_t block1, intptr_t y_addr) {
  const uint32_t *x0 = (const uint32_t *)x_addr;
  const uint8_t *w0 = (const uint8_t *)w_addr;
  const float *meta0 = (const float *)meta_addr;
  float local[LOCAL_SUMS];
  const float *xsum0 = (const float *)xsum_addr;
  if (!xsum0) {
    group_sums((const uint16_t *)x_addr, m, k, group, local);
    xsum0 = local;
  }
  uint16_t *y = (uint16_t *)y_addr;
  const int64_t pairs = k / 2, groups = k / group, group_pairs = group / 2;
  EACH_TILE_PASS(pairs * 16, switch (rows * 8 + blocks) {
    CASE(1, 1) CASE(1, 2) CASE(1, 3) CASE(1, 4)
    CASE(2, 1) CASE(2, 2) CASE(2, 3) CASE(2, 4)
    CASE(3, 1) CASE(3, 2) CASE(3, 3) CASE(3, 4)
    CASE(4, 1) CASE(4, 2) CASE(4, 3) CASE(4, 4)
  });
}

/* ---- W4A8: the same packed weight times int8 activations (AVX-512-VNNI and VBMI) ----
 *
 * From some rows on, a call is bound by the multiply-adds, not by the weight's bytes. VPDPBUSD
 * multiplies 64 byte pairs per instruction where VDPBF16PS multiplies 32 bfloat16 pairs, so
 * there x is first quantized, per row and group, to int8 (pagedllm_quantize_s8):
 *
 *     x[r, k] ~ sx[r, g] * xq[r, k],   sx = max |x[r, group g]| / 127,   xq = round(x / sx) in -127..127
 *
 * and per group the kernel sums S = sum_k (128 + q[k]) xq[k] in int32 (exact), the 128 folded in by
 * starting S at 128 * xqsum[r, g], then
 *
 *     acc += scale[g] * sx[r, g] * (S - (128 + zero[g]) * xqsum[r, g]),   xqsum = sum over the group of xq
 *
 * A block's quad of inputs 4t..4t+3 is its pairs 2t and 2t + 1, 32 bytes in a row: byte c of each
 * holds column c's two levels. One VPERMB puts them in lane c's bytes 0 and 2, a shift and a
 * ternary logic op split the nibbles: lane c = q[c, 4t] | q[c, 4t+1] << 8 | q[c, 4t+2] << 16 | q[c, 4t+3] << 24,
 * the unsigned operand VPDPBUSD multiplies a broadcast of x's four bytes by. */
#define S8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")))

S8_TARGET static inline __attribute__((always_inline)) __m512i widen_quad(const uint8_t *w, __m512i index) {
  const __m512i v = _mm512_maskz_permutexvar_epi8(0x5555555555555555ULL, index,
                                                  _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)w)));
  /* (v | v << 4) & 0x0F0F0F0F: each level in its own byte */
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 4), _mm512_set1_epi32(0x0F0F0F0F), 0xA8);
}

/* acc + the four byte products of each lane of u (unsigned) and x (signed). NOTE: GCC 12 compiled the
 * intrinsic with a register copy of acc before and after each instruction, which held the kernel at
 * about half of VPDPBUSD's rate; the asm keeps acc in its register. */
S8_TARGET static inline __attribute__((always_inline)) __m512i dot_u8s8(__m512i acc, __m512i u, __m512i x) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(x));
  return acc;
}

/* Each (row, block) accumulator of a tile is a variable of its own (an unused one costs nothing). */
#define EACH_RB(X) X(0, 0) X(0, 1) X(0, 2) X(0, 3) X(1, 0) X(1, 1) X(1, 2) X(1, 3) \
                   X(2, 0) X(2, 1) X(2, 2) X(2, 3) X(3, 0) X(3, 1) X(3, 2) X(3, 3)
#define EACH_R(X) X(0) X(1) X(2) X(3)
#define EACH_B(X) X(0) X(1) X(2) X(3)

S8_TARGET static inline __attribute__((always_inline)) void tile_rows_s8(
    const int8_t *xq, int64_t k, const int rows, const int blocks, const uint8_t *w, int64_t block_bytes,
    const float *meta, int64_t groups, int64_t group_quads, const float *xs, uint16_t *y, int64_t ldy,
    const char *prefetch, const int per_step, const char *prefetch_meta, const __m512i index, const int wide) {
  const int64_t quad_bytes = wide ? 64 : 32; /* a block's 16 columns x 4 inputs: levels as bytes, or nibbles */
#define DECLARE(r, b) __m512 acc##r##b = _mm512_setzero_ps(); __m512i s##r##b = _mm512_setzero_si512();
  EACH_RB(DECLARE)
  for (int64_t g = 0; g < groups; g++) {
#define BIAS(r) const __m512i bias##r = _mm512_set1_epi32(r < rows ? 128 * (int32_t)xs[(r * groups + g) * 2 + 1] : 0);
    EACH_R(BIAS)
#define START(r, b) s##r##b = bias##r;
    EACH_RB(START)
    for (int64_t t = g * group_quads; t < (g + 1) * group_quads; t++) {
#define WIDEN(b)                                                                                  \
  const __m512i w##b = b >= blocks ? _mm512_setzero_si512()                                        \
                       : wide      ? _mm512_loadu_si512((const void *)(w + b * block_bytes + 64 * t)) \
                                   : widen_quad(w + b * block_bytes + 32 * t, index);
      EACH_B(WIDEN)
      /* as in tile_rows: every 64 bytes of a block (a quad of 8-bit levels, two of 4-bit ones) fetch
       * per_step lines of the next tile's next blocks */
      if (wide || (t & 1) == 0)
        for (int q = 0; q < per_step; q++) _mm_prefetch(prefetch + (t * per_step * quad_bytes + q * 64), _MM_HINT_T1);
#define ROW(r)                                                                               \
  if (r < rows) {                                                                            \
    const __m512i xb = _mm512_broadcastd_epi32(_mm_loadu_si32(xq + r * k + 4 * t));         \
    if (0 < blocks) s##r##0 = dot_u8s8(s##r##0, w0, xb);                          \
    if (1 < blocks) s##r##1 = dot_u8s8(s##r##1, w1, xb);                          \
    if (2 < blocks) s##r##2 = dot_u8s8(s##r##2, w2, xb);                          \
    if (3 < blocks) s##r##3 = dot_u8s8(s##r##3, w3, xb);                          \
  }
      EACH_R(ROW)
    }
    if (prefetch_meta)
      for (int j = 0; j < per_step; j++) {
        _mm_prefetch(prefetch_meta + (j * groups + g) * 128, _MM_HINT_T1);
        _mm_prefetch(prefetch_meta + (j * groups + g) * 128 + 64, _MM_HINT_T1);
      }
#define FOLD(r, b)                                                                                         \
  if (r < rows && b < blocks) {                                                                            \
    const float *mt = meta + (b * groups + g) * 32, *rs = xs + (r * groups + g) * 2;                      \
    const __m512 folded = _mm512_fnmadd_ps(_mm512_load_ps(mt + 16), _mm512_set1_ps(rs[1]), _mm512_cvtepi32_ps(s##r##b)); \
    acc##r##b = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_load_ps(mt), _mm512_set1_ps(rs[0])), folded, acc##r##b); \
  }
    EACH_RB(FOLD)
  }
#define STORE(r, b) \
  if (r < rows && b < blocks) _mm256_storeu_si256((__m256i *)(y + r * ldy + 16 * b), (__m256i)_mm512_cvtneps_pbh(acc##r##b));
  EACH_RB(STORE)
}

/* xq [m, k] int8 and xs [m, k / group, 2] float32 (sx, then the sum of the group's xq) from x [m, k]
 * bfloat16, as above; group a multiple of 16. Rounding is to nearest even; a group of zeros gets
 * sx = 0 and xq = 0. */
S8_TARGET void pagedllm_quantize_s8(intptr_t x_addr, int64_t m, int64_t k, int64_t group, intptr_t xq_addr,
                                    intptr_t xs_addr) {
  const uint16_t *x = (const uint16_t *)x_addr;
  int8_t *xq = (int8_t *)xq_addr;
  float *xs = (float *)xs_addr;
  const int64_t groups = k / group;
  for (int64_t r = 0; r < m; r++)
    for (int64_t g = 0; g < groups; g++) {
      const uint16_t *v = x + r * k + g * group;
      __m512 amax = _mm512_setzero_ps();
      for (int64_t i = 0; i < group; i += 16)
        amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_castsi512_ps(_mm512_slli_epi32(
                                       _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + i))), 16))));
      const float top = _mm512_reduce_max_ps(amax);
      const __m512 inv = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
      __m512i total = _mm512_setzero_si512();
      for (int64_t i = 0; i < group; i += 16) {
        const __m512 f = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + i))), 16));
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(f, inv));
        total = _mm512_add_epi32(total, q);
        _mm_storeu_si128((__m128i *)(xq + r * k + g * group + i), _mm512_cvtsepi32_epi8(q));
      }
      xs[(r * groups + g) * 2] = top / 127.0f;
      xs[(r * groups + g) * 2 + 1] = (float)_mm512_reduce_add_epi32(total);
    }
}

#define CASE_S8(R, B)                                                                                              \
  case (R) * 8 + (B):                                                                                              \
    tile_rows_s8(xq0 + row * k, k, R, B, w, block_bytes, meta, groups, group_quads, xs0 + row * groups * 2,        \
                 y + row * n + 16 * block, n, prefetch, per_step, prefetch_meta, index, wide);                     \
    break;

/* Columns of blocks [block0, block1) of y for all m rows, from xq and xs as pagedllm_quantize_s8
 * writes them; meta, n, y as for pagedllm_gemm_w4; group a multiple of 16 dividing k. The weight is
 * w4_gemm_cpu.py's 4-bit packing (wide 0) or its 8-bit one (wide 1): [n / 16, k / 4, 16, 4] bytes,
 * lane c of quad t holding q[16 b + c, 4t .. 4t + 3], which VPDPBUSD takes as it is. */
S8_TARGET static inline __attribute__((always_inline)) void gemm_s8(intptr_t xq_addr, intptr_t xs_addr, int64_t m,
                                                                   int64_t k, intptr_t w_addr, intptr_t meta_addr,
                                                                   int64_t group, int64_t n, int64_t block0,
                                                                   int64_t block1, intptr_t y_addr, const int wide) {
  const int8_t *xq0 = (const int8_t *)xq_addr;
  const float *xs0 = (const float *)xs_addr;
  const uint8_t *w0 = (const uint8_t *)w_addr;
  const float *meta0 = (const float *)meta_addr;
  uint16_t *y = (uint16_t *)y_addr;
  const int64_t block_bytes = wide ? 16 * k : 8 * k, groups = k / group, group_quads = group / 4;
  /* 4-bit: lane c's byte 0 from byte c (pair 2t), byte 2 from byte 16 + c (pair 2t + 1) */
  uint8_t order[64] __attribute__((aligned(64)));
  for (int c = 0; c < 16; c++) {
    order[4 * c] = (uint8_t)c;
    order[4 * c + 1] = 0;
    order[4 * c + 2] = (uint8_t)(16 + c);
    order[4 * c + 3] = 0;
  }
  const __m512i index = _mm512_load_si512((const void *)order);
  EACH_TILE_PASS(block_bytes, switch (rows * 8 + blocks) {
    CASE_S8(1, 1) CASE_S8(1, 2) CASE_S8(1, 3) CASE_S8(1, 4)
    CASE_S8(2, 1) CASE_S8(2, 2) CASE_S8(2, 3) CASE_S8(2, 4)
    CASE_S8(3, 1) CASE_S8(3, 2) CASE_S8(3, 3) CASE_S8(3, 4)
    CASE_S8(4, 1) CASE_S8(4, 2) CASE_S8(4, 3) CASE_S8(4, 4)
  });
}

/* the two exported copies: 4-bit levels (pagedllm_gemm_w4's packing) and 8-bit ones */
S8_TARGET void pagedllm_gemm_w4a8(intptr_t xq_addr, intptr_t xs_addr, int64_t m, int64_t k, intptr_t w_addr,
                                  intptr_t meta_addr, int64_t group, int64_t n, int64_t block0, int64_t block1,
                                  intptr_t y_addr) {
  gemm_s8(xq_addr, xs_addr, m, k, w_addr, meta_addr, group, n, block0, block1, y_addr, 0);
}

S8_TARGET void pagedllm_gemm_w8a8(intptr_t xq_addr, intptr_t xs_addr, int64_t m, int64_t k, intptr_t w_addr,
                                  intptr_t meta_addr, int64_t group, int64_t n, int64_t block0, int64_t block1,
                                  intptr_t y_addr) {
  gemm_s8(xq_addr, xs_addr, m, k, w_addr, meta_addr, group, n, block0, block1, y_addr, 1);
}
