// One decoder layer for a batch of decode tokens, in one call from Python.
//
// A decode step of a 135M model does ~40 small tensor operations per layer
// (norms, rope, slicing, the KV write, residuals); at batch 1 their Python and
// ATen dispatch cost (~10-15 us each, ~15 ms per step) was as large as all the
// matrix products. Here the whole layer runs in C++: RMSNorm, the fused qkv
// product on the GGUF blocks, RoPE, the KV slot write, paged attention, o-proj,
// residual, RMSNorm, gate/up, SiLU * up, down, residual. Only the matrix
// products and attention are parallel (the rest is a few thousand floats).
//
// The arithmetic is the Python path's, step for step: the same GGUF kernel, the
// same attention kernel, fp32 norms as (x * rsqrt(mean(x^2) + eps)) * w; only the
// compiler's fused multiply-adds in RoPE and the SiLU's exp round differently
// (~1e-6 relative; tests/engine/test_kernels.py compares both paths).
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <optional>

#include "simd_exp.h"

#ifdef PDS_SIMD_EXP
#define PDS_AVX2_LAYER 1
#endif

torch::Tensor gguf_matmul(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t K);
torch::Tensor q8_matmul(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t K);
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_tables, torch::Tensor seq_lens, double scale);

namespace {

void rmsnorm(const float* x, const float* w, float* out, int64_t M, int64_t H, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * H;
    float ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
    float* o = out + m * H;
    for (int64_t i = 0; i < H; ++i) o[i] = w[i] * (xr[i] * r);
  }
}

// x <- x * cos + rotate_half(x) * sin for `heads` heads of size D at x.
void rope(float* x, const float* cos, const float* sin, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * D;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}


// out[m, i] = silu(gu[m, i]) * gu[m, I + i]
void silu_mul(const float* gu, float* out, int64_t M, int64_t I) {
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gu + m * 2 * I;
    const float* u = g + I;
    float* o = out + m * I;
    int64_t i = 0;
#ifdef PDS_AVX2_LAYER
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= I; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 e = pds::exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
      const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
}

struct DecodeLayer {
  torch::Tensor ln1, ln2, qkv, o, gate_up, down;
  std::optional<torch::Tensor> qkv_bias;
  int64_t t_qkv, t_o, t_gate_up, t_down;
  int64_t n_heads, n_kv, head_dim, hidden, inter;
  double eps;
  bool int8_activations = false;  // opt-in: q8_matmul on q8_repack weights

  torch::Tensor mm(torch::Tensor x, const torch::Tensor& w, int64_t qtype, int64_t K) const {
    return int8_activations ? q8_matmul(x, w, qtype, K) : gguf_matmul(x, w, qtype, K);
  }

