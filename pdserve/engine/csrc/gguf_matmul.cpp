// Matrix products straight from GGUF quantized blocks, for small batches on CPU.
//
// Decoding a few tokens is memory-bound: every step reads all weights once.
// Reading the 4.5-bit Q4_1 blocks the GGUF file holds (0.625 bytes/weight)
// instead of their fp32 expansion (4 bytes/weight) is the difference between
// ~11 GB/s of fp32 GEMV and a step that fits the memory bandwidth. The weights
// are the very same numbers: w = d * q + m, with d, m the block's fp16 scales.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "pool.h"
#include <c10/util/Half.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define PDS_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int QK = 32;  // weights per block in Q4_0, Q4_1, Q8_0

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);  // one instruction instead of a software conversion
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

inline float dot_k(const float* a, const float* b, int64_t K) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < K; ++i) s += a[i] * b[i];
  return s;
}

inline float dot32(const float* q, const float* x) { return dot_k(q, x, QK); }

// f(std::integral_constant<int, MT>{}, m) for the activation rows [m, m + MT), in tiles of
// 4 and one tile of the 1-3 left: the tile size is a template argument of the kernels
// (their accumulators live in registers).
template <class F>
inline void by_row_tiles(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) f(std::integral_constant<int, 4>{}, m);
  switch (M - m) {
    case 3: f(std::integral_constant<int, 3>{}, m); break;
    case 2: f(std::integral_constant<int, 2>{}, m); break;
    case 1: f(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

// Where value i of block j of an activation row goes in the int8 kernels' layout: for Q4
// weights ("pair order") blocks (2p, 2p+1) are stored x[2p][0:16] x[2p+1][0:16]
// x[2p][16:32] x[2p+1][16:32], matching one 32-byte load of two blocks' nibbles; an
// unpaired last block, and every block for Q8 weights, stays in natural order.
inline int64_t xq_index(int64_t j, int i, int64_t nb, bool pair_order) {
  if (!pair_order || (j | 1) >= nb) return j * QK + i;
  return (j & ~int64_t(1)) * QK + (i < 16 ? 0 : 32) + (j & 1) * 16 + (i & 15);
}

#ifdef PDS_AVX2
// Widen 8 bytes (unsigned or signed) to 8 floats.
inline __m256 u8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
inline __m256 i8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The block's 32 weights (before scale and bias) as four vectors of 8 floats.
template <int QTYPE>
inline void decode_block(const uint8_t* b, __m256 q[4]) {
  if (QTYPE == 8) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
    q[0] = i8_to_ps(lo); q[1] = i8_to_ps(_mm_srli_si128(lo, 8));
    q[2] = i8_to_ps(hi); q[3] = i8_to_ps(_mm_srli_si128(hi, 8));
  } else {
    // Zero-extend 8 bytes to 8 ints straight from memory; in 32-bit lanes the low
    // nibble is a mask and the high nibble a shift (2 shuffles per block, not 6).
    // Weight i < 16 is byte i's low nibble, weight 16 + i its high nibble.
    const uint8_t* qs = b + (QTYPE == 3 ? 4 : 2);
    const __m256i e0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
    const __m256i e1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(e0, mask));
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(e1, mask));
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(e0, 4));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(e1, 4));
  }
}
#endif

}  // namespace

// How far ahead of the row being multiplied the kernels ask for weights (bytes).
int64_t kPrefetchBytes = 4096;

