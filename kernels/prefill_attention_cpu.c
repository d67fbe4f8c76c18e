/* Causal prefill attention of bfloat16 queries over a paged cache of bfloat16 or 8-bit K/V
 * (kernels/kv_quant.py), for x86-64 CPUs with AVX-512-BF16: one work item = one KV head and a
 * run of query tokens [t0, t1) of one chunk, flash-attention style
 * (kernels/prefill_attention_cpu.py deals the items out over the threads).
 *
 * The item's rows are its tokens times the query heads of the KV head (GQA: they share every
 * K/V tile). Keys and values are read through the block table, KT positions at a time:
 *
 *     K tile  --16x16 transpose-->  kt[chunk][pair][16 positions]   (pairs of bf16 as uint32)
 *     V tile  --widen-->            vf[position][head_dim] float32
 *     rows, RB at a time:  s[r][16 positions] += VDPBF16PS(q[r] pair j broadcast, kt[chunk][j])
 *                          online softmax in float32 (base 2: the scale carries log2(e))
 *                          o[r][d] += p[r][position] * vf[position][d]        (float32 FMA)
 *
 * Scores are exact products of bf16 values summed in float32; probabilities stay float32 and
 * V is widened exactly, so the only rounding to bf16 is the output's (once, nearest even).
 * A position is visible to a row at position `pos` when first <= position <= pos, first being
 * pos - window + 1 with a sliding window and 0 without. Rows of a tile that see none of it
 * skip it; positions past the item's last token are zero-filled, never read from the cache.
 *
 * 8-bit caches: every int8, e4m3 and e5m2 value is exact in bf16, so K is widened to bf16 as it
 * is loaded and the scores are computed as above. An int8 row's float16 scale multiplies the 16
 * scores of its chunk lane by lane before the softmax, and its V row as it is widened to float32
 * (int8 x float16 is exact in float32). fp8's per-tensor scales are the caller's: k_scale in
 * `scale`, v_scale in `v_scale` (the output's factor). e4m3 widens through float16 to its value
 * / 256 (kernels/_cpu_widen.py), which the caller folds into both. Each format is its own
 * compiled copy of the kernel (the format a constant), so the loops hold no format branch.
 *
 * All arguments are integers (pointers as addresses) or a float, so any caller can bind it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_cpu_attention.h" /* formats, widening, transpose16 */

#define KT 64      /* key positions per tile */
#define CHUNKS 4   /* KT / 16 */
#define RB 4       /* rows per register block */
#define DV 4       /* float32 vectors of 16 output columns per PV pass (64 columns) */
#define LOG2E 1.4426950408889634f

/* 2^x for x <= 0 (below -126 it gives about 2^-126, never 0: callers zero masked lanes) */
static inline __attribute__((always_inline)) __m512 exp2_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n); /* [-0.5, 0.5] */
  /* Taylor series of 2^f to degree 6: relative error below 2e-7 on [-0.5, 0.5] */
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

typedef struct {
  const uint8_t *k, *v;
  const int32_t *table;
  int64_t k_block, k_row, v_block, v_row, head; /* strides in bytes; head: one (token, head) row */
  int64_t block_size, head_dim, kv;
} Cache;

ALWAYS const uint8_t *slot(const uint8_t *base, const Cache *c, int64_t block, int64_t row, int64_t pos) {
  return base + (int64_t)c->table[pos / c->block_size] * block + pos % c->block_size * row + c->kv * c->head;
}

/* kt[chunk][pair][16]: pairs of positions p0 + 16 chunk + lane; positions >= end are zeros.
 * int8: ks[position - p0] the rows' scales (0 past end). */
