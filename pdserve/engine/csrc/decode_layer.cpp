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
//
// LoRA adapters (engine/lora.py) add their deltas here too, for the rows of each adapter
// group, after the product they change: a few dot products of the adapter's small rank per
// row, where the Python path would cost ~4 ATen calls per product and give up this layer.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "pool.h"
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

// One adapter group of a step: its rows (every row when absent), its scaling, and for each of
// the products qkv, o, gate_up, down (absent where the adapter leaves it alone): A^T [K, R],
// B^T [R, N] in float32, and B^T's nonzero blocks [P, 4] (first and end row j, first and end
// column n: one per projection of a fused product, whose other columns its rows leave alone).
using OptT = std::optional<torch::Tensor>;
using LoraMats = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor>;
using LoraGroup = std::tuple<OptT, double, std::vector<std::optional<LoraMats>>>;

// out[r] += s * ((in[r] A^T) B^T) for the group's rows: the delta is summed apart, then added,
// as PEFT adds its adapter's output to the base projection's. The second product runs over
// B's nonzero blocks only, its columns shared out among the threads.
void lora_add(const torch::Tensor& in, torch::Tensor& out, const LoraGroup& g, size_t product) {
  const auto& products = std::get<2>(g);
  if (product >= products.size() || !products[product]) return;
  const auto& [a, b, blocks] = *products[product];
  const int64_t M = in.size(0), K = in.size(1), N = out.size(1), R = a.size(1);
  TORCH_CHECK(a.scalar_type() == torch::kFloat32 && b.scalar_type() == torch::kFloat32 && a.is_contiguous() &&
                  b.is_contiguous() && a.size(0) == K && b.size(0) == R && b.size(1) == N,
              "bad LoRA matrices");
  TORCH_CHECK(blocks.scalar_type() == torch::kInt64 && blocks.is_contiguous() && blocks.dim() == 2 &&
                  blocks.size(1) == 4, "bad LoRA blocks");
  TORCH_CHECK(in.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32 && in.is_contiguous() &&
                  out.is_contiguous() && in.dim() == 2 && out.dim() == 2 && out.size(0) == M,
              "LoRA input and output must be contiguous float32 [M, K], [M, N]");
  const OptT& rows = std::get<0>(g);
  TORCH_CHECK(!rows || (rows->scalar_type() == torch::kInt64 && rows->is_contiguous() && rows->device().is_cpu()),
              "LoRA rows must be a contiguous int64 CPU tensor");
  const int64_t n_rows = rows ? rows->numel() : M;
  const int64_t* row_ids = rows ? rows->data_ptr<int64_t>() : nullptr;
  const float s = static_cast<float>(std::get<1>(g));
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  const int64_t* bl = blocks.data_ptr<int64_t>();
  const int64_t P = blocks.size(0);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(0 <= bl[4 * p] && bl[4 * p] <= bl[4 * p + 1] && bl[4 * p + 1] <= R && 0 <= bl[4 * p + 2] &&
                    bl[4 * p + 2] <= bl[4 * p + 3] && bl[4 * p + 3] <= N, "LoRA block out of range");
  }
  std::vector<int64_t> rs(n_rows);
  for (int64_t i = 0; i < n_rows; ++i) {
    rs[i] = row_ids ? row_ids[i] : i;
    TORCH_CHECK(rs[i] >= 0 && rs[i] < M, "LoRA row out of range");
  }
  std::vector<float> t(n_rows * R, 0.f);  // in[r] A^T, a row each
  const float* xp = in.data_ptr<float>();
  for (int64_t i = 0; i < n_rows; ++i) {
    const float* x = xp + rs[i] * K;
    float* ti = t.data() + i * R;
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[k];
      const float* ar = ap + k * R;
#pragma omp simd
      for (int64_t j = 0; j < R; ++j) ti[j] += xv * ar[j];
    }
  }
  float* op = out.data_ptr<float>();
  pds::parallel_for(0, N, 64, [&](int64_t c0, int64_t c1) {
    std::vector<float> d(c1 - c0);
    for (int64_t i = 0; i < n_rows; ++i) {
      std::fill(d.begin(), d.end(), 0.f);
      const float* ti = t.data() + i * R;
      for (int64_t p = 0; p < P; ++p) {
        const int64_t lo = std::max(bl[4 * p + 2], c0), hi = std::min(bl[4 * p + 3], c1);
        for (int64_t j = bl[4 * p]; j < bl[4 * p + 1] && lo < hi; ++j) {
          const float tv = ti[j];
          const float* br = bp + j * N;
          float* dd = d.data() - c0;
#pragma omp simd
          for (int64_t n = lo; n < hi; ++n) dd[n] += tv * br[n];
        }
      }
      float* o = op + rs[i] * N;
#pragma omp simd
      for (int64_t n = c0; n < c1; ++n) o[n] += d[n - c0] * s;
    }
  });
}