namespace {

// The weights of a decode step (~96 MB here) stream from DRAM once per step. The
// hardware prefetcher alone, restarted at every chunk a thread claims, left the
// batch-1 kernels at ~6-9 GB/s of the ~23 the machine reads; asking for the bytes
// kPrefetchBytes ahead of the row in hand (not past the chunk's end) keeps more
// reads in flight. Measured in docs/performance.md ("Prefetching the weights").
inline void prefetch_ahead(const uint8_t* row, int64_t row_bytes, const uint8_t* end) {
  const uint8_t* p = row + kPrefetchBytes;
  const uint8_t* stop = std::min(p + row_bytes, end);
  for (; p < stop; p += 64) __builtin_prefetch(p, 0, 3);
}

// qtype: 2 = Q4_0, 3 = Q4_1, 8 = Q8_0 (ggml's type ids)
// One weight row against MT activation rows, the MT accumulators held in
// registers: the previous version kept them in std::vectors, so every block
// waited on a store-to-load round trip (~4 GB/s of weights per core).
template <int QTYPE, int MT>
inline void row_tile(const uint8_t* row, const float* x, const float* xsum, float* out, int64_t N,
                     int64_t K, int64_t nb) {
  constexpr int bytes = QTYPE == 2 ? 18 : QTYPE == 3 ? 20 : 34;
  float acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = 0.f;
#ifdef PDS_AVX2
  __m256 vacc[MT];
  for (int m = 0; m < MT; ++m) vacc[m] = _mm256_setzero_ps();
#endif
  for (int64_t j = 0; j < nb; ++j) {
    const uint8_t* b = row + j * bytes;
    const float d = half_at(b);
    // per-block constant added to every weight: m for Q4_1, -8d for Q4_0
    const float bias = QTYPE == 3 ? half_at(b + 2) : QTYPE == 2 ? -8.f * d : 0.f;
#ifdef PDS_AVX2
    __m256 q[4];
    decode_block<QTYPE>(b, q);
    const __m256 dv = _mm256_set1_ps(d);
    for (int m = 0; m < MT; ++m) {
      const float* xb = x + m * K + j * QK;
      __m256 s = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
      s = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), s);
      s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb + 16), s);
      s = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), s);
      vacc[m] = _mm256_fmadd_ps(dv, s, vacc[m]);
      if (QTYPE != 8) acc[m] += bias * xsum[m * nb + j];
    }
#else
    float q[QK];
    if (QTYPE == 8) {
      const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
      for (int i = 0; i < QK; ++i) q[i] = qs[i];
    } else {
      const uint8_t* qs = b + (QTYPE == 3 ? 4 : 2);
      for (int i = 0; i < 16; ++i) { q[i] = qs[i] & 15; q[i + 16] = qs[i] >> 4; }
    }
    for (int m = 0; m < MT; ++m) acc[m] += d * dot32(q, x + m * K + j * QK) + bias * xsum[m * nb + j];
#endif
  }
  for (int m = 0; m < MT; ++m) {
#ifdef PDS_AVX2
    acc[m] += hsum(vacc[m]);
#endif
    out[m * N] = acc[m];
  }
}

// Output columns [n0, n1) for all M rows: each weight row comes from memory once
// and is re-read from L1 for every tile of 4 activation rows.
template <int QTYPE>
void rows(const uint8_t* w, const float* x, const float* xsum, float* out, int64_t M, int64_t N, int64_t K,
          int64_t row_bytes, int64_t n0, int64_t n1) {
  const int64_t nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    prefetch_ahead(row, row_bytes, w + n1 * row_bytes);
    by_row_tiles(M, [&](auto mt, int64_t m) {
      row_tile<QTYPE, decltype(mt)::value>(row, x + m * K, xsum + m * nb, out + m * N + n, N, K, nb);
    });
  }
}

// kExpandFromRows (8) or more activation rows: expand a weight row's blocks once into fp32
// (w = d*q + bias, in L1), then multiply a 2-weight-row x 4-activation-row
// tile with eight accumulators in registers: per 8 weights, 6 loads and 8 FMAs.
// The per-row kernel above decodes in registers and re-multiplies by the block
// scale for every activation row, which made a decode step's cost grow almost
// linearly with the batch (batch 8 took 4.7x batch 1's time).
template <int QTYPE>
inline void expand_row(const uint8_t* row, float* w, int64_t nb) {
  constexpr int bytes = QTYPE == 2 ? 18 : QTYPE == 3 ? 20 : 34;
  for (int64_t j = 0; j < nb; ++j) {
    const uint8_t* b = row + j * bytes;
    const float d = half_at(b);
    const float bias = QTYPE == 3 ? half_at(b + 2) : QTYPE == 2 ? -8.f * d : 0.f;
    float* o = w + j * QK;
#ifdef PDS_AVX2
    __m256 q[4];
    decode_block<QTYPE>(b, q);
    const __m256 dv = _mm256_set1_ps(d), bv = _mm256_set1_ps(bias);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(q[i], dv, bv));
#else
    if (QTYPE == 8) {
      const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
      for (int i = 0; i < QK; ++i) o[i] = qs[i] * d + bias;
    } else {
      const uint8_t* qs = b + (QTYPE == 3 ? 4 : 2);
      for (int i = 0; i < 16; ++i) { o[i] = (qs[i] & 15) * d + bias; o[i + 16] = (qs[i] >> 4) * d + bias; }
    }
#endif
  }
}

