// Many-row products with int8 activations against GGUF blocks (prefill, batched decode).
//
// On a CPU without native bf16 (AVX2 only, no AVX512-BF16) an fp32 GEMM is the
// fastest float product there is: two 8-wide FMAs a cycle. `vpmaddubsw` multiplies
// 32 byte pairs and adds neighbours in one instruction, so a product whose both
// sides are bytes can go several times faster. The weights already are small
// integers: a Q4_0/Q4_1 block is w = d * q + c with q in [0, 15]; a Q8_0 block is
// w = d * q with q in [-127, 127]. The activations are rounded to int8 per block of
// 32 (scale max|x| / 127, as the small-batch int8 kernel in gguf_matmul.cpp does),
// so one block of a dot product is
//
//     d_w * d_x * sum(q_i * xq_i)  +  c_w * sum(x_i)        (sum(x_i): the exact fp32 sum)
//
// and only the activations are rounded: the weights are the GGUF file's own numbers.
//
// The weights are repacked once (q8_gemm_pack) into tiles of 16 output channels:
// per block, 8 groups of 4 consecutive k, each group 16 channels x 4 bytes (two
// 32-byte vectors), then the tile's 16 scales and 16 constants as fp32. The kernel
// broadcasts 4 activation bytes of a row and multiplies them against a group with
// one `vpmaddubsw` per vector. For Q4 weights (q <= 15, |xq| <= 127) a 16-bit lane
// sums at most 16 products of a block, 16 * 15 * 127 = 30480 < 32767: the whole
// block accumulates in 16-bit lanes (`vpaddw`, no saturation possible) and widens
// once at its end. Q8 weights are signed: the sign goes onto the activation
// (`vpsignb`) so that the unsigned operand is |q|, and each group widens at once.
#include <torch/extension.h>

#include "pool.h"
#include <c10/util/Half.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDS_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int QK = 32;         // weights per GGUF block
constexpr int NR = 16;         // output channels per tile
constexpr int kGroupBytes = NR * 4;                   // one group of 4 k for the tile's 16 channels
constexpr int kQBytes = (QK / 4) * kGroupBytes;       // a block's weights in a tile: 512
constexpr int kBlockBytes = kQBytes + NR * 4;         // + the 16 channels' fp32 scales
constexpr int kQ4 = 0, kQ8 = 1;

inline float half_bits(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

int kind_of(int64_t qtype) { return qtype == 8 ? kQ8 : kQ4; }

// One GGUF block (type 2: Q4_0, 3: Q4_1, 8: Q8_0) -> its 32 integer weights, scale and constant.
void unpack_block(const uint8_t* b, int64_t qtype, int8_t q[QK], float* d, float* c) {
  *d = half_bits(b);
  if (qtype == 8) {
    std::memcpy(q, b + 2, QK);
    *c = 0.f;
    return;
  }
  const uint8_t* qs = b + (qtype == 3 ? 4 : 2);
  for (int i = 0; i < 16; ++i) {
    q[i] = static_cast<int8_t>(qs[i] & 0x0F);
    q[i + 16] = static_cast<int8_t>(qs[i] >> 4);
  }
  *c = qtype == 3 ? half_bits(b + 2) : -8.f * *d;
}

// ---- the micro-kernel: MR activation rows x one tile of 16 channels ----

#ifdef PDS_AVX2
// 4 activation bytes (one group of k) of a row, in every 32-bit lane.
inline __m256i bcast4(const int8_t* p) {
  int32_t a4;
  std::memcpy(&a4, p, 4);
  return _mm256_set1_epi32(a4);
}

// acc[m][0:16] += this block's integer sums (i0: channels 0-7, i1: 8-15) times d_w * d_x.
inline void block_end(float* acc, __m256i i0, __m256i i1, __m256 d0, __m256 d1, float dx) {
  const __m256 sx = _mm256_set1_ps(dx);
  _mm256_store_ps(acc, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(d0, sx), _mm256_load_ps(acc)));
  _mm256_store_ps(acc + 8,
                  _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(d1, sx), _mm256_load_ps(acc + 8)));
}