ALWAYS void load_keys(const Cache *c, int64_t p0, int64_t end, uint32_t *kt, float *ks, const int fmt) {
  const int64_t pairs = c->head_dim / 2;
  for (int ch = 0; ch < CHUNKS; ch++) {
    const int64_t pos = p0 + 16 * ch;
    uint32_t *dst = kt + ch * pairs * 16;
    if (pos >= end) {
      memset(dst, 0, pairs * 16 * sizeof(uint32_t));
      if (fmt == INT8) _mm512_store_ps(ks + 16 * ch, _mm512_setzero_ps());
      continue;
    }
    const uint8_t *rows = slot(c->k, c, c->k_block, c->k_row, pos);
    const int64_t valid = end - pos < 16 ? end - pos : 16;
    for (int64_t j0 = 0; j0 < pairs; j0 += 16) {
      __m512i col[16];
      for (int s = 0; s < 16; s++)
        col[s] = s < valid ? load_pairs(rows + s * c->k_row, 2 * j0, fmt) : _mm512_setzero_si512();
      transpose16(col);
      for (int j = 0; j < 16; j++) _mm512_storeu_si512(dst + (j0 + j) * 16, col[j]);
    }
    if (fmt == INT8) {
      uint16_t bits[16] = {0};
      for (int s = 0; s < valid; s++) memcpy(bits + s, rows + s * c->k_row + c->head_dim, 2);
      _mm512_store_ps(ks + 16 * ch, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)bits)));
    }
  }
}

/* vf[position - p0][head_dim] float32 for positions p0 .. p0 + n - 1 (int8: times the row's scale) */
ALWAYS void load_values(const Cache *c, int64_t p0, int64_t n, float *vf, const int fmt) {
  for (int64_t s = 0; s < n; s++) {
    const uint8_t *row = slot(c->v, c, c->v_block, c->v_row, p0 + s);
    const __m512 r = fmt == INT8 ? row_scale(row, c->head_dim) : _mm512_set1_ps(1.0f);
    for (int64_t d = 0; d < c->head_dim; d += 16) {
      __m512 x;
      if (fmt == BF16) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 2 * d)));
        x = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
      } else {
        x = widen16(row + d, fmt);
        if (fmt == INT8) x = _mm512_mul_ps(x, r);
      }
      _mm512_storeu_ps(vf + s * c->head_dim + d, x);
    }
  }
}

typedef struct {
  const uint32_t *qp; /* [rows][pairs] */
  float *o;           /* [rows][head_dim] */
  float *m, *l;       /* [rows]: running max (base 2) and sum */
  const int64_t *pos, *first; /* [rows]: a row's position and its first visible one */
} Rows;