  // x: [M, hidden] fp32; cos, sin: [M, head_dim] fp32; caches [blocks, block_size, n_kv, head_dim] fp32
  // or bf16 (bf16 mode: K/V are rounded to bf16 when written, attention reads them widened);
  // slots: [M] int64; block_tables [M, max_blocks] int64; seq_lens [M] int64. Returns the new x.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                        torch::Tensor v_cache, torch::Tensor slots, torch::Tensor block_tables,
                        torch::Tensor seq_lens) const {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.size(1) == hidden, "bad x");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == head_dim &&
                cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32, "bad cos/sin");
    const bool bf16_cache = k_cache.scalar_type() == torch::kBFloat16;
    TORCH_CHECK((k_cache.scalar_type() == torch::kFloat32 || bf16_cache) && v_cache.scalar_type() == k_cache.scalar_type()
                    && k_cache.is_contiguous() && v_cache.is_contiguous(),
                "caches must be contiguous float32 or bfloat16");
    const int64_t M = x.size(0), D = head_dim, q_size = n_heads * D, kv_size = n_kv * D;
    const float feps = static_cast<float>(eps);
    auto h = torch::empty_like(x);
    rmsnorm(x.data_ptr<float>(), ln1.data_ptr<float>(), h.data_ptr<float>(), M, hidden, feps);
    auto qkv_out = mm(h, qkv, t_qkv, hidden);  // [M, q + 2 kv]
    if (qkv_bias) qkv_out.add_(*qkv_bias);
    const int64_t width = q_size + 2 * kv_size;
    float* qp = qkv_out.data_ptr<float>();
    const int64_t* sp = slots.data_ptr<int64_t>();
    float* kc = bf16_cache ? nullptr : k_cache.data_ptr<float>();
    float* vc = bf16_cache ? nullptr : v_cache.data_ptr<float>();
    c10::BFloat16* kb = bf16_cache ? k_cache.data_ptr<c10::BFloat16>() : nullptr;
    c10::BFloat16* vb = bf16_cache ? v_cache.data_ptr<c10::BFloat16>() : nullptr;
    auto q = torch::empty({M, n_heads, D}, x.options());
    float* qc = q.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m) {
      float* row = qp + m * width;
      const float* c = cos.data_ptr<float>() + m * D;
      const float* s = sin.data_ptr<float>() + m * D;
      rope(row, c, s, n_heads + n_kv, D);  // q heads then k heads, contiguous in the row
      std::memcpy(qc + m * q_size, row, q_size * sizeof(float));
      if (bf16_cache) {  // rounded to nearest even, as tensor.to(torch.bfloat16) does
        for (int64_t i = 0; i < kv_size; ++i) {
          kb[sp[m] * kv_size + i] = c10::BFloat16(row[q_size + i]);
          vb[sp[m] * kv_size + i] = c10::BFloat16(row[q_size + kv_size + i]);
        }
      } else {
        std::memcpy(kc + sp[m] * kv_size, row + q_size, kv_size * sizeof(float));
        std::memcpy(vc + sp[m] * kv_size, row + q_size + kv_size, kv_size * sizeof(float));
      }
    }
    auto attn = torch::empty({M, n_heads, D}, x.options());
    paged_decode_attention(attn, q, k_cache, v_cache, block_tables, seq_lens, 1.0 / std::sqrt((double)D));
    auto out = mm(attn.view({M, q_size}), o, t_o, q_size);
    float* xo = out.data_ptr<float>();
    const float* xi = x.data_ptr<float>();
    for (int64_t i = 0; i < M * hidden; ++i) xo[i] = xi[i] + xo[i];
    rmsnorm(xo, ln2.data_ptr<float>(), h.data_ptr<float>(), M, hidden, feps);
    auto gu = mm(h, gate_up, t_gate_up, hidden);  // [M, 2 inter]
    auto act = torch::empty({M, inter}, x.options());
    silu_mul(gu.data_ptr<float>(), act.data_ptr<float>(), M, inter);
    auto d = mm(act, down, t_down, inter);
    const float* dp = d.data_ptr<float>();
    for (int64_t i = 0; i < M * hidden; ++i) xo[i] = xo[i] + dp[i];
    return out;
  }
};

}  // namespace

void register_decode_layer(pybind11::module& m) {
  pybind11::class_<DecodeLayer>(m, "DecodeLayer")
      .def(pybind11::init([](torch::Tensor ln1, torch::Tensor ln2, torch::Tensor qkv, int64_t t_qkv,
                             std::optional<torch::Tensor> qkv_bias, torch::Tensor o, int64_t t_o,
                             torch::Tensor gate_up, int64_t t_gate_up, torch::Tensor down, int64_t t_down,
                             int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t inter, double eps,
                             bool int8_activations) {
        TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even");
        TORCH_CHECK(ln1.scalar_type() == torch::kFloat32 && ln2.scalar_type() == torch::kFloat32,
                    "norm weights must be float32");
        return DecodeLayer{ln1.contiguous(), ln2.contiguous(), qkv, o, gate_up, down, qkv_bias,
                           t_qkv, t_o, t_gate_up, t_down, n_heads, n_kv, head_dim, ln1.size(0), inter, eps,
                           int8_activations};
      }))
      .def("forward", &DecodeLayer::forward, "one decoder layer for decode tokens (CPU, float32)");
}
