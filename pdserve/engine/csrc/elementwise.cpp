// Fused elementwise kernels for the layer-by-layer path in bf16 mode (CPU).
//
// On the CPU each PyTorch bf16 elementwise op widens its inputs to fp32, computes,
// rounds back and writes a new tensor: RMSNorm is ~6 such passes (cast, pow, mean,
// rsqrt, mul, cast, mul), RoPE ~10 (slices, neg, cat, cos/sin casts, mul, add), SiLU * up
// 2, each residual add 1. In a batch-64 decode step they took more CPU time than the
// matrix products. Here each is one pass over its rows: bf16 in and out, fp32 arithmetic.
//
// The roundings are PyTorch's (and so transformers'): RMSNorm rounds the normalised row
// to bf16 before the bf16 weight multiplies it; RoPE rounds cos/sin to bf16 and rounds
// each product and the sum; SiLU is rounded before the product with `up`; every rounding
// is to nearest even, as c10::BFloat16 does. What may differ from PyTorch is the order of
// the sum of squares and exp (simd_exp.h vs Sleef) in fp32's last bits, so now and then an
// output differs by one bf16 ulp (tests/engine/test_elementwise.py).
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "pool.h"
#include "simd_exp.h"

namespace {

using bf16 = c10::BFloat16;

// Rows per parallel chunk: a few thousand elements, so that the pool's hand-off (~1 us)
// stays small next to the work.
int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 4096 / std::max<int64_t>(width, 1)); }

inline float widen(bf16 x) { return static_cast<float>(x); }
inline float round_bf16(float x) { return static_cast<float>(bf16(x)); }