/* Scores, online softmax and PV of rows r0 .. r0 + RB - 1 over the tile at p0 (n positions). */
ALWAYS void row_block(const Rows *R, int64_t r0, const uint32_t *kt, const float *ks, const float *vf, int64_t p0,
                      int64_t n, int64_t pairs, int64_t head_dim, float scale2, const int fmt) {
  __m512 acc[RB][CHUNKS];
  for (int r = 0; r < RB; r++)
    for (int ch = 0; ch < CHUNKS; ch++) acc[r][ch] = _mm512_setzero_ps();
  const uint32_t *q = R->qp + r0 * pairs;
  for (int64_t j = 0; j < pairs; j++) {
    __m512bh kv[CHUNKS];
    for (int ch = 0; ch < CHUNKS; ch++) kv[ch] = (__m512bh)_mm512_loadu_si512(kt + (ch * pairs + j) * 16);
    for (int r = 0; r < RB; r++) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)q[r * pairs + j]);
      for (int ch = 0; ch < CHUNKS; ch++) acc[r][ch] = _mm512_dpbf16_ps(acc[r][ch], qb, kv[ch]);
    }
  }
  if (fmt == INT8) /* each position's K row scale, lane by lane */
    for (int ch = 0; ch < CHUNKS; ch++) {
      const __m512 k = _mm512_load_ps(ks + 16 * ch);
      for (int r = 0; r < RB; r++) acc[r][ch] = _mm512_mul_ps(acc[r][ch], k);
    }
  float p[RB][KT] __attribute__((aligned(64)));
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  int64_t last = -1; /* the last position any of the rows sees in the tile */
  for (int r = 0; r < RB; r++) {
    const int64_t row = r0 + r;
    const __m512i first = _mm512_set1_epi32((int)(R->first[row] - p0)), own = _mm512_set1_epi32((int)(R->pos[row] - p0));
    const int whole = R->first[row] <= p0 && R->pos[row] >= p0 + KT - 1; /* sees all KT positions */
    __mmask16 seen[CHUNKS];
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int ch = 0; ch < CHUNKS; ch++) {
      const __m512i at = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * ch));
      seen[ch] = whole ? (__mmask16)0xFFFF : _mm512_cmpge_epi32_mask(at, first) & _mm512_cmple_epi32_mask(at, own);
      top = _mm512_mask_max_ps(top, seen[ch], top, acc[r][ch]);
    }
    /* NOTE: the scale is positive (checked by the caller), so the largest raw score scales to the largest */
    const float old = R->m[row], tile_max = _mm512_reduce_max_ps(top) * scale2;
    const float now = tile_max > old ? tile_max : old;
    const __m512 vnow = _mm512_set1_ps(now), vscale = _mm512_set1_ps(scale2);
    __m512 sum = _mm512_setzero_ps();
    for (int ch = 0; ch < CHUNKS; ch++) {
      const __m512 e = _mm512_maskz_mov_ps(seen[ch], exp2_ps(_mm512_fmsub_ps(acc[r][ch], vscale, vnow)));
      sum = _mm512_add_ps(sum, e);
      _mm512_store_ps(p[r] + 16 * ch, e);
    }
    const float alpha = _mm512_cvtss_f32(exp2_ps(_mm512_set1_ps(old - now)));
    R->m[row] = now;
    R->l[row] = R->l[row] * alpha + _mm512_reduce_add_ps(sum);
    if (alpha != 1.0f) {
      float *o = R->o + row * head_dim;
      for (int64_t d = 0; d < head_dim; d += 16)
        _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(alpha)));
    }
    if (R->pos[row] - p0 > last) last = R->pos[row] - p0;
  }
  const int64_t used = last + 1 < n ? last + 1 : n;
  for (int64_t d0 = 0; d0 < head_dim; d0 += 16 * DV) {
    __m512 o[RB][DV];
    for (int r = 0; r < RB; r++)
      for (int k = 0; k < DV; k++) o[r][k] = _mm512_loadu_ps(R->o + (r0 + r) * head_dim + d0 + 16 * k);
    for (int64_t s = 0; s < used; s++) {
      __m512 v[DV];
      for (int k = 0; k < DV; k++) v[k] = _mm512_loadu_ps(vf + s * head_dim + d0 + 16 * k);
      for (int r = 0; r < RB; r++) {
        const __m512 b = _mm512_set1_ps(p[r][s]);
        for (int k = 0; k < DV; k++) o[r][k] = _mm512_fmadd_ps(b, v[k], o[r][k]);
      }
    }
    for (int r = 0; r < RB; r++)
      for (int k = 0; k < DV; k++) _mm512_storeu_ps(R->o + (r0 + r) * head_dim + d0 + 16 * k, o[r][k]);
  }
}

/* One work item. q, out: [tokens, num_heads, head_dim] bf16 (as uint16), a token every
 * q_stride / out_stride elements, pointing at the chunk's first token; the item's heads are
 * kv * group .. kv * group + group - 1. Caches: [*, block_size, kv_heads, row] of the copy's
 * format (row: head_dim values, an int8 row then its float16 scale), a block every *_block, a
 * slot every *_row and a head every `head` bytes; table: the chunk's int32 block ids.
 * first_pos: the chunk's first token's position (context_len - q_len). head_dim a multiple of
 * 64 (at most 256), block_size a multiple of 16, scale > 0 (K's per-tensor scale in it),
 * v_scale: the output's factor. window 0: none. Returns 0, or 1 when out of memory. */