// out[m * N + t] = w[t] . x[m] for NT weight rows (stride K) and MT activation rows (stride K).
template <int NT, int MT>
inline void tile(const float* w, const float* x, float* out, int64_t N, int64_t K) {
#ifdef PDS_AVX2
  __m256 acc[NT][MT];
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) acc[t][m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
    for (int t = 0; t < NT; ++t) {
      const __m256 wv = _mm256_loadu_ps(w + t * K + k);
      for (int m = 0; m < MT; ++m) acc[t][m] = _mm256_fmadd_ps(wv, xv[m], acc[t][m]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) out[m * N + t] = hsum(acc[t][m]);
#else
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) out[m * N + t] = dot_k(w + t * K, x + m * K, K);
#endif
}

template <int NT>
inline void tile_rows(const float* w, const float* x, float* out, int64_t M, int64_t N, int64_t K) {
  by_row_tiles(M, [&](auto mt, int64_t m) { tile<NT, decltype(mt)::value>(w, x + m * K, out + m * N, N, K); });
}

// Output columns [n0, n1) for all M rows, two weight rows at a time.
template <int QTYPE>
void rows_expanded(const uint8_t* w, const float* x, float* out, int64_t M, int64_t N, int64_t K,
                   int64_t row_bytes, int64_t n0, int64_t n1) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < 2 * K) buf.resize(2 * K);
  const int64_t nb = K / QK;
  // 16 activation rows at a time stay in L2 while every weight row pair passes
  // (all 64 rows of a big batch did not: the expansion is cheaper than the misses)
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t mt = std::min<int64_t>(16, M - m0);
    const float* xm = x + m0 * K;
    float* om = out + m0 * N;
    for (int64_t n = n0; n < n1; n += 2) {
      expand_row<QTYPE>(w + n * row_bytes, buf.data(), nb);
      if (n + 1 < n1) {
        expand_row<QTYPE>(w + (n + 1) * row_bytes, buf.data() + K, nb);
        tile_rows<2>(buf.data(), xm, om + n, mt, N, K);
      } else {
        tile_rows<1>(buf.data(), xm, om + n, mt, N, K);
      }
    }
  }
}

// ---- int8 activations (opt-in): Q8 x Q4/Q8 dot products on AVX2, as llama.cpp does ----
//
// The fp32 kernels above spend most of a batch-1 step turning nibbles into floats
// (~5.8 GB/s of weights per core). Quantizing each 32-value block of the activations
// to int8 (scale max|x| / 127) lets `vpmaddubsw` multiply weights and activations as
// bytes. That rounds the activations (~0.5% relative per dot product), so it changes
// the numbers: an opt-in mode whose agreement with the fp32 path is measured
// (docs/performance.md), never the default.
//
// The weights are first repacked (same size as the GGUF rows, see q8_repack): a row's
// nibbles contiguous, then its block scales, then its per-block constants. One 32-byte
// load then holds two Q4 blocks, two masks give 64 weights, and the activations are
// stored in the matching order (low halves of a block pair, then high halves). A dot
// product over a block is d * dx * sum(q_i * xq_i) + c * sum(x_i), with c the Q4_1
// minimum or Q4_0's -8d and sum(x_i) the exact fp32 sum.