// One Q4 block of 4 rows x 16 channels: s0[m], s1[m] += the 16-bit products of its 8 groups.
// Written out in assembly because gcc, given the same loop in intrinsics, copies every
// accumulator once per group (16 extra moves per 16 multiplies: the loop became bound by
// instruction issue, not by the multipliers).
inline void q4_block_4x16(const uint8_t* blk, const int8_t* xb, int64_t K, __m256i s0[4], __m256i s1[4]) {
  __m256i w0, w1, a, t;
  int64_t groups = QK / 4;
  const int64_t k3 = 3 * K;
  asm volatile(
      "1:\n\t"
      "vmovdqa (%[w]), %[w0]\n\t"
      "vmovdqa 32(%[w]), %[w1]\n\t"
      "vpbroadcastd (%[x]), %[a]\n\t"
      "vpmaddubsw %[a], %[w0], %[t]\n\t"
      "vpaddw %[t], %[p0], %[p0]\n\t"
      "vpmaddubsw %[a], %[w1], %[t]\n\t"
      "vpaddw %[t], %[q0], %[q0]\n\t"
      "vpbroadcastd (%[x],%[k]), %[a]\n\t"
      "vpmaddubsw %[a], %[w0], %[t]\n\t"
      "vpaddw %[t], %[p1], %[p1]\n\t"
      "vpmaddubsw %[a], %[w1], %[t]\n\t"
      "vpaddw %[t], %[q1], %[q1]\n\t"
      "vpbroadcastd (%[x],%[k],2), %[a]\n\t"
      "vpmaddubsw %[a], %[w0], %[t]\n\t"
      "vpaddw %[t], %[p2], %[p2]\n\t"
      "vpmaddubsw %[a], %[w1], %[t]\n\t"
      "vpaddw %[t], %[q2], %[q2]\n\t"
      "vpbroadcastd (%[x],%[k3]), %[a]\n\t"
      "vpmaddubsw %[a], %[w0], %[t]\n\t"
      "vpaddw %[t], %[p3], %[p3]\n\t"
      "vpmaddubsw %[a], %[w1], %[t]\n\t"
      "vpaddw %[t], %[q3], %[q3]\n\t"
      "add $64, %[w]\n\t"
      "add $4, %[x]\n\t"
      "dec %[n]\n\t"
      "jnz 1b\n\t"
      : [p0] "+x"(s0[0]), [p1] "+x"(s0[1]), [p2] "+x"(s0[2]), [p3] "+x"(s0[3]), [q0] "+x"(s1[0]),
        [q1] "+x"(s1[1]), [q2] "+x"(s1[2]), [q3] "+x"(s1[3]), [w] "+r"(blk), [x] "+r"(xb), [n] "+r"(groups),
        [w0] "=&x"(w0), [w1] "=&x"(w1), [a] "=&x"(a), [t] "=&x"(t)
      : [k] "r"(K), [k3] "r"(k3)
      : "memory", "cc");
}

// Sets out (row stride N) rows [0, MR), columns [0, cols) to the tile's products without the block
// constants' term (q8_gemm adds that). acc: MR x 16 floats, 32-byte aligned.
template <int KIND, int MR>
inline void tile_q8(const uint8_t* tile, const int8_t* xq, const float* xd, float* out, int64_t K, int64_t N,
                    int cols) {
  const int64_t nb = K / QK;
  alignas(32) float acc[MR][NR] = {};
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = tile + b * kBlockBytes;
    const int8_t* xb = xq + b * QK;
    __m256i s0[MR], s1[MR];
    for (int m = 0; m < MR; ++m) s0[m] = s1[m] = _mm256_setzero_si256();
    if constexpr (KIND == kQ4 && MR == 4) {
      q4_block_4x16(blk, xb, K, s0, s1);
    } else {
      // not unrolled: unrolled, gcc computes all 8 groups' products first and spills them to the stack
#pragma GCC unroll 1
      for (int g = 0; g < QK / 4; ++g) {
        const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(blk + g * kGroupBytes));
        const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(blk + g * kGroupBytes + 32));
        if constexpr (KIND == kQ4) {
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) {
            const __m256i a = bcast4(xb + m * K + g * 4);
            s0[m] = _mm256_add_epi16(s0[m], _mm256_maddubs_epi16(w0, a));
            s1[m] = _mm256_add_epi16(s1[m], _mm256_maddubs_epi16(w1, a));
          }
        } else {
          const __m256i u0 = _mm256_sign_epi8(w0, w0), u1 = _mm256_sign_epi8(w1, w1);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) {
            const __m256i a = bcast4(xb + m * K + g * 4);
            s0[m] = _mm256_add_epi32(
                s0[m], _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(a, w0)), ones));
            s1[m] = _mm256_add_epi32(
                s1[m], _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(a, w1)), ones));
          }
        }
      }
    }
    const float* dw = reinterpret_cast<const float*>(blk + kQBytes);
    const __m256 d0 = _mm256_load_ps(dw), d1 = _mm256_load_ps(dw + 8);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      if constexpr (KIND == kQ4)  // the two int16 lanes of one channel's group into one int32
        block_end(acc[m], _mm256_madd_epi16(s0[m], ones), _mm256_madd_epi16(s1[m], ones), d0, d1, xd[m * nb + b]);
      else
        block_end(acc[m], s0[m], s1[m], d0, d1, xd[m * nb + b]);
    }
  }
  for (int m = 0; m < MR; ++m) std::memcpy(out + m * N, acc[m], cols * sizeof(float));
}
#endif

