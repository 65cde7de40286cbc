// Paged attention for decode tokens on CPU: reads K/V blocks where they lie.
//
// Gathering each sequence's blocks into a contiguous tensor before SDPA copies
// the whole context every layer of every step (measured ~0.5 s per step at
// batch 64 here). This kernel walks the block table instead: one pass for the
// scores, one softmax, one pass over V, parallel over (sequence, KV head).
// The `group` query heads that share a KV head are handled together, so each
// K/V row is read once for all of them (GQA).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "pool.h"
#include "simd_exp.h"

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// Cache element types the vector paths read: fp32, or bf16 (widened by a 16-bit shift).
template <typename T>
constexpr bool kVecCache = std::is_same<T, float>::value || std::is_same<T, c10::BFloat16>::value;
// bf16 queries over a bf16 cache: the AVX512-BF16 path, where built
template <typename TQ, typename T>
constexpr bool kBf16Pair = std::is_same<TQ, c10::BFloat16>::value && std::is_same<T, c10::BFloat16>::value;

// `omp simd reduction` lets the compiler split the sum into vector lanes
// without -ffast-math (which would change results elsewhere).
template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * to_f(k[i]);
  return s;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// 8 cache values as fp32: a plain load, or bf16 -> fp32 (exact: the bf16 bits are the high half)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// s[t] = exp(s[t] - m) in place; returns the sum
inline float exp_sum(float* s, int64_t len, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {
    const __m256 e = pds::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = 0;
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, acc);
  for (int j = 0; j < 8; ++j) sum += tmp[j];
  for (; t < len; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
  return sum;
}

// Scores of NG query heads at once: each K row is loaded once for all of them
// (the per-head passes read every K row G times). D is a multiple of 8, at most 256.
template <int NG, typename T>
inline void scores_heads(const float* q, const T* const* krows, int64_t len, int64_t D, float* out,
                         int64_t out_stride) {
  for (int64_t t = 0; t < len; ++t) {
    __m256 a[NG];
    for (int g = 0; g < NG; ++g) a[g] = _mm256_setzero_ps();
    const T* k = krows[t];
    for (int64_t i = 0; i < D; i += 8) {
      const __m256 kv = load8(k + i);
      for (int g = 0; g < NG; ++g) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + i), kv, a[g]);
    }
    for (int g = 0; g < NG; ++g) {
      __m128 x = _mm_add_ps(_mm256_castps256_ps128(a[g]), _mm256_extractf128_ps(a[g], 1));
      x = _mm_add_ps(x, _mm_movehl_ps(x, x));
      x = _mm_add_ss(x, _mm_movehdup_ps(x));
      out[g * out_stride + t] = _mm_cvtss_f32(x);
    }
  }
}

// acc[g] += sum_t w[g][t] * v[t] for NG heads over 32 columns of D at a time, the
// NG x 4 accumulators in registers: each V row slice is loaded once for all heads.
template <int NG, typename T>
inline void weighted_v(const float* w, int64_t w_stride, const T* const* vrows, int64_t len, int64_t D,
                       float* acc) {
  for (int64_t i0 = 0; i0 < D; i0 += 32) {
    const int nv = static_cast<int>(std::min<int64_t>(32, D - i0) / 8);
    __m256 a[NG][4];
    for (int g = 0; g < NG; ++g)
      for (int j = 0; j < 4; ++j) a[g][j] = _mm256_setzero_ps();
    for (int64_t t = 0; t < len; ++t) {
      const T* v = vrows[t] + i0;
      __m256 vv[4];
      for (int j = 0; j < nv; ++j) vv[j] = load8(v + 8 * j);
      for (int g = 0; g < NG; ++g) {
        const __m256 wg = _mm256_set1_ps(w[g * w_stride + t]);
        for (int j = 0; j < nv; ++j) a[g][j] = _mm256_fmadd_ps(wg, vv[j], a[g][j]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int j = 0; j < nv; ++j) _mm256_storeu_ps(acc + g * D + i0 + 8 * j, a[g][j]);
  }
}
#define PDS_AVX2_ATTN 1
#endif

#if defined(PDS_AVX2_ATTN) && defined(__AVX512BF16__) && defined(__AVX512BW__)
// bf16 queries over a bf16 cache with AVX512-BF16: q.k straight from the cache's bf16
// pairs (vdpbf16ps: 32 products a step, exact, summed in fp32), 16 keys at a time, and
// V widened 16 lanes at a time. About 2.5x fewer instructions than the 8-lane path above.
#define PDS_AVX512_BF16_ATTN 1

// x[0..15] -> one vector whose lane t is the sum of x[t]'s 16 lanes
inline __m512 reduce16(const __m512* x) {
  __m512 v[8], w[4], y[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: v[i] = x[2i] (lanes 0-1), x[2i+1] (lanes 2-3), 8 partials each
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lanes: w[i] lane k = x[4i + k], 4 partials
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // within lanes: 2 partials each of w[2i]'s and w[2i+1]'s key
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], 0xEE));
  // lane k of z: keys k, 4 + k, 8 + k, 12 + k; put key t at lane t
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}