constexpr int kQ4 = 0, kQ8 = 1;  // repacked layouts

inline int packed_kind(int64_t qtype) { return qtype == 8 ? kQ8 : kQ4; }

// Repacked row, nb blocks: Q4: qs[nb][16] | d[nb] fp16 | c[nb] fp16.  Q8: qs[nb][32] | d[nb] fp16.
void repack_row(const uint8_t* src, uint8_t* dst, int64_t qtype, int64_t nb) {
  const int bytes = qtype == 2 ? 18 : qtype == 3 ? 20 : 34;
  const int qbytes = qtype == 8 ? 32 : 16;
  uint8_t* qs = dst;
  uint8_t* ds = dst + nb * qbytes;
  uint8_t* cs = ds + nb * 2;
  for (int64_t j = 0; j < nb; ++j) {
    const uint8_t* b = src + j * bytes;
    std::memcpy(ds + 2 * j, b, 2);
    if (qtype == 8) {
      std::memcpy(qs + j * 32, b + 2, 32);
      continue;
    }
    std::memcpy(qs + j * 16, b + (qtype == 3 ? 4 : 2), 16);
    if (qtype == 3) {
      std::memcpy(cs + 2 * j, b + 2, 2);
    } else {  // -8 d: a power-of-two multiple, exact in fp16 but for overflow (|d| < 8188)
      uint16_t h;
      std::memcpy(&h, b, 2);
      const c10::Half c(-8.f * static_cast<float>(c10::Half(h, c10::Half::from_bits())));
      std::memcpy(cs + 2 * j, &c.x, 2);
    }
  }
}

// x [M, K] -> xq [M, K] int8 (pair order for Q4 weights), xd [M, nb] block scales, xs [M, nb] block sums.
void quantize_rows(const float* x, int8_t* xq, float* xd, float* xs, int64_t M, int64_t K, bool pair_order) {
  const int64_t nb = K / QK;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t r = m * nb + j;
      const float* xb = x + r * QK;
      float am = 0, s = 0;
      for (int i = 0; i < QK; ++i) { am = std::max(am, std::fabs(xb[i])); s += xb[i]; }
      const float inv = am > 0 ? 127.f / am : 0.f;
      xd[r] = am / 127.f;
      xs[r] = s;
      int8_t* row = xq + m * K;
      for (int i = 0; i < QK; ++i)
        row[xq_index(j, i, nb, pair_order)] = static_cast<int8_t>(std::nearbyint(xb[i] * inv));
    }
}