// A few vector operations on fp32 lanes, 16 wide with AVX-512 and 8 wide with AVX2, so that
// each kernel below is written once. bf16 loads are exact (a bf16 is the top half of an
// fp32); bf16 stores round as c10::BFloat16 does (nearest even, NaN stays NaN).
#if defined(__AVX512F__) && defined(PDS_SIMD_EXP)
#define PDS_EW_VEC 1
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec vset(float x) { return _mm512_set1_ps(x); }
inline Vec vloadf(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec a) { return _mm512_reduce_add_ps(a); }
// bf16 bit patterns of the rounded lanes, in the low half of each 32-bit lane
inline __m512i vround_bits(Vec v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}
inline Vec vround(Vec v) { return _mm512_castsi512_ps(_mm512_slli_epi32(vround_bits(v), 16)); }
inline void vstore(bf16* p, Vec v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(vround_bits(v)));
}
inline Vec vexp(Vec x) { return pds::exp16(x); }  // simd_exp.h
#elif defined(PDS_SIMD_EXP)
#define PDS_EW_VEC 1
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec vset(float x) { return _mm256_set1_ps(x); }
inline Vec vloadf(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec vfmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec a) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline __m256i vround_bits(Vec v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline Vec vround(Vec v) { return _mm256_castsi256_ps(_mm256_slli_epi32(vround_bits(v), 16)); }
inline void vstore(bf16* p, Vec v) {
  // packus works within 128-bit halves: gather the two packed quarters into the low half
  const __m256i r = vround_bits(v);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline Vec vexp(Vec x) { return pds::exp8(x); }
#endif

// sum of squares of x[0, H)
float sum_squares(const bf16* x, int64_t H) {
  int64_t i = 0;
  float ss = 0;
#ifdef PDS_EW_VEC
  Vec acc = vset(0.f);
  for (; i + kLanes <= H; i += kLanes) {
    const Vec v = vload(x + i);
    acc = vfmadd(v, v, acc);
  }
  ss = vsum(acc);
#endif
  for (; i < H; ++i) ss += widen(x[i]) * widen(x[i]);
  return ss;
}

// res += x (rounded to bf16, as a bf16 add is); returns the new row's sum of squares
float add_sum_squares(bf16* res, const bf16* x, int64_t H) {
  int64_t i = 0;
  float ss = 0;
#ifdef PDS_EW_VEC
  Vec acc = vset(0.f);
  for (; i + kLanes <= H; i += kLanes) {
    const Vec v = vround(vadd(vload(res + i), vload(x + i)));
    vstore(res + i, v);
    acc = vfmadd(v, v, acc);
  }
  ss = vsum(acc);
#endif
  for (; i < H; ++i) {
    res[i] = bf16(widen(res[i]) + widen(x[i]));
    ss += widen(res[i]) * widen(res[i]);
  }
  return ss;
}

// out = w * bf16(x * r): the row normalised, rounded to bf16, then scaled by the weight
void scale_row(const bf16* x, const bf16* w, float r, bf16* out, int64_t H) {
  int64_t i = 0;
#ifdef PDS_EW_VEC
  const Vec rv = vset(r);
  for (; i + kLanes <= H; i += kLanes) vstore(out + i, vmul(vload(w + i), vround(vmul(vload(x + i), rv))));
#endif
  for (; i < H; ++i) out[i] = bf16(widen(w[i]) * round_bf16(widen(x[i]) * r));
}

// 1 / sqrt(mean + eps), as torch.rsqrt(x.pow(2).mean(-1) + eps) computes it in fp32
inline float inv_rms(float ss, int64_t H, float eps) { return 1.f / std::sqrt(ss / static_cast<float>(H) + eps); }

// dst <- x * cos + rotate_half(x) * sin over `heads` heads of D, in bf16 steps: cos and sin
// rounded to bf16, each product rounded, then their sum. dst may be x (in place).
void rope_heads(const bf16* x, bf16* dst, const float* cos, const float* sin, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const bf16* a = x + h * D;
    const bf16* b = a + half;
    bf16* da = dst + h * D;
    bf16* db = da + half;
    int64_t i = 0;
#ifdef PDS_EW_VEC
    for (; i + kLanes <= half; i += kLanes) {
      const Vec av = vload(a + i), bv = vload(b + i);
      const Vec c1 = vround(vloadf(cos + i)), s1 = vround(vloadf(sin + i));
      const Vec c2 = vround(vloadf(cos + half + i)), s2 = vround(vloadf(sin + half + i));
      // -b * s rounds to exactly -(b * s rounded): subtracting it is the same as adding -b * s
      vstore(da + i, vsub(vround(vmul(av, c1)), vround(vmul(bv, s1))));
      vstore(db + i, vadd(vround(vmul(bv, c2)), vround(vmul(av, s2))));
    }
#endif
    for (; i < half; ++i) {
      const float av = widen(a[i]), bv = widen(b[i]);
      da[i] = bf16(round_bf16(av * round_bf16(cos[i])) - round_bf16(bv * round_bf16(sin[i])));
      db[i] = bf16(round_bf16(bv * round_bf16(cos[half + i])) + round_bf16(av * round_bf16(sin[half + i])));
    }
  }
}

// out[i] = bf16(silu(g[i])) * u[i], silu(g) = g / (1 + exp(-g)) as PyTorch computes it
void silu_mul_row(const bf16* g, const bf16* u, bf16* out, int64_t I) {
  int64_t i = 0;
#ifdef PDS_EW_VEC
  const Vec one = vset(1.f), zero = vset(0.f);
  for (; i + kLanes <= I; i += kLanes) {
    const Vec gv = vload(g + i);
    const Vec s = vdiv(gv, vadd(one, vexp(vsub(zero, gv))));
    vstore(out + i, vmul(vround(s), vload(u + i)));
  }
#endif
  for (; i < I; ++i) {
    const float gv = widen(g[i]);
    out[i] = bf16(round_bf16(gv / (1.f + std::exp(-gv))) * widen(u[i]));
  }
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kBFloat16 && t.dim() == 2 && t.is_contiguous(),
              name, " must be a contiguous 2-D bfloat16 CPU tensor");
}

void check_weight(const torch::Tensor& w, int64_t H) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kBFloat16 && w.dim() == 1 && w.is_contiguous() &&
                  w.size(0) == H,
              "weight must be a contiguous bfloat16 CPU vector of the rows' width");
}

// out = RMSNorm(x) * weight, x: [T, H]
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  const int64_t T = x.size(0), H = x.size(1);
  check_weight(weight, H);
  auto out = torch::empty_like(x);
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const float feps = static_cast<float>(eps);
  pds::parallel_for(0, T, row_grain(H), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) scale_row(xp + t * H, wp, inv_rms(sum_squares(xp + t * H, H), H, feps), op + t * H, H);
  });
  return out;
}

