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
#include <cstdint>
#include <cstring>
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
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) row_tile<QTYPE, 4>(row, x + m * K, xsum + m * nb, out + m * N + n, N, K, nb);
    switch (M - m) {
      case 3: row_tile<QTYPE, 3>(row, x + m * K, xsum + m * nb, out + m * N + n, N, K, nb); break;
      case 2: row_tile<QTYPE, 2>(row, x + m * K, xsum + m * nb, out + m * N + n, N, K, nb); break;
      case 1: row_tile<QTYPE, 1>(row, x + m * K, xsum + m * nb, out + m * N + n, N, K, nb); break;
      default: break;
    }
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
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile<NT, 4>(w, x + m * K, out + m * N, N, K);
  switch (M - m) {
    case 3: tile<NT, 3>(w, x + m * K, out + m * N, N, K); break;
    case 2: tile<NT, 2>(w, x + m * K, out + m * N, N, K); break;
    case 1: tile<NT, 1>(w, x + m * K, out + m * N, N, K); break;
    default: break;
  }
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

}  // namespace

// From this many activation rows on, gguf_matmul expands weight rows to fp32 first:
// below 8 the per-row kernel is faster (docs/performance.md, run 4's kernel table,
// measured by flipping this with set_gguf_expand_rows).
int64_t kExpandFromRows = 8;

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
