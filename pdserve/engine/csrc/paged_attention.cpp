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
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

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
// fp32 K rows: two tokens per iteration so two FMA chains run at once.
inline void scores_f32(const float* q, const float* const* krows, int64_t len, int64_t D, float* out) {
  int64_t t = 0;
  for (; t + 2 <= len; t += 2) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(krows[t] + i), a0);
      a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(krows[t + 1] + i), a1);
    }
    // horizontal sums of both accumulators together
    __m256 h = _mm256_hadd_ps(a0, a1);
    __m128 lo = _mm256_castps256_ps128(h), hi = _mm256_extractf128_ps(h, 1);
    __m128 sum = _mm_add_ps(lo, hi);  // [a0 01, a0 23, a1 01, a1 23] pairs
    sum = _mm_hadd_ps(sum, sum);
    out[t] = _mm_cvtss_f32(sum);
    out[t + 1] = _mm_cvtss_f32(_mm_shuffle_ps(sum, sum, 1));
  }
  for (; t < len; ++t) out[t] = dot(q, krows[t], D);
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
#define PDS_AVX2_ATTN 1
#endif

template <typename T>
void decode_kernel(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                   const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                   const torch::Tensor& seq_lens, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH, max_blocks = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t tok_stride = KVH * D, blk_stride = BS * KVH * D;

  pds::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    std::vector<const T*> krows;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / KVH, h = idx % KVH, len = lens[b];
      const int64_t* table = bt + b * max_blocks;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = to_f(qp[(b * H + h * G) * D + i]) * (float)scale;
      scores.assign(G * len, 0.f);
      krows.resize(len);
      for (int64_t t = 0; t < len; ++t) krows[t] = kp + table[t / BS] * blk_stride + (t % BS) * tok_stride + h * D;
#ifdef PDS_AVX2_ATTN
      if constexpr (std::is_same<T, float>::value) {
        if (D % 8 == 0) {
          for (int64_t g = 0; g < G; ++g) scores_f32(qf.data() + g * D, krows.data(), len, D, scores.data() + g * len);
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
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const T* vrow = vp + table[t / BS] * blk_stride + (t % BS) * tok_stride + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * len + t];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) a[i] += w * to_f(vrow[i]);
        }
      }
      for (int64_t i = 0; i < G * D; ++i) op[(b * H + h * G) * D + i] = static_cast<T>(acc[i]);
    }
  });
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
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(out, q, k_cache, v_cache, block_tables, seq_lens, scale);
  });
}

torch::Tensor gguf_matmul(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t K);
void register_decode_layer(pybind11::module& m);
int64_t pool_check(int64_t n, int64_t grain, int64_t loops, int64_t work);
int64_t set_gguf_expand_rows(int64_t rows);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("gguf_matmul", &gguf_matmul, "x @ W.T with W in raw GGUF Q4_0/Q4_1/Q8_0 blocks (CPU)");
  register_decode_layer(m);
  m.def("set_gguf_expand_rows", &set_gguf_expand_rows,
        "gguf_matmul expands weights to fp32 from this many rows on; returns the previous value");
  m.def("pool_check", &pool_check, "self-check of the parallel loop: indices not run exactly once");
}