// out[g * out_stride + t] = scale * q[g] . k[t] for the G heads; D a multiple of 32, at most 256
// (vrows: the V rows of the same keys, fetched into L2 on the way for the pass over V)
inline void scores_bf16(const c10::BFloat16* q, int64_t G, const c10::BFloat16* const* krows,
                        const c10::BFloat16* const* vrows, int64_t len, int64_t D, float scale, float* out,
                        int64_t out_stride) {
  const int nd = static_cast<int>(D / 32);
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g) {
    __m512bh qv[8];
    for (int j = 0; j < nd; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * j);
    float* o = out + g * out_stride;
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) {
      __m512 acc[16];
      if (g == 0) {  // K rows 32 ahead: scattered over blocks, so the hardware prefetcher misses them
        for (int64_t u = t == 0 ? 0 : t + 32; u < std::min(len, t + 48); ++u)
          for (int64_t j = 0; j < D * 2; j += 64) _mm_prefetch(reinterpret_cast<const char*>(krows[u]) + j, _MM_HINT_T0);
        for (int64_t u = t; u < t + 16; ++u)
          for (int64_t j = 0; j < D * 2; j += 64) _mm_prefetch(reinterpret_cast<const char*>(vrows[u]) + j, _MM_HINT_T1);
      }
      for (int u = 0; u < 16; ++u) {
        const c10::BFloat16* k = krows[t + u];
        acc[u] = _mm512_setzero_ps();
        for (int j = 0; j < nd; ++j)
          acc[u] = _mm512_dpbf16_ps(acc[u], qv[j], (__m512bh)_mm512_loadu_si512(k + 32 * j));
      }
      _mm512_storeu_ps(o + t, _mm512_mul_ps(reduce16(acc), sv));
    }
    for (; t < len; ++t) {
      __m512 acc = _mm512_setzero_ps();
      for (int j = 0; j < nd; ++j)
        acc = _mm512_dpbf16_ps(acc, qv[j], (__m512bh)_mm512_loadu_si512(krows[t] + 32 * j));
      o[t] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}

// Softmax of one head's scores over a piece, for the P.V products below: m = the max,
// p = exp(s - m) rounded to bf16 (written to pb, zero-padded to an even length), and
// l = the sum of the rounded weights, so that the normalisation matches what P.V sums.
inline void softmax_bf16(const float* s, int64_t len, float& m_out, float& l_out, uint16_t* pb) {
  const int64_t full = len / 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (len % 16)) - 1);
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t v = 0; v < full; ++v) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + 16 * v));
  if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + 16 * full));
  const float m = _mm512_reduce_max_ps(mx);
  const __m512 mv = _mm512_set1_ps(m);
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  __m512 sum = _mm512_setzero_ps();
  const int64_t nv = full + (tail ? 1 : 0);
  auto weights = [&](int64_t v) {  // exp(s - m) of vector v, 0 past the end
    if (v < full) return pds::exp16(_mm512_sub_ps(_mm512_loadu_ps(s + 16 * v), mv));
    if (v == full && tail) return _mm512_maskz_mov_ps(tail, pds::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + 16 * v), mv)));
    return _mm512_setzero_ps();
  };
  for (int64_t v = 0; v < nv; v += 2) {
    const __m512i pv = (__m512i)_mm512_cvtne2ps_pbh(weights(v + 1), weights(v));
    // 32 weights, of which those past len are 0; store only up to the even length
    const int64_t n = std::min<int64_t>(32, ((len + 1) & ~int64_t{1}) - 16 * v);
    _mm512_mask_storeu_epi16(pb + 16 * v, static_cast<__mmask32>(n >= 32 ? 0xffffffffu : (1u << n) - 1), pv);
    sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(pv, 16)));
    sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_and_si512(pv, hi_mask)));
  }
  m_out = m;
  l_out = _mm512_reduce_add_ps(sum);
}