struct DecodeLayer {
  torch::Tensor ln1, ln2, qkv, o, gate_up, down;
  std::optional<torch::Tensor> qkv_bias;
  std::optional<torch::Tensor> q_norm, k_norm;  // Qwen3: [head_dim] fp32, each head of q / k normalised
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
                        torch::Tensor seq_lens, const std::vector<LoraGroup>& lora) const {
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
    for (const auto& g : lora) lora_add(h, qkv_out, g, 0);
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
      if (q_norm) {  // in place: each head a row of D, as the Python path's RMSNorm over head_dim
        rmsnorm(row, q_norm->data_ptr<float>(), row, n_heads, D, feps);
        rmsnorm(row + q_size, k_norm->data_ptr<float>(), row + q_size, n_kv, D, feps);
      }
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
    for (const auto& g : lora) lora_add(attn.view({M, q_size}), out, g, 1);
    float* xo = out.data_ptr<float>();
    const float* xi = x.data_ptr<float>();
    for (int64_t i = 0; i < M * hidden; ++i) xo[i] = xi[i] + xo[i];
    rmsnorm(xo, ln2.data_ptr<float>(), h.data_ptr<float>(), M, hidden, feps);
    auto gu = mm(h, gate_up, t_gate_up, hidden);  // [M, 2 inter]
    for (const auto& g : lora) lora_add(h, gu, g, 2);
    auto act = torch::empty({M, inter}, x.options());
    silu_mul(gu.data_ptr<float>(), act.data_ptr<float>(), M, inter);
    auto d = mm(act, down, t_down, inter);
    for (const auto& g : lora) lora_add(act, d, g, 3);
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
                             bool int8_activations, std::optional<torch::Tensor> q_norm,
                             std::optional<torch::Tensor> k_norm) {
        TORCH_CHECK(head_dim % 2 == 0, "head_dim must be even");
        TORCH_CHECK(ln1.scalar_type() == torch::kFloat32 && ln2.scalar_type() == torch::kFloat32,
                    "norm weights must be float32");
        TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
        for (const auto* n : {&q_norm, &k_norm}) {
          TORCH_CHECK(!n->has_value() || ((*n)->scalar_type() == torch::kFloat32 && (*n)->numel() == head_dim),
                      "q/k norm weights must be float32 [head_dim]");
        }
        if (q_norm) q_norm = q_norm->contiguous(), k_norm = k_norm->contiguous();
        return DecodeLayer{ln1.contiguous(), ln2.contiguous(), qkv, o, gate_up, down, qkv_bias, q_norm, k_norm,
                           t_qkv, t_o, t_gate_up, t_down, n_heads, n_kv, head_dim, ln1.size(0), inter, eps,
                           int8_activations};
      }))
      .def("forward", &DecodeLayer::forward, pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("slots"), pybind11::arg("block_tables"),
           pybind11::arg("seq_lens"), pybind11::arg("lora") = std::vector<LoraGroup>(),
           "one decoder layer for decode tokens (CPU, float32), with the LoRA groups' deltas");
}