// The same arithmetic one value at a time, for CPUs without AVX2 (and as the reference of the tests).
template <int KIND>
void tile_scalar(const uint8_t* tile, const int8_t* xq, const float* xd, float* out, int64_t K, int64_t N, int cols,
                 int rows) {
  const int64_t nb = K / QK;
  for (int m = 0; m < rows; ++m)
    for (int j = 0; j < cols; ++j) {
      float y = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = tile + b * kBlockBytes;
        const float* dw = reinterpret_cast<const float*>(blk + kQBytes);
        int32_t s = 0;
        for (int g = 0; g < QK / 4; ++g)
          for (int i = 0; i < 4; ++i)
            s += static_cast<int8_t>(blk[g * kGroupBytes + j * 4 + i]) * xq[m * K + b * QK + g * 4 + i];
        y += static_cast<float>(s) * (dw[j] * xd[m * nb + b]);
      }
      out[m * N + j] = y;
    }
}

template <int KIND>
void run_tile(const uint8_t* tile, const int8_t* xq, const float* xd, float* out, int64_t M, int64_t K, int64_t N,
              int cols) {
  const int64_t nb = K / QK;
  int64_t m = 0;
#ifdef PDS_AVX2
  for (; m + 4 <= M; m += 4) tile_q8<KIND, 4>(tile, xq + m * K, xd + m * nb, out + m * N, K, N, cols);
  switch (M - m) {
    case 3: tile_q8<KIND, 3>(tile, xq + m * K, xd + m * nb, out + m * N, K, N, cols); break;
    case 2: tile_q8<KIND, 2>(tile, xq + m * K, xd + m * nb, out + m * N, K, N, cols); break;
    case 1: tile_q8<KIND, 1>(tile, xq + m * K, xd + m * nb, out + m * N, K, N, cols); break;
    default: break;
  }
  return;
#endif
  tile_scalar<KIND>(tile, xq + m * K, xd + m * nb, out + m * N, K, N, cols, static_cast<int>(M - m));
}

// x [M, K] -> xq (natural order), xd per-block scales, xs exact per-block sums.
void quantize(const float* x, int8_t* xq, float* xd, float* xs, int64_t M, int64_t K) {
  const int64_t nb = K / QK;
  pds::parallel_for(0, M * nb, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xb = x + r * QK;
      float am = 0, s = 0;
      for (int i = 0; i < QK; ++i) {
        am = std::max(am, std::fabs(xb[i]));
        s += xb[i];
      }
      const float inv = am > 0 ? 127.f / am : 0.f;
      xd[r] = am / 127.f;
      xs[r] = s;
      for (int i = 0; i < QK; ++i) xq[r * QK + i] = static_cast<int8_t>(std::nearbyint(xb[i] * inv));
    }
  });
}

}  // namespace

int64_t tile_bytes(int64_t N, int64_t K) { return (N + NR - 1) / NR * (K / QK) * kBlockBytes; }


// GGUF rows [N, row_bytes] (Q4_0, Q4_1 or Q8_0) -> what q8_gemm reads, one uint8 tensor: ceil(N / 16)
// tiles of K / 32 blocks of 576 bytes (channels past N zero), then for Q4 types the blocks' constants
// as fp32 [N, K / 32]. About 1.2 bytes a weight.
torch::Tensor q8_gemm_pack(torch::Tensor w, int64_t qtype, int64_t K) {
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.dim() == 2, "w must be 2-D contiguous uint8");
  TORCH_CHECK(qtype == 2 || qtype == 3 || qtype == 8, "unsupported GGUF type ", qtype);
  TORCH_CHECK(K > 0 && K % QK == 0, "K must be a positive multiple of 32");
  const int64_t nb = K / QK, bytes = qtype == 2 ? 18 : qtype == 3 ? 20 : 34, N = w.size(0);
  TORCH_CHECK(N > 0 && w.size(1) == nb * bytes, "row size does not match K and the type");
  const int64_t tiles = (N + NR - 1) / NR, consts = kind_of(qtype) == kQ4 ? N * nb * 4 : 0;
  auto out = torch::zeros({tile_bytes(N, K) + consts}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  float* cs = reinterpret_cast<float*>(dst + tile_bytes(N, K));
  pds::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    int8_t q[QK];
    for (int64_t t = t0; t < t1; ++t)
      for (int j = 0; j < NR && t * NR + j < N; ++j)
        for (int64_t b = 0; b < nb; ++b) {
          float d, c;
          const int64_t n = t * NR + j;
          unpack_block(src + n * nb * bytes + b * bytes, qtype, q, &d, &c);
          uint8_t* blk = dst + t * nb * kBlockBytes + b * kBlockBytes;
          for (int g = 0; g < QK / 4; ++g) std::memcpy(blk + g * kGroupBytes + j * 4, q + g * 4, 4);
          reinterpret_cast<float*>(blk + kQBytes)[j] = d;
          if (consts) cs[n * nb + b] = c;
        }
  });
  return out;
}