ALWAYS int attend(const int fmt, intptr_t q_addr, int64_t q_stride, intptr_t out_addr, int64_t out_stride,
                  intptr_t k_addr, int64_t k_block, int64_t k_row, intptr_t v_addr, int64_t v_block, int64_t v_row,
                  int64_t head, intptr_t table_addr, int64_t block_size, int64_t head_dim, int64_t kv, int64_t group,
                  int64_t first_pos, int64_t t0, int64_t t1, int64_t window, float scale, float v_scale) {
  const Cache cache = {(const uint8_t *)k_addr, (const uint8_t *)v_addr, (const int32_t *)table_addr, k_block, k_row,
                       v_block, v_row, head, block_size, head_dim, kv};
  const int64_t pairs = head_dim / 2, rows = (t1 - t0) * group, padded = (rows + RB - 1) / RB * RB;
  const size_t bytes =
      padded * (pairs * 4 + head_dim * 4 + 4 + 4 + 8 + 8) + CHUNKS * pairs * 64 + KT * head_dim * 4 + KT * 4;
  char *buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (!buf) return 1;
  uint32_t *kt = (uint32_t *)buf;
  float *vf = (float *)(kt + CHUNKS * pairs * 16);
  float *ks = vf + KT * head_dim;
  uint32_t *qp = (uint32_t *)(ks + KT);
  float *o = (float *)(qp + padded * pairs);
  float *m = o + padded * head_dim, *l = m + padded;
  int64_t *pos = (int64_t *)(l + padded), *first = pos + padded;
  const uint16_t *q0 = (const uint16_t *)q_addr;
  for (int64_t r = 0; r < padded; r++) {
    const int64_t t = t0 + r / group, h = kv * group + r % group;
    if (r < rows) {
      memcpy(qp + r * pairs, q0 + t * q_stride + h * head_dim, head_dim * 2);
      pos[r] = first_pos + t;
      first[r] = window > 0 && pos[r] - window + 1 > 0 ? pos[r] - window + 1 : 0;
    } else { /* padding: sees nothing */
      memset(qp + r * pairs, 0, pairs * 4);
      pos[r] = -1;
      first[r] = 0;
    }
    /* NOTE: finite, far below any score: a tile the row does not see leaves it as it was with
     * alpha = 2^0 = 1, where -inf would give 2^(-inf - -inf) = nan */
    m[r] = -1e30f;
    l[r] = 0.0f;
  }
  memset(o, 0, padded * head_dim * sizeof(float));
  const int64_t end = first_pos + t1; /* one past the last token's position */
  int64_t start = first[0];
  start -= start % 16;
  const float scale2 = scale * LOG2E;
  const Rows R = {qp, o, m, l, pos, first};
  for (int64_t p0 = start; p0 < end; p0 += KT) {
    const int64_t n = end - p0 < KT ? end - p0 : KT;
    load_keys(&cache, p0, end, kt, ks, fmt);
    load_values(&cache, p0, n, vf, fmt);
    for (int64_t r0 = 0; r0 < padded; r0 += RB) {
      int64_t hi = -1, lo = INT64_MAX;
      for (int r = 0; r < RB; r++) {
        if (pos[r0 + r] > hi) hi = pos[r0 + r];
        if (pos[r0 + r] >= 0 && first[r0 + r] < lo) lo = first[r0 + r];
      }
      if (hi < p0 || lo >= p0 + n) continue; /* none of the rows sees the tile */
      row_block(&R, r0, kt, ks, vf, p0, n, pairs, head_dim, scale2, fmt);
    }
  }
  uint16_t *out0 = (uint16_t *)out_addr;
  for (int64_t r = 0; r < rows; r++) {
    const int64_t t = t0 + r / group, h = kv * group + r % group;
    const __m512 inv = _mm512_set1_ps(v_scale / l[r]);
    uint16_t *dst = out0 + t * out_stride + h * head_dim;
    for (int64_t d = 0; d < head_dim; d += 16)
      _mm256_storeu_si256((__m256i *)(dst + d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * head_dim + d), inv)));
  }
  free(buf);
  return 0;
}

#define PARAMS                                                                                                     \
  intptr_t q, int64_t q_stride, intptr_t out, int64_t out_stride, intptr_t k, int64_t k_block, int64_t k_row,     \
      intptr_t v, int64_t v_block, int64_t v_row, int64_t head, intptr_t table, int64_t block_size,                \
      int64_t head_dim, int64_t kv, int64_t group, int64_t first_pos, int64_t t0, int64_t t1, int64_t window,     \
      float scale, float v_scale
#define ARGS                                                                                                       \
  q, q_stride, out, out_stride, k, k_block, k_row, v, v_block, v_row, head, table, block_size, head_dim, kv, group, \
      first_pos, t0, t1, window, scale, v_scale

/* the exported copies, one per cache format */
int pagedllm_prefill_attention_bf16(PARAMS) { return attend(BF16, ARGS); }
int pagedllm_prefill_attention_int8(PARAMS) { return attend(INT8, ARGS); }
int pagedllm_prefill_attention_e4m3(PARAMS) { return attend(E4M3, ARGS); }
int pagedllm_prefill_attention_e5m2(PARAMS) { return attend(E5M2, ARGS); }