// acc[g] = sum_t p[g][t] * v[t] for NG heads with vdpbf16ps: the V rows of two keys are
// interleaved 16 bits at a time (unpacklo/hi), so each 32-bit lane holds one dimension of
// both keys, and one broadcast pair of weights (p[t], p[t+1]) multiplies both at once: a
// third of the instructions of widening V to fp32. pb[g] holds the bf16 weights, padded to
// an even length; the odd key's partner is a row of zeros. The unpacks leave the dimensions
// of a 32-wide chunk in the order lo: 0-3, 8-11, 16-19, 24-27; hi: 4-7, 12-15, ...; the
// permutation at the end puts them back.
template <int NG>
inline void weighted_v_pairs(const uint16_t* pb, int64_t pb_stride, const c10::BFloat16* const* vrows, int64_t len,
                             int64_t D, float* acc) {
  alignas(64) static const c10::BFloat16 zeros[256] = {};
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t i0 = 0; i0 < D; i0 += 64) {
    const int nc = static_cast<int>(std::min<int64_t>(64, D - i0) / 32);  // 32-wide chunks: 1 or 2
    __m512 lo[NG][2], hi[NG][2];
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < 2; ++c) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 2) {
      const c10::BFloat16* v0 = vrows[t] + i0;
      const c10::BFloat16* v1 = t + 1 < len ? vrows[t + 1] + i0 : zeros;
      if (t + 8 < len) {
        _mm_prefetch(reinterpret_cast<const char*>(vrows[t + 8] + i0), _MM_HINT_T0);
        if (t + 9 < len) _mm_prefetch(reinterpret_cast<const char*>(vrows[t + 9] + i0), _MM_HINT_T0);
        if (nc == 2) {
          _mm_prefetch(reinterpret_cast<const char*>(vrows[t + 8] + i0 + 32), _MM_HINT_T0);
          if (t + 9 < len) _mm_prefetch(reinterpret_cast<const char*>(vrows[t + 9] + i0 + 32), _MM_HINT_T0);
        }
      }
      __m512bh pl[2], ph[2];
      for (int c = 0; c < nc; ++c) {
        const __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c);
        pl[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
        ph[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
      }
      for (int g = 0; g < NG; ++g) {
        uint32_t pair;
        std::memcpy(&pair, pb + g * pb_stride + t, 4);
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
        for (int c = 0; c < nc; ++c) {
          lo[g][c] = _mm512_dpbf16_ps(lo[g][c], pl[c], w);
          hi[g][c] = _mm512_dpbf16_ps(hi[g][c], ph[c], w);
        }
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < nc; ++c) {
        float* o = acc + g * D + i0 + 32 * c;
        _mm512_storeu_ps(o, _mm512_permutex2var_ps(lo[g][c], first, hi[g][c]));
        _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(lo[g][c], second, hi[g][c]));
      }
  }
}
#endif

// Context is cut into pieces of kSplit tokens, each a work item of its own
// (split-K, "flash decoding"): at batch 1 the 3 KV heads of this model were 3
// work items for 2 threads, one thread idle a third of the time, and a long
// context ran on one core. Each piece leaves its running max, sum of exponentials
// and unnormalised V sum; the pieces of a (sequence, KV head) are merged at the
// end. The cut depends only on the sequence's own length, never on the batch or
// the thread count, so a sequence's numbers do not change with its neighbours.
constexpr int64_t kSplit = 256;
// Multiply-adds (context tokens x query heads x head dim) below which a step's decode
// attention is not split over OpenMP's team: tens of microseconds on one core.
constexpr int64_t kSerialWork = int64_t{1} << 20;

// f(std::integral_constant<int, NG>{}, g) over the G query heads of a KV head, in
// groups of 3, then 2, then 1 (the group size is the kernels' register count).
template <class F>
inline void by_head_groups(int64_t G, F&& f) {
  int64_t g = 0;
  for (; g + 3 <= G; g += 3) f(std::integral_constant<int, 3>{}, g);
  for (; g + 2 <= G; g += 2) f(std::integral_constant<int, 2>{}, g);
  for (; g < G; ++g) f(std::integral_constant<int, 1>{}, g);
}