// x @ W.T for any number of rows, x [M, K] float32 rounded to int8 per 32-value block; w: q8_gemm_pack's
// output for N channels of GGUF type qtype. Returns [M, N] float32.
torch::Tensor q8_gemm(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t K, int64_t N) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "x must be 2-D contiguous float32");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.dim() == 1, "w must be q8_gemm_pack's output");
  TORCH_CHECK(qtype == 2 || qtype == 3 || qtype == 8, "unsupported GGUF type ", qtype);
  TORCH_CHECK(K > 0 && K % QK == 0 && x.size(1) == K, "K must be a multiple of 32 and match x");
  const int64_t M = x.size(0), nb = K / QK, tiles = (N + NR - 1) / NR;
  const bool q4 = kind_of(qtype) == kQ4;
  TORCH_CHECK(N > 0 && w.size(0) == tile_bytes(N, K) + (q4 ? N * nb * 4 : 0), "w is not a q8_gemm_pack of this K, N and type");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 32 == 0, "w must be 32-byte aligned");
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
  std::vector<int8_t> xq(M * K);
  auto xs = torch::empty({M, nb}, x.options());
  std::vector<float> xd(M * nb);
  quantize(x.data_ptr<float>(), xq.data(), xd.data(), xs.data_ptr<float>(), M, K);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  // Rows in panels whose int8 activations stay in L2 while every tile of a chunk passes over them.
  const int64_t panel = std::max<int64_t>(4, std::min<int64_t>(M, ((256 << 10) / K) & ~int64_t(3)));
  pds::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> tmp;
    for (int64_t m0 = 0; m0 < M; m0 += panel) {
      const int64_t rows = std::min(panel, M - m0);
      const int8_t* xr = xq.data() + m0 * K;
      const float* dr = xd.data() + m0 * nb;
      for (int64_t t = t0; t < t1; ++t) {
        const int cols = static_cast<int>(std::min<int64_t>(NR, N - t * NR));
        const uint8_t* tile = wp + t * nb * kBlockBytes;
        float* o = op + m0 * N + t * NR;
        if (cols == NR) {
          if (q4) run_tile<kQ4>(tile, xr, dr, o, rows, K, N, cols);
          else run_tile<kQ8>(tile, xr, dr, o, rows, K, N, cols);
          continue;
        }
        tmp.assign(rows * NR, 0.f);  // the last, partial tile: no column past N is written
        if (q4) run_tile<kQ4>(tile, xr, dr, tmp.data(), rows, K, NR, NR);
        else run_tile<kQ8>(tile, xr, dr, tmp.data(), rows, K, NR, NR);
        for (int64_t m = 0; m < rows; ++m) std::memcpy(o + m * N, tmp.data() + m * NR, cols * sizeof(float));
      }
    }
  });
  if (q4) {  // + sum_b c_w * sum(x): a product with K / 32 terms, as one fp32 GEMM
    auto c = torch::from_blob(const_cast<uint8_t*>(wp) + tile_bytes(N, K), {N, nb}, x.options());
    out.addmm_(xs, c.t());
  }
  return out;
}

void register_int8_gemm(pybind11::module& m) {
  m.def("q8_gemm_pack", &q8_gemm_pack, "GGUF Q4_0/Q4_1/Q8_0 rows -> the tiles q8_gemm reads", pybind11::arg("w"),
        pybind11::arg("qtype"), pybind11::arg("K"));
  m.def("q8_gemm", &q8_gemm,
        "x @ W.T for many rows, activations rounded to int8 per 32-value block, W packed by q8_gemm_pack (CPU)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("qtype"), pybind11::arg("K"), pybind11::arg("N"));
}
