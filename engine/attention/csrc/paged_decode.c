/* Paged decode attention for the CPU: reads each request's pages in place, exact two-pass softmax.
 *
 * Reads K and V straight from the pool through the block table (no gather, no padding),
 * one query token per request; GQA: the query heads sharing a KV head are handled together,
 * so each K/V tile is read once per KV head. Per (request, KV head): scores of every cached
 * token, then max, exp and sum, then the probability-weighted sum of V. Pages are processed as
 * contiguous page_size x head_dim tiles, which the compiler vectorises.
 *
 * Pool layout (engine/kv/pool.py): [num_pages + 1, num_layers, 2, num_kv_heads, page_size, head_dim],
 * element type given by `dtype`: 0 float32, 1 bfloat16, 2 float16, 3 float8_e4m3fn (uint8 bits).
 * Plain C with no torch headers, so it compiles in about a second; called through ctypes. With OpenMP the
 * (request, KV head) pairs are spread over `num_threads` threads (the engine's --cpu-threads). With AVX2 and FMA
 * (head_dim a multiple of 8), scores take 8 rows at a time through an 8x8 register transpose, and the weighted
 * sum of V keeps its accumulators in registers; other machines and shapes take the portable loops.
 *
 * Per layer attention types (engine/model/layer_attention.py): `starts` (may be NULL) gives each row's first
 * visible key position (a sliding window or a chunk); pages wholly before it are not read, and its scores are
 * left out of the softmax. `softcap` > 0 soft-caps the scores, cap * tanh(s / cap), before the softmax (Gemma 2).
 * `sinks` (may be NULL) holds one logit per query head that joins each softmax denominator (gpt-oss).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { PD_F32 = 0, PD_BF16 = 1, PD_F16 = 2, PD_FP8_E4M3 = 3 };

static float bf16_to_f32(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static float f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else { /* subnormal: renormalise */
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) { man <<= 1; exp--; }
      bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static float fp8_table[256];
static int fp8_ready = 0;

static void init_fp8(void) { /* float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa; 0x7f/0xff are NaN */
  for (int i = 0; i < 256; i++) {
    int sign = i >> 7, exp = (i >> 3) & 0xf, man = i & 7;
    float v;
    if (exp == 0xf && man == 7) v = NAN;
    else if (exp == 0) v = ldexpf((float)man / 8.0f, -6);
    else v = ldexpf(1.0f + (float)man / 8.0f, exp - 7);
    fp8_table[i] = sign ? -v : v;
  }
  fp8_ready = 1;
}

/* A tile of n elements as float32: the pool itself for float32, else converted into `buf`. */
static inline const float* tile(const void* base, int64_t idx, int dtype, int64_t n, float* buf) {
  switch (dtype) {
    case PD_F32: return (const float*)base + idx;
    case PD_BF16: for (int64_t i = 0; i < n; i++) buf[i] = bf16_to_f32(((const uint16_t*)base)[idx + i]); break;
    case PD_F16: for (int64_t i = 0; i < n; i++) buf[i] = f16_to_f32(((const uint16_t*)base)[idx + i]); break;
    default: for (int64_t i = 0; i < n; i++) buf[i] = fp8_table[((const uint8_t*)base)[idx + i]]; break;
  }
  return buf;
}


#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PD_AVX2 1
/* Transpose 8 rows of 8 floats (r0..r7) in place: afterwards r[d] holds element d of every row. */
static inline void transpose8(__m256* r) {
  __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20); r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20); r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31); r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31); r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* s[g][r] = scale * q[g] . k[r] for 8 rows of a row-major tile k[rows][hd], hd a multiple of 8, group <= 8. */
static inline void scores8(const float* k, int64_t hd, const float* q, int64_t group, float scale, float* s,
                           int64_t s_stride) {
  __m256 acc[8];
  for (int64_t g = 0; g < group; g++) acc[g] = _mm256_setzero_ps();
  for (int64_t c = 0; c < hd; c += 8) {
    __m256 r[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(k + i * hd + c);
    transpose8(r);
    for (int64_t g = 0; g < group; g++)
      for (int d = 0; d < 8; d++) acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(q[g * hd + c + d]), r[d], acc[g]);
  }
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t g = 0; g < group; g++) _mm256_storeu_ps(s + g * s_stride, _mm256_mul_ps(acc[g], sc));
}

/* acc[g][:] += sum_r p[g][r] * v[r][:] over `rows` rows of a row-major tile v[rows][hd], hd a multiple of 8. */
static inline void pv(const float* v, int64_t rows, int64_t hd, const float* p, int64_t p_stride, int64_t group,
                      float* acc) {
  for (int64_t g = 0; g < group; g++) {
    for (int64_t c = 0; c < hd; c += 8) {
      __m256 a = _mm256_loadu_ps(acc + g * hd + c);
      for (int64_t r = 0; r < rows; r++)
        a = _mm256_fmadd_ps(_mm256_set1_ps(p[g * p_stride + r]), _mm256_loadu_ps(v + r * hd + c), a);
      _mm256_storeu_ps(acc + g * hd + c, a);
    }
  }
}
#endif
/* q [B, Hq, D] float32; out [B, Hq, D] float32; block_tables [R, max_pages] int32, row b's table is
 * owners[b] (owners may be NULL: row b); seq_lens [B] int32.
 * scratch: num_threads * pd_scratch_floats(...) floats. Returns 0, or -1 on a bad argument. */