// TQ: the query's and output's type; T: the cache's (a bf16 cache may take fp32 queries).
template <typename TQ, typename T>
void decode_kernel(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                   const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                   const torch::Tensor& seq_lens, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH, max_blocks = block_tables.size(1);
  const TQ* qp = q.data_ptr<TQ>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  TQ* op = out.data_ptr<TQ>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t tok_stride = KVH * D, blk_stride = BS * KVH * D;

  // work items: (sequence, KV head, piece); first[b] = the index of b's first piece
  std::vector<int64_t> first(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) first[b + 1] = first[b] + std::max<int64_t>(1, (lens[b] + kSplit - 1) / kSplit);
  const int64_t pieces = first[B];
  // per (piece, KV head): G maxima, G sums, G x D accumulators
  std::vector<float> part_m(pieces * KVH * G), part_l(pieces * KVH * G), part_acc(pieces * KVH * G * D);

  // On OpenMP's team (steps that also run oneDNN GEMMs) a loop ends in a barrier that waits
  // for every thread of the team, and one that another process has descheduled costs the
  // rest of its time slice: milliseconds for a few microseconds of work. A step's attention
  // that small runs on the calling thread alone (pool.h's own loops never wait that way).
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) work += lens[b] * H * D;
  const int64_t grain = pds::use_openmp() && work < kSerialWork ? pieces * KVH : 1;
  pds::parallel_for(0, pieces * KVH, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), scores;
    std::vector<uint16_t> pbuf;  // bf16 weights (AVX512-BF16 path)
    std::vector<const T*> krows, vrows;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t piece = idx / KVH, h = idx % KVH;
      const int64_t b = std::upper_bound(first.begin(), first.end(), piece) - first.begin() - 1;
      const int64_t t0 = (piece - first[b]) * kSplit, t1 = std::min(lens[b], t0 + kSplit), len = t1 - t0;
      const int64_t* table = bt + b * max_blocks;
      float* pm = part_m.data() + idx * G;
      float* pl = part_l.data() + idx * G;
      float* acc = part_acc.data() + idx * G * D;
      if (len <= 0) {
        for (int64_t g = 0; g < G; ++g) { pm[g] = -std::numeric_limits<float>::infinity(); pl[g] = 0.f; }
        std::fill(acc, acc + G * D, 0.f);
        continue;
      }
      scores.assign(G * len, 0.f);
      krows.resize(len);
      // the K or V rows of this KV head at positions t0 .. t1 - 1, block by block (no
      // division per row: a 64-bit divide costs more than the rest of a row's pointer)
      auto rows_of = [&](const T* cache, const T** rows) {
        for (int64_t pos = t0; pos < t1;) {
          const T* base = cache + table[pos / BS] * blk_stride + h * D;
          const int64_t off0 = pos % BS, n = std::min(BS - off0, t1 - pos);
          for (int64_t i = 0; i < n; ++i) rows[pos - t0 + i] = base + (off0 + i) * tok_stride;
          pos += n;
        }
      };
      rows_of(kp, krows.data());
#ifdef PDS_AVX512_BF16_ATTN
      if constexpr (kBf16Pair<TQ, T>) {
        if (D % 32 == 0 && D <= 256) {
          // scores, softmax into bf16 weights, then P.V on bf16 pairs: all in vdpbf16ps
          vrows.resize(len);
          rows_of(vp, vrows.data());
          scores_bf16(qp + (b * H + h * G) * D, G, krows.data(), vrows.data(), len, D, (float)scale, scores.data(),
                      len);
          const int64_t stride = (len + 1) & ~int64_t{1};
          pbuf.resize(G * stride);
          for (int64_t g = 0; g < G; ++g)
            softmax_bf16(scores.data() + g * len, len, pm[g], pl[g], pbuf.data() + g * stride);
          by_head_groups(G, [&](auto ng, int64_t g) {
            weighted_v_pairs<decltype(ng)::value>(pbuf.data() + g * stride, stride, vrows.data(), len, D, acc + g * D);
          });
          continue;
        }
      }
#endif
      for (int64_t i = 0; i < G * D; ++i) qf[i] = to_f(qp[(b * H + h * G) * D + i]) * (float)scale;
#ifdef PDS_AVX2_ATTN
      if constexpr (kVecCache<T>) {
        if (D % 8 == 0) {
          by_head_groups(G, [&](auto ng, int64_t g) {
            scores_heads<decltype(ng)::value>(qf.data() + g * D, krows.data(), len, D, scores.data() + g * len, len);
          });
          goto softmax;
        }
      }
#endif
      for (int64_t t = 0; t < len; ++t)
        for (int64_t g = 0; g < G; ++g) scores[g * len + t] = dot(qf.data() + g * D, krows[t], D);
    softmax:
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t]);
#ifdef PDS_AVX2_ATTN
        const float sum = exp_sum(s, len, m);
#else
        float sum = 0;
        for (int64_t t = 0; t < len; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
#endif
        pm[g] = m;
        pl[g] = sum;
      }