// One repacked weight row against MT quantized activation rows.
template <int KIND, int MT>
inline void row_tile_q8(const uint8_t* row, const int8_t* xq, const float* xd, const float* xs, float* out,
                        int64_t N, int64_t K, int64_t nb) {
  constexpr int qbytes = KIND == kQ8 ? 32 : 16;
  const uint8_t* qs = row;
  const uint8_t* ds = row + nb * qbytes;
  const uint8_t* cs = ds + nb * 2;
  float res[MT];
  for (int m = 0; m < MT; ++m) res[m] = 0.f;
#ifdef PDS_AVX2
  // block scales d_j * dx_j for each activation row, 8 at a time (F16C)
  constexpr int kMaxNb = 256;  // K up to 8192 on this path
  alignas(32) float sc[MT][kMaxNb];
  int64_t j8 = 0;
  for (; j8 + 8 <= nb; j8 += 8) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ds + 2 * j8)));
    __m256 c = KIND == kQ4 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cs + 2 * j8)))
                           : _mm256_setzero_ps();
    for (int m = 0; m < MT; ++m) {
      _mm256_store_ps(sc[m] + j8, _mm256_mul_ps(d, _mm256_loadu_ps(xd + m * nb + j8)));
      if (KIND == kQ4) res[m] += hsum(_mm256_mul_ps(c, _mm256_loadu_ps(xs + m * nb + j8)));
    }
  }
  for (; j8 < nb; ++j8)
    for (int m = 0; m < MT; ++m) {
      sc[m][j8] = half_at(ds + 2 * j8) * xd[m * nb + j8];
      if (KIND == kQ4) res[m] += half_at(cs + 2 * j8) * xs[m * nb + j8];
    }
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  int64_t j = 0;
  if (KIND == kQ4) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (; j + 2 <= nb; j += 2) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + j * 16));
      const __m256i lo = _mm256_and_si256(v, low4);                         // blocks j, j+1: weights 0-15
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);   // weights 16-31
      for (int m = 0; m < MT; ++m) {
        const int8_t* xb = xq + m * K + j * QK;
        const __m256i p = _mm256_add_epi16(
            _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb))),
            _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 32))));
        const __m256 s = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(sc[m] + j)),
                                              _mm_broadcast_ss(sc[m] + j + 1), 1);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), s, acc[m]);
      }
    }
    if (j < nb) {  // an odd last block, natural order
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + j * 16));
      const __m128i l4 = _mm_set1_epi8(0x0F);
      const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), l4), _mm_and_si128(q, l4));
      for (int m = 0; m < MT; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + j * QK));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones)),
                                 _mm256_broadcast_ss(sc[m] + j), acc[m]);
      }
    }
  } else {
    for (; j < nb; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + j * 32));
      const __m256i wa = _mm256_sign_epi8(w, w);
      for (int m = 0; m < MT; ++m) {
        // signed x signed as |w| x (x * sign w)
        const __m256i xv = _mm256_sign_epi8(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + j * QK)), w);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(wa, xv), ones)),
                                 _mm256_broadcast_ss(sc[m] + j), acc[m]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) out[m * N] = res[m] + hsum(acc[m]);
#else
  for (int64_t j = 0; j < nb; ++j) {
    const float d = half_at(ds + 2 * j);
    const float c = KIND == kQ4 ? half_at(cs + 2 * j) : 0.f;
    for (int m = 0; m < MT; ++m) {
      const int8_t* xrow = xq + m * K;
      int32_t s = 0;
      for (int i = 0; i < QK; ++i) {
        const int w = KIND == kQ8 ? static_cast<int8_t>(qs[j * 32 + i])
                                  : (i < 16 ? qs[j * 16 + i] & 15 : qs[j * 16 + i - 16] >> 4);
        s += w * xrow[xq_index(j, i, nb, KIND == kQ4)];
      }
      res[m] += d * xd[m * nb + j] * static_cast<float>(s) + c * xs[m * nb + j];
    }
  }
  for (int m = 0; m < MT; ++m) out[m * N] = res[m];
#endif
}

template <int KIND>
void rows_q8(const uint8_t* w, const int8_t* xq, const float* xd, const float* xs, float* out, int64_t M,
             int64_t N, int64_t K, int64_t row_bytes, int64_t n0, int64_t n1) {
  const int64_t nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    prefetch_ahead(row, row_bytes, w + n1 * row_bytes);
    by_row_tiles(M, [&](auto mt, int64_t m) {
      row_tile_q8<KIND, decltype(mt)::value>(row, xq + m * K, xd + m * nb, xs + m * nb, out + m * N + n, N, K, nb);
    });
  }
}

}  // namespace

// From this many activation rows on, gguf_matmul expands weight rows to fp32 first:
// below 8 the per-row kernel is faster (docs/performance.md, run 4's kernel table,
// measured by flipping this with set_gguf_expand_rows).
int64_t kExpandFromRows = 8;

int64_t set_prefetch_bytes(int64_t bytes) {
  const int64_t old = kPrefetchBytes;
  kPrefetchBytes = bytes;
  return old;
}

int64_t set_gguf_expand_rows(int64_t rows) {
  const int64_t old = kExpandFromRows;
  kExpandFromRows = rows;
  return old;
}