int64_t pd_scratch_floats(int64_t group, int64_t max_pages, int64_t page_size, int64_t head_dim) {
  return group * max_pages * page_size + page_size * head_dim + group * head_dim;
}

int pd_paged_decode(const float* q, const void* kv, int dtype, const int32_t* block_tables, const int32_t* owners,
                    const int32_t* seq_lens, const int32_t* starts, const float* sinks, float softcap,
                    float* out, int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t page_size, int64_t num_layers, int64_t layer, int64_t max_pages, float scale,
                    float k_scale, float v_scale, float* scratch, int num_threads) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads || head_dim <= 0 || page_size <= 0) return -1;
  if (dtype == PD_FP8_E4M3 && !fp8_ready) init_fp8();
  const int64_t group = num_heads / num_kv_heads, tile_n = page_size * head_dim;
  const int64_t head_stride = tile_n, kv_stride = num_kv_heads * head_stride;
  const int64_t layer_stride = 2 * kv_stride, page_stride = num_layers * layer_stride;
  const int64_t cap = max_pages * page_size;
  const float qk_scale = scale * k_scale;
  for (int64_t b = 0; b < batch; b++)
    if (seq_lens[b] <= 0 || (seq_lens[b] + page_size - 1) / page_size > max_pages ||
        (starts && (starts[b] < 0 || starts[b] >= seq_lens[b]))) return -1;
  const int64_t per_thread = pd_scratch_floats(group, max_pages, page_size, head_dim);
#pragma omp parallel for schedule(dynamic, 8) num_threads(num_threads)
  for (int64_t bh = 0; bh < batch * num_kv_heads; bh++) {
    {
      int tid = 0;
#ifdef _OPENMP
      tid = omp_get_thread_num();
#endif
      float *scores = scratch + tid * per_thread, *buf = scores + group * cap, *acc = buf + tile_n;
      const int64_t b = bh / num_kv_heads, h = bh % num_kv_heads;
      const int64_t len = seq_lens[b], n_pages = (len + page_size - 1) / page_size;
      const int64_t first = starts ? starts[b] : 0, p0 = first / page_size;
      const int32_t* table = block_tables + (owners ? owners[b] : b) * max_pages;
      const float* qb = q + (b * num_heads + h * group) * head_dim;
      const int64_t base = layer * layer_stride + h * head_stride;
      for (int64_t p = p0; p < n_pages; p++) { /* scores = q . k for every visible page's tokens */
        const float* k = tile(kv, table[p] * page_stride + base, dtype, tile_n, buf);
        const int64_t rows = (p == n_pages - 1) ? len - p * page_size : page_size;
        int64_t r0 = 0;
#ifdef PD_AVX2
        if (head_dim % 8 == 0 && group <= 8)
          for (; r0 + 8 <= rows; r0 += 8)
            scores8(k + r0 * head_dim, head_dim, qb, group, qk_scale, scores + p * page_size + r0, cap);
#endif
        for (int64_t g = 0; g < group; g++) {  /* the rows left over (all rows without AVX2) */
          const float* qg = qb + g * head_dim;
          float* s = scores + g * cap + p * page_size;
          for (int64_t r = r0; r < rows; r++) {
            float dot = 0.0f;
            for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * k[r * head_dim + d];
            s[r] = dot * qk_scale;
          }
        }
      }
      for (int64_t g = 0; g < group; g++) { /* softmax over the visible scores, in place; the rest get 0 */
        float* s = scores + g * cap;
        for (int64_t t = p0 * page_size; t < first; t++) s[t] = 0.0f;
        if (softcap > 0.0f)
          for (int64_t t = first; t < len; t++) s[t] = softcap * tanhf(s[t] / softcap);
        float mx = s[first], sum = 0.0f;
        for (int64_t t = first + 1; t < len; t++) mx = s[t] > mx ? s[t] : mx;
        const float sink = sinks ? sinks[h * group + g] : 0.0f;
        if (sinks && sink > mx) mx = sink;
        for (int64_t t = first; t < len; t++) { s[t] = expf(s[t] - mx); sum += s[t]; }
        if (sinks) sum += expf(sink - mx);
        const float inv = v_scale / sum;
        for (int64_t t = first; t < len; t++) s[t] *= inv;
      }
      memset(acc, 0, (size_t)(group * head_dim) * sizeof(float));
      for (int64_t p = p0; p < n_pages; p++) { /* out = sum_t p_t v_t */
        const float* v = tile(kv, table[p] * page_stride + base + kv_stride, dtype, tile_n, buf);
        const int64_t rows = (p == n_pages - 1) ? len - p * page_size : page_size;
#ifdef PD_AVX2
        if (head_dim % 8 == 0) {
          pv(v, rows, head_dim, scores + p * page_size, cap, group, acc);
          continue;
        }
#endif
        for (int64_t g = 0; g < group; g++) {
          const float* s = scores + g * cap + p * page_size;
          float* a = acc + g * head_dim;
          for (int64_t r = 0; r < rows; r++)
            for (int64_t d = 0; d < head_dim; d++) a[d] += s[r] * v[r * head_dim + d];
        }
      }
      memcpy(out + (b * num_heads + h * group) * head_dim, acc, (size_t)(group * head_dim) * sizeof(float));
    }
  }
  return 0;
}