#ifdef PDS_AVX2_ATTN
      if constexpr (kVecCache<T>) {
        if (D % 8 == 0) {
          std::vector<const T*>& vrows = krows;  // the K rows are done with
          rows_of(vp, vrows.data());
          by_head_groups(G, [&](auto ng, int64_t g) {
            weighted_v<decltype(ng)::value>(scores.data() + g * len, len, vrows.data(), len, D, acc + g * D);
          });
          continue;
        }
      }
#endif
      std::fill(acc, acc + G * D, 0.f);
      rows_of(vp, krows.data());  // the K rows are done with
      for (int64_t t = 0; t < len; ++t) {
        const T* vrow = krows[t];
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * len + t];
          float* a = acc + g * D;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) a[i] += w * to_f(vrow[i]);
        }
      }
    }
  });

  // merge the pieces of each (sequence, KV head): rescale each to the global max
  std::vector<float> sum(D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t g = 0; g < G; ++g) {
        float M = -std::numeric_limits<float>::infinity();
        for (int64_t pc = first[b]; pc < first[b + 1]; ++pc) M = std::max(M, part_m[(pc * KVH + h) * G + g]);
        float l = 0;
        std::fill(sum.begin(), sum.end(), 0.f);
        for (int64_t pc = first[b]; pc < first[b + 1]; ++pc) {
          const int64_t at = (pc * KVH + h) * G + g;
          if (part_l[at] == 0.f) continue;
          const float c = std::exp(part_m[at] - M);  // exactly 1 for the piece holding the max
          l += c * part_l[at];
          const float* a = part_acc.data() + at * D;
          for (int64_t i = 0; i < D; ++i) sum[i] += c * a[i];
        }
        const float inv = 1.f / l;
        for (int64_t i = 0; i < D; ++i) op[(b * H + h * G + g) * D + i] = static_cast<TQ>(sum[i] * inv);
      }
}

}  // namespace

// out, q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D];
// block_tables: [B, max_blocks] int64; seq_lens: [B] int64 (context incl. the new token).
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor block_tables,
                            torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "q and out must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && seq_lens.scalar_type() == torch::kInt64,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "k/v caches, or q and out, differ in dtype");
  if (q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kBFloat16) {
    // fp32 queries over a bf16 cache (the fused decode layer in bf16 mode)
    decode_kernel<float, c10::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
    return;
  }
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t, scalar_t>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
  });
}

torch::Tensor gguf_matmul(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t K);
torch::Tensor q8_matmul(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t K);
torch::Tensor q8_repack(torch::Tensor w, int64_t qtype, int64_t K);
void register_decode_layer(pybind11::module& m);
void register_prefill_attention(pybind11::module& m);
void register_elementwise(pybind11::module& m);
void register_int8_gemm(pybind11::module& m);
int64_t pool_check(int64_t n, int64_t grain, int64_t loops, int64_t work);

// The threads the kernels' parallel loops run on from now on: "pool" or "omp" (pool.h);
// returns the previous choice. PDSERVE_PARALLEL, when set, overrides it.
std::string set_parallel_mode(const std::string& mode) {
  TORCH_CHECK(mode == "pool" || mode == "omp", "parallel mode must be 'pool' or 'omp', not '", mode, "'");
  const int old = pds::step_mode().exchange(mode == "omp" ? 1 : 0);
  return old == 1 ? "omp" : "pool";
}
int64_t set_gguf_expand_rows(int64_t rows);
int64_t set_prefetch_bytes(int64_t bytes);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("gguf_matmul", &gguf_matmul, "x @ W.T with W in raw GGUF Q4_0/Q4_1/Q8_0 blocks (CPU)");
  m.def("q8_matmul", &q8_matmul,
        "x @ W.T, W repacked by q8_repack, activations rounded to int8 per 32-value block (opt-in, not exact)");
  m.def("q8_repack", &q8_repack, "GGUF Q4_0/Q4_1/Q8_0 rows -> the layout q8_matmul reads");
  register_decode_layer(m);
  register_prefill_attention(m);
  register_elementwise(m);
  register_int8_gemm(m);
  m.def("set_gguf_expand_rows", &set_gguf_expand_rows,
        "gguf_matmul expands weights to fp32 from this many rows on; returns the previous value");
  m.def("set_prefetch_bytes", &set_prefetch_bytes,
        "how far ahead (bytes) the small-batch GGUF kernels prefetch weights; returns the previous value");
  m.def("set_parallel_mode", &set_parallel_mode,
        "run the kernels' parallel loops on the pool ('pool') or OpenMP's team ('omp'); returns the previous");
  m.def("pool_check", &pool_check, "self-check of the parallel loop: indices not run exactly once");
}