// x: [M, K] float32 contiguous; w: [N, row_bytes] uint8 raw GGUF rows; returns [M, N] float32.
torch::Tensor gguf_matmul(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t K) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be contiguous float32");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w must be contiguous uint8");
  TORCH_CHECK(K % QK == 0 && x.size(1) == K, "K must be a multiple of 32 and match x");
  const int64_t M = x.size(0), N = w.size(0), nb = K / QK, row_bytes = w.size(1);
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  TORCH_CHECK(qtype == 2 || qtype == 3 || qtype == 8, "unsupported GGUF type ", qtype);
  if (M >= kExpandFromRows) {
    pds::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      if (qtype == 2) rows_expanded<2>(wp, xp, op, M, N, K, row_bytes, n0, n1);
      else if (qtype == 3) rows_expanded<3>(wp, xp, op, M, N, K, row_bytes, n0, n1);
      else rows_expanded<8>(wp, xp, op, M, N, K, row_bytes, n0, n1);
    });
    return out;
  }
  std::vector<float> xsum(M * nb);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < nb; ++j) {
      float s = 0;
      for (int i = 0; i < QK; ++i) s += xp[m * K + j * QK + i];
      xsum[m * nb + j] = s;
    }
  pds::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    if (qtype == 2) rows<2>(wp, xp, xsum.data(), op, M, N, K, row_bytes, n0, n1);
    else if (qtype == 3) rows<3>(wp, xp, xsum.data(), op, M, N, K, row_bytes, n0, n1);
    else rows<8>(wp, xp, xsum.data(), op, M, N, K, row_bytes, n0, n1);
  });
  return out;
}

// GGUF rows [N, row_bytes] -> the layout q8_matmul reads (same size; see repack_row).
torch::Tensor q8_repack(torch::Tensor w, int64_t qtype, int64_t K) {
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.dim() == 2, "w must be 2-D contiguous uint8");
  TORCH_CHECK(qtype == 2 || qtype == 3 || qtype == 8, "unsupported GGUF type ", qtype);
  TORCH_CHECK(K % QK == 0 && K / QK <= 256, "K must be a multiple of 32, at most 8192");
  const int64_t nb = K / QK, bytes = qtype == 2 ? 18 : qtype == 3 ? 20 : 34;
  TORCH_CHECK(w.size(1) == nb * bytes, "row size does not match K and the type");
  const int64_t packed = qtype == 8 ? nb * 34 : nb * 20;  // Q4_0 grows by its 2-byte constants
  auto out = torch::empty({w.size(0), packed}, w.options());
  for (int64_t n = 0; n < w.size(0); ++n)
    repack_row(w.data_ptr<uint8_t>() + n * w.size(1), out.data_ptr<uint8_t>() + n * packed, qtype, nb);
  return out;
}

// x @ W.T with the activations rounded to int8 per 32-value block (opt-in; see row_tile_q8).
// w: q8_repack's output. x: [M, K] float32; returns [M, N] float32.
torch::Tensor q8_matmul(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t K) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be contiguous float32");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "w must be contiguous uint8");
  TORCH_CHECK(K % QK == 0 && x.size(1) == K && K / QK <= 256, "K must be a multiple of 32 (<= 8192) and match x");
  TORCH_CHECK(qtype == 2 || qtype == 3 || qtype == 8, "unsupported GGUF type ", qtype);
  const int64_t M = x.size(0), N = w.size(0), nb = K / QK, row_bytes = w.size(1);
  TORCH_CHECK(row_bytes == (qtype == 8 ? nb * 34 : nb * 20), "w is not a q8_repack of this K and type");
  auto out = torch::empty({M, N}, x.options());
  std::vector<int8_t> xq(M * K);
  std::vector<float> xd(M * nb), xs(M * nb);
  const int kind = packed_kind(qtype);
  quantize_rows(x.data_ptr<float>(), xq.data(), xd.data(), xs.data(), M, K, kind == kQ4);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  pds::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    if (kind == kQ4) rows_q8<kQ4>(wp, xq.data(), xd.data(), xs.data(), op, M, N, K, row_bytes, n0, n1);
    else rows_q8<kQ8>(wp, xq.data(), xd.data(), xs.data(), op, M, N, K, row_bytes, n0, n1);
  });
  return out;
}