// residual += x in place, then out = RMSNorm(residual) * weight; x, residual: [T, H].
// One pass for a layer's residual add and the next norm (vLLM's fused_add_rms_norm).
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual must have the same shape");
  const int64_t T = x.size(0), H = x.size(1);
  check_weight(weight, H);
  auto out = torch::empty_like(x);
  const bf16* xp = x.data_ptr<bf16>();
  bf16* rp = residual.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const float feps = static_cast<float>(eps);
  pds::parallel_for(0, T, row_grain(H), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float ss = add_sum_squares(rp + t * H, xp + t * H, H);
      scale_row(rp + t * H, wp, inv_rms(ss, H, feps), op + t * H, H);
    }
  });
  return out;
}

// RoPE on the q and k heads of the fused projection qkv: [T, (H + 2 KVH) * D]; cos, sin:
// fp32 tables [max_positions, D], row `positions[t]` for token t. Returns q, k, v as
// [T, heads, D]: k rotated in place and v, views of qkv (rows strided by the fused width);
// q rotated into a tensor of its own, contiguous, as attention wants it (the decode kernel
// takes contiguous queries: a view would be copied there once more).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rope_qkv(torch::Tensor qkv, torch::Tensor cos,
                                                                 torch::Tensor sin, torch::Tensor positions,
                                                                 int64_t n_heads, int64_t n_kv, int64_t head_dim) {
  check_rows(qkv, "qkv");
  const int64_t T = qkv.size(0), D = head_dim, width = (n_heads + 2 * n_kv) * D;
  TORCH_CHECK(D > 0 && D % 2 == 0 && n_heads > 0 && n_kv > 0 && qkv.size(1) == width,
              "qkv must be [T, (n_heads + 2 n_kv) * head_dim] with an even head_dim");
  for (const auto* table : {&cos, &sin})
    TORCH_CHECK(table->device().is_cpu() && table->scalar_type() == torch::kFloat32 && table->dim() == 2 &&
                    table->is_contiguous() && table->size(1) == D && table->size(0) == cos.size(0),
                "cos and sin must be contiguous float32 [max_positions, head_dim] tables of one shape");
  TORCH_CHECK(positions.device().is_cpu() && positions.scalar_type() == torch::kInt64 && positions.dim() == 1 &&
                  positions.is_contiguous() && positions.size(0) == T,
              "positions must be a contiguous int64 vector of T entries");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)  // checked here: the parallel loop must not throw
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " outside the rope table");
  const int64_t q_size = n_heads * D, kv_size = n_kv * D;
  auto q = torch::empty({T, n_heads, D}, qkv.options());
  bf16* xp = qkv.data_ptr<bf16>();
  bf16* qp = q.data_ptr<bf16>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  pds::parallel_for(0, T, row_grain((n_heads + n_kv) * D), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cp + pos[t] * D;
      const float* s = sp + pos[t] * D;
      bf16* row = xp + t * width;
      rope_heads(row, qp + t * q_size, c, s, n_heads, D);
      rope_heads(row + q_size, row + q_size, c, s, n_kv, D);
    }
  });
  return {q, qkv.narrow(1, q_size, kv_size).view({T, n_kv, D}),
          qkv.narrow(1, q_size + kv_size, kv_size).view({T, n_kv, D})};
}

// [T, 2I] (gate then up, the fused projection's output) -> silu(gate) * up: [T, I]
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  const bf16* gp = gate_up.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  pds::parallel_for(0, T, row_grain(2 * I), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) silu_mul_row(gp + t * 2 * I, gp + t * 2 * I + I, op + t * I, I);
  });
  return out;
}

}  // namespace

void register_elementwise(pybind11::module& m) {
  m.def("rms_norm", &rms_norm, "RMSNorm(x) * weight for bf16 rows (CPU)", pybind11::arg("x"),
        pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place; returns RMSNorm(residual) * weight (bf16, CPU)",
        pybind11::arg("x"), pybind11::arg("residual"), pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("rope_qkv", &rope_qkv, "RoPE on q and k of a fused bf16 qkv (k in place); returns q (contiguous), k, v (CPU)",
        pybind11::arg("qkv"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("positions"),
        pybind11::arg("n_heads"), pybind11::arg("n_kv"), pybind11::arg("head_dim"));
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for bf16 [T, 2I] -> [T, I] (CPU)", pybind11::arg("gate_up"));
}
