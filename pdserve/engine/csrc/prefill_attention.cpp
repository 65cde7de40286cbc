// Causal prefill attention on CPU for bf16 (and fp32) KV caches: flash-style, over the paged cache.
//
// torch's CPU flash attention runs bf16 no faster than fp32 (~115 GFLOP/s on the
// 2-core Zen 5 machines here, ~63% of a 2,048-token prefill). Here both products
// run on AVX512-BF16 dot products (vdpbf16ps: 16 lanes x 2 bf16 pairs, fp32
// accumulation), as fast as the bf16 GEMMs.
//
// Every span reads its keys 0..ctx-1 from the paged cache through its block
// table, so a fresh prompt, a prefix-cache hit and a chunk of a long prompt are
// one case: the span's L queries sit at positions ctx-L .. ctx-1. Per span and KV
// head the context is first packed into key tiles (the layouts the dot products
// read; read once, shared by every query tile). Work items are then (span, KV head,
// query tile): the `group` query heads of the KV head are the rows of one item, so
// each K/V tile is loaded once for all of them (GQA). An item walks its key tiles
// with an online softmax in fp32 (running max and sum per row, no [L, ctx] score
// matrix), skips the tiles past its last query and masks only those crossing the
// diagonal. Items differ in cost (a query tile near the end of a span sees more
// keys): they run heaviest first, claimed dynamically, so threads finish together.
// The dot products take 4 key tiles (256 keys) per softmax step (Bf16Dot::rows_multi):
// one 5,900-token prompt on one Zen 5 core, 284 GFLOP/s with a step per 64-key tile,
// 386 with 256 keys (vdpbf16ps' own peak there: ~520).
//
// With AMX (Intel Xeon since Sapphire Rapids) both products are tile products
// (AmxDot below) on the same packed tiles, 16 rows at a time, 256 keys per softmax
// step; a 2,048-token layer of SmolLM2 shapes took 31.5 ms with the dot products
// and 9.1 ms with the tiles on a 2-core Xeon, whose softmax (AVX-512) is then half
// the time. PDSERVE_NO_AMX=1 keeps the dot products.
//
// Without AVX512-BF16 a portable fp32 path (bf16 widened exactly, loops the
// compiler vectorises) computes the same thing.
#include <torch/extension.h>
#include <type_traits>

#include "pool.h"
#include "simd_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PDS_BF16_DOT 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace {

constexpr int64_t kKeyTile = 64;    // keys per tile: four 16-lane vectors of scores per row
constexpr int64_t kQueryTile = 32;  // query positions per work item (rows: this x the group)
constexpr float kLog2e = 1.44269504088896341f;

using bf16 = c10::BFloat16;

inline float widen(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Which of a tile's keys row r may see: keys k0 .. k0 + valid - 1 (causal).
inline int visible(int64_t pos, int64_t k0) {
  return static_cast<int>(std::clamp<int64_t>(pos - k0 + 1, 0, kKeyTile));
}

#ifdef PDS_BF16_DOT
// 2^x for x <= 0 (scores minus their running max): 2^round(x) times a degree-6
// polynomial for 2^f, f in [-0.5, 0.5] (relative error ~1e-7, far below the bf16
// rounding of P).
inline __m512 exp2_16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(1.5403530393381606e-4f);  // ln2^6 / 6!
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3333558146428443e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291076284772e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108664821580e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650695910071e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718055994531e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

inline __mmask16 lanes_below(int n, int j) {  // lanes of vector j (keys 16j..16j+15) below key n
  const int k = std::clamp(n - 16 * j, 0, 16);
  return static_cast<__mmask16>((1u << k) - 1);
}

// r[i] word j -> r[j] word i: a 16 x 16 transpose of 32-bit words
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4b + k] now holds, per 128-bit lane L, words (4L + k) of rows 4b .. 4b + 3
  for (int i = 0; i < 8; ++i) {  // lanes 0,1 of two row groups / lanes 2,3
    const int a = (i / 4) * 8 + i % 4, b = a + 4;
    t[i] = _mm512_shuffle_i32x4(r[a], r[b], 0x88);      // lanes 0, 2 of a; 0, 2 of b
    t[i + 8] = _mm512_shuffle_i32x4(r[a], r[b], 0xDD);  // lanes 1, 3 of a; 1, 3 of b
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 4], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 4], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 8], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 8], t[i + 12], 0xDD);
  }
}

inline __m512bh bcast_pair(const uint16_t* p) {  // the bf16 pair p[0], p[1] in every lane
  int32_t w;
  std::memcpy(&w, p, sizeof w);
  return (__m512bh)_mm512_set1_epi32(w);
}

// 2^x for the weights P only, which are rounded to bf16 next (relative step 2^-8):
// a degree-3 polynomial, minimax in relative error on [-0.5, 0.5] (7.5e-5, 26x below
// bf16's half step), three operations fewer than exp2_16. x >= -126.
inline __m512 exp2_16_for_bf16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(0.05517132143402796f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.2426105422817228f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.6932609856052576f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.9999281093641539f));
  return _mm512_scalef_ps(y, n);
}

// One row's nkeys (a multiple of 32) raw scores s (q.k) in memory, of which the first n
// are visible: the online softmax update of its running max m and sum l, the weights P
// rounded to bf16 into p (0 past n), and the factor the row's output must be rescaled
// by. Only the vectors holding visible keys are read; the visible ones are masked only
// in the one vector where visibility ends.
inline float softmax_row(const float* s, int nkeys, int n, float c, float& m, float& l, uint16_t* p) {
  if (n == 0) {
    std::memset(p, 0, sizeof(uint16_t) * nkeys);
    return 1.f;
  }
  const int full = n / 16, nv = (n + 15) / 16;  // vectors all visible; vectors with any visible key
  const __mmask16 tail = lanes_below(n, full);
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int v = 0; v < full; ++v) mx = _mm512_max_ps(mx, _mm512_load_ps(s + 16 * v));
  if (full < nv) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_load_ps(s + 16 * full));
  const float m_new = std::max(m, _mm512_reduce_max_ps(mx) * c);  // c > 0: max commutes with scaling
  const float alpha = _mm512_cvtss_f32(exp2_16(_mm512_set1_ps(m - m_new)));
  m = m_new;
  const __m512 cv = _mm512_set1_ps(c), mv = _mm512_set1_ps(m_new), lo = _mm512_set1_ps(-126.f);
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  __m512 sum = _mm512_setzero_ps();
  auto weights = [&](int v) {  // 2^(s c - m) of vector v, 0 where not visible
    const __m512 e = exp2_16_for_bf16(_mm512_max_ps(_mm512_fmsub_ps(_mm512_load_ps(s + 16 * v), cv, mv), lo));
    return v < full ? e : v == full ? _mm512_maskz_mov_ps(tail, e) : _mm512_setzero_ps();
  };
  for (int v = 0; v < nv; v += 2) {
    const __m512i pv = (__m512i)_mm512_cvtne2ps_pbh(weights(v + 1), weights(v));
    _mm512_store_si512(p + 16 * v, pv);
    sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(pv, 16)));
    sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_and_si512(pv, hi_mask)));
  }
  const int written = (nv + 1) / 2 * 32;
  if (written < nkeys) std::memset(p + written, 0, sizeof(uint16_t) * (nkeys - written));
  l = l * alpha + _mm512_reduce_add_ps(sum);
  return alpha;
}

// dpbf16 layouts. K tile: for each pair of dimensions (2p, 2p+1), the 64 keys'
// pairs side by side, so one 32-bit broadcast of a query's pair against four
// vectors gives 64 partial scores. V tile: for each pair of keys, their values
// interleaved along D, so a broadcast pair of P against it adds into 16 outputs.
struct Bf16Dot {
  using Elem = uint16_t;

  static void pack(const bf16* const* krows, const bf16* const* vrows, int64_t n, int64_t D, Elem* kp, Elem* vp) {
    std::memset(vp, 0, sizeof(Elem) * kKeyTile * D);  // values past n: zero, so P = 0 adds nothing
    // K: a transpose of 32-bit words (key j's pair p -> word p * kKeyTile + j), 16 keys x 16
    // pairs at a time in registers; keys past n are zero (masked anyway). A chunk of a long
    // prompt packs its whole context again: word by word, a 128-token chunk at 5,900 tokens of
    // context spent a fifth of its attention time here.
    for (int64_t j0 = 0; j0 < kKeyTile; j0 += 16)
      for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = j0 + i < n ? _mm512_loadu_si512(krows[j0 + i] + 2 * p0) : _mm512_setzero_si512();
        transpose16(r);
        for (int c = 0; c < 16; ++c) _mm512_storeu_si512(kp + 2 * ((p0 + c) * kKeyTile + j0), r[c]);
      }
    // pairs of V rows interleaved: lo/hi halves of a 32-element slice of two rows
    alignas(64) uint16_t idx[32];  // output 2i, 2i + 1 <- a[i], b[i] (index bit 5 picks b)
    for (int i = 0; i < 16; ++i) {
      idx[2 * i] = static_cast<uint16_t>(i);
      idx[2 * i + 1] = static_cast<uint16_t>(32 + i);
    }
    const __m512i lo = _mm512_load_si512(idx);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t j = 0; j < n; j += 2) {
      const uint16_t* a = reinterpret_cast<const uint16_t*>(vrows[j]);
      const uint16_t* b = j + 1 < n ? reinterpret_cast<const uint16_t*>(vrows[j + 1]) : nullptr;
      Elem* dst = vp + j * D;
      for (int64_t d = 0; d < D; d += 32) {
        const __m512i va = _mm512_loadu_si512(a + d);
        const __m512i vb = b ? _mm512_loadu_si512(b + d) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + 2 * d, _mm512_permutex2var_epi16(va, lo, vb));
        _mm512_storeu_si512(dst + 2 * d + 32, _mm512_permutex2var_epi16(va, hi, vb));
      }
    }
  }

  static void load_q(const bf16* src, int64_t count, Elem* dst) { std::memcpy(dst, src, count * sizeof(Elem)); }

  static constexpr int kRows = 6;  // 6 rows x 4 vectors: 24 accumulators of the 32 registers
  static constexpr int kTileRows = 0;  // rows go through rows_multi<MR>, any count

  // MR rows (q: MR x D, contiguous) against nsub (<= kDotSuper) consecutive key tiles (kp,
  // vp: the first), valid[i] of whose keys row i sees: scores, the online softmax update of
  // m, l (per row) and o (MR x D, fp32), P rounded to bf16 for P.V. One softmax step for all
  // nsub tiles: the scores of each go to memory, one max, one rescale of o and one sum per row,
  // and the weights by the 3-term 2^x (they are rounded to bf16 next). With a step per tile
  // the softmax took the FMA pipes from the products (5,900-token prompt, one Zen 5 core:
  // 284 GFLOP/s against vdpbf16ps' ~520); per 2 tiles 358, per 4 383, per 8 385.
  static constexpr int kDotSuper = 4;
  template <int MR>
  static void rows_multi(const Elem* q, const Elem* kp, const Elem* vp, int nsub, const int* valid, int64_t D,
                         float c, float* m, float* l, float* o) {
    constexpr int kKeys = kDotSuper * kKeyTile;
    const int64_t tile_elems = kKeyTile * D;
    alignas(64) float sb[MR][kKeys];
    for (int sub = 0; sub < nsub; ++sub) {
      __m512 s[MR][4];
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 4; ++j) s[i][j] = _mm512_setzero_ps();
      const Elem* kt0 = kp + sub * tile_elems;
      for (int64_t p = 0; p < D / 2; ++p) {
        const Elem* kt = kt0 + p * 2 * kKeyTile;
        __m512bh kv[4];
        for (int j = 0; j < 4; ++j) kv[j] = (__m512bh)_mm512_loadu_si512(kt + 32 * j);
        for (int i = 0; i < MR; ++i) {
          const __m512bh qa = bcast_pair(q + i * D + 2 * p);
          for (int j = 0; j < 4; ++j) s[i][j] = _mm512_dpbf16_ps(s[i][j], kv[j], qa);
        }
      }
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 4; ++j) _mm512_store_ps(&sb[i][sub * kKeyTile + 16 * j], s[i][j]);
    }
    const int nkeys = nsub * kKeyTile;
    alignas(64) Elem pb[MR][kKeys];
    float alpha[MR];
    for (int i = 0; i < MR; ++i) alpha[i] = softmax_row(sb[i], nkeys, valid[i], c, m[i], l[i], pb[i]);
    for (int64_t c0 = 0; c0 < D; c0 += 64) {  // o = o * alpha + P.V, 64 columns at a time
      __m512 acc[MR][4];
      for (int i = 0; i < MR; ++i) {
        const __m512 a = _mm512_set1_ps(alpha[i]);
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_mul_ps(_mm512_loadu_ps(o + i * D + c0 + 16 * j), a);
      }
      for (int sub = 0; sub < nsub; ++sub)
        for (int64_t kp2 = 0; kp2 < kKeyTile / 2; ++kp2) {
          const Elem* vt = vp + sub * tile_elems + kp2 * 2 * D + 2 * c0;
          __m512bh vv[4];
          for (int j = 0; j < 4; ++j) vv[j] = (__m512bh)_mm512_loadu_si512(vt + 32 * j);
          for (int i = 0; i < MR; ++i) {
            const __m512bh pa = bcast_pair(pb[i] + sub * kKeyTile + 2 * kp2);
            for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], vv[j], pa);
          }
        }
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 4; ++j) _mm512_storeu_ps(o + i * D + c0 + 16 * j, acc[i][j]);
    }
  }
};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PDS_AMX 1
// AMX (Intel Sapphire Rapids and later): both products as tile products. A tile
// register holds 16 rows of 64 bytes; TDPBF16PS adds A (16 x 32 bf16) times B (16
// pairs of rows x 16 columns, the pairs interleaved) into C (16 x 16 fp32), 16x the
// work of one vdpbf16ps. The packed K and V tiles above are already in B's layout
// (a pair of dimensions, resp. of keys, per row), so only the rows change: 16 of
// them at a time, padded with zero rows (valid 0) to a multiple of 16. Scores go
// through memory for the softmax (AVX-512, as above), P.V into a fresh C tile that
// is then added to the rescaled output.
struct AmxDot : Bf16Dot {
  static constexpr int kTileRows = 16;

  // The Linux kernel hands out the tile state only to a process that asked for it.
  static bool permitted() {
    static const bool ok = [] {
      constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
      return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return ok;
  }

  // Per thread: tiles 0-3 are C (scores, then P.V), 4 is A (q, then P), 5-6 are B.
  static void configure() {
    struct alignas(64) {
      uint8_t palette, start_row, reserved[14];
      uint16_t colsb[16];
      uint8_t rows[16];
    } cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 7; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
  }
  static void release() { _tile_release(); }

  static constexpr int kSuper = 4;  // key tiles per softmax step: 256 keys
  static constexpr int kKeys = kSuper * kKeyTile;

  // 16 rows (q: 16 x D, contiguous) against nsub consecutive packed key tiles (kp, vp:
  // the first), valid[i] of whose keys row i sees: the online softmax update as in
  // Bf16Dot::rows_multi, over up to 256 keys at once (one max, one rescale of o per step).
  static void rows16(const Elem* q, const Elem* kp, const Elem* vp, int nsub, const int* valid, int64_t D, float c,
                     float* m, float* l, float* o) {
    constexpr int kRowBytes = kKeys * 4;        // a row of the fp32 score buffer
    constexpr int kTileBytes = kKeyTile * 4;    // a row of a packed K tile (32 keys x 2 dims x 2 bytes)
    const int64_t tile_elems = kKeyTile * D;
    alignas(64) float s[16][kKeys];
    for (int sub = 0; sub < nsub; ++sub) {  // scores: 64 keys (four C tiles) per packed tile
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t d0 = 0; d0 < D; d0 += 32) {  // K tile rows d0/2 .. d0/2 + 15
        _tile_loadd(4, q + d0, D * 2);
        const Elem* kt = kp + sub * tile_elems + d0 * kKeyTile;
        _tile_loadd(5, kt, kTileBytes);
        _tile_loadd(6, kt + 32, kTileBytes);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, kt + 64, kTileBytes);
        _tile_loadd(6, kt + 96, kTileBytes);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(3, 4, 6);
      }
      float* row = &s[0][sub * kKeyTile];
      _tile_stored(0, row, kRowBytes);
      _tile_stored(1, row + 16, kRowBytes);
      _tile_stored(2, row + 32, kRowBytes);
      _tile_stored(3, row + 48, kRowBytes);
    }
    const int nkeys = nsub * kKeyTile;
    alignas(64) Elem pb[16][kKeys];
    float alpha[16];
    for (int i = 0; i < 16; ++i) alpha[i] = softmax_row(s[i], nkeys, valid[i], c, m[i], l[i], pb[i]);
    for (int64_t c0 = 0; c0 < D; c0 += 64) {  // o = o * alpha + P.V, 64 columns at a time
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int k0 = 0; k0 < nkeys; k0 += 32) {  // V tile rows (pairs of keys) of keys k0 .. k0 + 31
        _tile_loadd(4, &pb[0][k0], kKeys * 2);
        const Elem* vt = vp + (k0 / kKeyTile) * tile_elems + (k0 % kKeyTile) * D + 2 * c0;
        _tile_loadd(5, vt, D * 4);
        _tile_loadd(6, vt + 32, D * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, vt + 64, D * 4);
        _tile_loadd(6, vt + 96, D * 4);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(3, 4, 6);
      }
      _tile_stored(0, &s[0][0], kRowBytes);
      _tile_stored(1, &s[0][16], kRowBytes);
      _tile_stored(2, &s[0][32], kRowBytes);
      _tile_stored(3, &s[0][48], kRowBytes);
      for (int i = 0; i < 16; ++i) {
        const __m512 a = _mm512_set1_ps(alpha[i]);
        float* orow = o + i * D + c0;
        for (int j = 0; j < 4; ++j)
          _mm512_storeu_ps(orow + 16 * j, _mm512_fmadd_ps(_mm512_loadu_ps(orow + 16 * j), a,
                                                          _mm512_load_ps(s[i] + 16 * j)));
      }
    }
  }
};
#endif
#endif

inline float to_f32(const bf16& x) { return widen(reinterpret_cast<const uint16_t&>(x)); }
inline float to_f32(const float& x) { return x; }

// fp32 path: fp32 tiles (K transposed to [D][64], V as [64][D]), P kept fp32. For fp32 caches
// (int8 mode on a CPU without native bf16), and for bf16 caches without AVX512-BF16 (bf16
// widened exactly). With AVX2 each row's 64 scores are 8 vector accumulators, exp is
// vectorised (simd_exp.h): a scalar exp per score cost more than both products together.
template <class T>
struct F32Dot {
  using Elem = float;

  static void pack(const T* const* krows, const T* const* vrows, int64_t n, int64_t D, Elem* kp, Elem* vp) {
    std::fill(kp, kp + kKeyTile * D, 0.f);
    std::fill(vp, vp + kKeyTile * D, 0.f);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < D; ++d) {
        kp[d * kKeyTile + j] = to_f32(krows[j][d]);
        vp[j * D + d] = to_f32(vrows[j][d]);
      }
  }

  static void load_q(const T* src, int64_t count, Elem* dst) {
    for (int64_t i = 0; i < count; ++i) dst[i] = to_f32(src[i]);
  }

#ifdef PDS_SIMD_EXP
  template <int MR>
  static void rows(const Elem* q, const Elem* kp, const Elem* vp, const int* valid, int64_t D, float c,
                   float* m, float* l, float* o) {
    constexpr int V = kKeyTile / 8;  // score vectors per row
    const __m256 ln2 = _mm256_set1_ps(0.69314718055994531f), cv = _mm256_set1_ps(c);
    const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int i = 0; i < MR; ++i) {
      const int n = valid[i];
      if (n == 0) continue;  // the whole tile is in this row's future
      __m256 sc[V];
      for (int v = 0; v < V; ++v) sc[v] = _mm256_setzero_ps();
      const float* qi = q + i * D;
      for (int64_t d = 0; d < D; ++d) {
        const __m256 qd = _mm256_broadcast_ss(qi + d);
        const float* kr = kp + d * kKeyTile;
        for (int v = 0; v < V; ++v) sc[v] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kr + 8 * v), sc[v]);
      }
      __m256 mx = neg_inf;
      for (int v = 0; v < V; ++v) {  // log2-domain scores; keys at or past n masked to -inf
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8 * v), lane));
        sc[v] = _mm256_blendv_ps(neg_inf, _mm256_mul_ps(sc[v], cv), keep);
        mx = _mm256_max_ps(mx, sc[v]);
      }
      mx = _mm256_max_ps(mx, _mm256_permute2f128_ps(mx, mx, 1));
      mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0x4e));
      mx = _mm256_max_ps(mx, _mm256_shuffle_ps(mx, mx, 0xb1));
      const float m_new = std::max(m[i], _mm256_cvtss_f32(mx));
      const float alpha = std::exp2(m[i] - m_new);  // 0 on the first tile (m = -inf; o, l are 0)
      m[i] = m_new;
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      alignas(32) float p[kKeyTile];
      for (int v = 0; v < V; ++v) {  // masked again: exp8 clamps -inf to a tiny positive weight
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8 * v), lane));
        const __m256 e = _mm256_and_ps(pds::exp8(_mm256_mul_ps(_mm256_sub_ps(sc[v], mv), ln2)), keep);
        sum = _mm256_add_ps(sum, e);
        _mm256_store_ps(p + 8 * v, e);
      }
      alignas(32) float part[8];
      _mm256_store_ps(part, sum);
      float total = 0;
      for (float x : part) total += x;
      l[i] = l[i] * alpha + total;
      const __m256 av = _mm256_set1_ps(alpha);
      for (int64_t c0 = 0; c0 < D; c0 += 64) {  // o = o * alpha + P.V, 64 columns at a time
        float* orow = o + i * D + c0;
        __m256 acc[8];
        for (int v = 0; v < 8; ++v) acc[v] = _mm256_mul_ps(_mm256_loadu_ps(orow + 8 * v), av);
        for (int j = 0; j < n; ++j) {
          const __m256 w = _mm256_broadcast_ss(p + j);
          const float* vr = vp + j * D + c0;
          for (int v = 0; v < 8; ++v) acc[v] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * v), acc[v]);
        }
        for (int v = 0; v < 8; ++v) _mm256_storeu_ps(orow + 8 * v, acc[v]);
      }
    }
  }
#else
  template <int MR>
  static void rows(const Elem* q, const Elem* kp, const Elem* vp, const int* valid, int64_t D, float c,
                   float* m, float* l, float* o) {
    for (int i = 0; i < MR; ++i) {
      const int n = valid[i];
      if (n == 0) continue;
      float s[kKeyTile] = {};
      for (int64_t d = 0; d < D; ++d) {
        const float qd = q[i * D + d];
        const float* kr = kp + d * kKeyTile;
#pragma omp simd
        for (int j = 0; j < kKeyTile; ++j) s[j] += qd * kr[j];
      }
      float mx = -std::numeric_limits<float>::infinity();
      for (int j = 0; j < n; ++j) mx = std::max(mx, s[j] * c);
      const float m_new = std::max(m[i], mx);
      const float alpha = std::exp2(m[i] - m_new);
      m[i] = m_new;
      float sum = 0;
      for (int j = 0; j < n; ++j) {
        s[j] = std::exp2(s[j] * c - m_new);
        sum += s[j];
      }
      l[i] = l[i] * alpha + sum;
      float* orow = o + i * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) orow[d] *= alpha;
      for (int j = 0; j < n; ++j) {
        const float w = s[j];
        const float* vr = vp + j * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) orow[d] += w * vr[d];
      }
    }
  }
#endif

  static constexpr int kRows = 4;
  static constexpr int kTileRows = 0;
};

struct Span {
  int64_t start, len, ctx;  // rows start .. start+len-1 of q/out; positions ctx-len .. ctx-1
  const int64_t* table;
};

struct Shape {
  int64_t H, KVH, G, D, BS;
  int64_t tok_stride, blk_stride;  // cache strides (elements) of a token and of a block
};

// rows_dispatch for the paths with rows_multi (several key tiles per softmax step)
template <class Path, int MR = Path::kRows>
void rows_multi_dispatch(int64_t n, const typename Path::Elem* q, const typename Path::Elem* kp,
                         const typename Path::Elem* vp, int nsub, const int* valid, int64_t D, float c, float* m,
                         float* l, float* o) {
  if constexpr (MR > 0) {
    for (; n >= MR; n -= MR, q += MR * D, valid += MR, m += MR, l += MR, o += MR * D)
      Path::template rows_multi<MR>(q, kp, vp, nsub, valid, D, c, m, l, o);
    if (n > 0) rows_multi_dispatch<Path, MR - 1>(n, q, kp, vp, nsub, valid, D, c, m, l, o);
  }
}

template <class Path, class = void>
struct DotSuper {  // key tiles per softmax step of a path without rows_multi: one
  static constexpr int value = 1;
};
template <class Path>
struct DotSuper<Path, std::void_t<decltype(Path::kDotSuper)>> {
  static constexpr int value = Path::kDotSuper;
};

// rows rb .. rb + n - 1 of an item, in blocks of Path::kRows (then one smaller block)
template <class Path, int MR = Path::kRows>
void rows_dispatch(int64_t n, const typename Path::Elem* q, const typename Path::Elem* kp,
                   const typename Path::Elem* vp, const int* valid, int64_t D, float c, float* m, float* l,
                   float* o) {
  if constexpr (MR > 0) {
    for (; n >= MR; n -= MR, q += MR * D, valid += MR, m += MR, l += MR, o += MR * D)
      Path::template rows<MR>(q, kp, vp, valid, D, c, m, l, o);
    if (n > 0) rows_dispatch<Path, MR - 1>(n, q, kp, vp, valid, D, c, m, l, o);
  }
}

template <class Path, class T>
void prefill(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
             const torch::Tensor& v_cache, const std::vector<Span>& spans, const Shape& sh, float scale) {
  using Elem = typename Path::Elem;
  const int64_t S = static_cast<int64_t>(spans.size()), D = sh.D, G = sh.G, KVH = sh.KVH;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const int64_t tile_elems = kKeyTile * D;

  // packed K/V tiles: span s, KV head h, tile t at slot (tile_base[s] * KVH + h * tiles(s) + t)
  std::vector<int64_t> tile_base(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) tile_base[s + 1] = tile_base[s] + (spans[s].ctx + kKeyTile - 1) / kKeyTile;
  const int64_t slots = tile_base[S] * KVH;
  // (not zero-filled first: pack() writes every element of a tile)
  std::unique_ptr<Elem[]> kpack(new Elem[slots * tile_elems]), vpack(new Elem[slots * tile_elems]);
  pds::parallel_for(0, slots, 1, [&](int64_t begin, int64_t end) {
    const T* krows[kKeyTile];
    const T* vrows[kKeyTile];
    for (int64_t slot = begin; slot < end; ++slot) {
      const int64_t s = std::upper_bound(tile_base.begin(), tile_base.end(), slot / KVH) - tile_base.begin() - 1;
      const int64_t tiles = tile_base[s + 1] - tile_base[s], local = slot - tile_base[s] * KVH;
      const int64_t h = local / tiles, k0 = (local % tiles) * kKeyTile;
      const int64_t n = std::min(kKeyTile, spans[s].ctx - k0);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = k0 + j;
        const int64_t at = spans[s].table[pos / sh.BS] * sh.blk_stride + (pos % sh.BS) * sh.tok_stride + h * D;
        krows[j] = kc + at;
        vrows[j] = vc + at;
      }
      Path::pack(krows, vrows, n, D, kpack.get() + slot * tile_elems, vpack.get() + slot * tile_elems);
    }
  });

  // work items, heaviest first: cost ~ rows x key tiles the item visits
  struct Item { int64_t span, head, q0, cost; };
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t q0 = 0; q0 < spans[s].len; q0 += kQueryTile) {
      const int64_t rows = std::min(kQueryTile, spans[s].len - q0);
      const int64_t last_pos = spans[s].ctx - spans[s].len + q0 + rows - 1;
      for (int64_t h = 0; h < KVH; ++h) items.push_back({s, h, q0, rows * (last_pos / kKeyTile + 1)});
    }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

  const float c = scale * kLog2e;  // softmax in base 2: exp(x * scale) = 2^(x * c)
  pds::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    if constexpr (Path::kTileRows > 0) Path::configure();  // per thread, released below
    // tile paths run 16 rows at a time: zero rows (valid 0, never written out) pad the item
    constexpr int64_t TR = Path::kTileRows > 0 ? Path::kTileRows : 1;
    const int64_t max_rows = (kQueryTile * G + TR - 1) / TR * TR;
    std::vector<Elem> qt(max_rows * D, Elem{});
    std::vector<float> o(max_rows * D), m(max_rows), l(max_rows);
    std::vector<int> valid(max_rows);
    for (int64_t it = begin; it < end; ++it) {
      const Item& item = items[it];
      const Span& sp = spans[item.span];
      const int64_t rows = std::min(kQueryTile, sp.len - item.q0), M = rows * G;
      const int64_t pos0 = sp.ctx - sp.len + item.q0;  // position of the item's first query
      // row r = query i * G + head g: the G heads of a token are adjacent in q and out
      for (int64_t i = 0; i < rows; ++i)
        Path::load_q(qp + ((sp.start + item.q0 + i) * sh.H + item.head * G) * D, G * D, qt.data() + i * G * D);
      const int64_t MP = (M + TR - 1) / TR * TR;  // rows computed: M, padded for the tile paths
      std::fill(qt.begin() + M * D, qt.begin() + MP * D, Elem{});
      std::fill(o.begin(), o.begin() + MP * D, 0.f);
      std::fill(m.begin(), m.begin() + MP, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + MP, 0.f);
      std::fill(valid.begin() + M, valid.begin() + MP, 0);
      const int64_t slot0 = tile_base[item.span] * KVH + item.head * (tile_base[item.span + 1] - tile_base[item.span]);
      const int64_t n_tiles = (pos0 + rows - 1) / kKeyTile + 1;  // tiles past the last query are skipped
      if constexpr (Path::kTileRows > 0) {
        // 16 rows at a time, each block against the key tiles its own last query sees
        for (int64_t r = 0; r < MP; r += TR) {
          const int64_t last = pos0 + (std::min(r + TR, M) - 1) / G;
          for (int64_t t = 0; t <= last / kKeyTile; t += Path::kSuper) {
            const int nsub = static_cast<int>(std::min<int64_t>(Path::kSuper, last / kKeyTile + 1 - t));
            for (int64_t i = r; i < r + TR; ++i)
              valid[i] = i < M ? static_cast<int>(std::clamp<int64_t>(pos0 + i / G - t * kKeyTile + 1, 0,
                                                                       nsub * kKeyTile))
                               : 0;
            Path::rows16(qt.data() + r * D, kpack.get() + (slot0 + t) * tile_elems,
                         vpack.get() + (slot0 + t) * tile_elems, nsub, valid.data() + r, D, c, m.data() + r,
                         l.data() + r, o.data() + r * D);
          }
        }
      } else if constexpr (DotSuper<Path>::value > 1) {
        // kDotSuper key tiles per softmax step, every row block of the item against each step
        constexpr int64_t kS = DotSuper<Path>::value;
        for (int64_t t = 0; t < n_tiles; t += kS) {
          const int nsub = static_cast<int>(std::min<int64_t>(kS, n_tiles - t));
          for (int64_t r = 0; r < M; ++r)
            valid[r] = static_cast<int>(std::clamp<int64_t>(pos0 + r / G - t * kKeyTile + 1, 0, nsub * kKeyTile));
          rows_multi_dispatch<Path>(M, qt.data(), kpack.get() + (slot0 + t) * tile_elems,
                                    vpack.get() + (slot0 + t) * tile_elems, nsub, valid.data(), D, c, m.data(),
                                    l.data(), o.data());
        }
      } else {
        for (int64_t t = 0; t < n_tiles; ++t) {
          const int64_t k0 = t * kKeyTile;
          for (int64_t r = 0; r < M; ++r) valid[r] = visible(pos0 + r / G, k0);
          rows_dispatch<Path>(M, qt.data(), kpack.get() + (slot0 + t) * tile_elems,
                              vpack.get() + (slot0 + t) * tile_elems, valid.data(), D, c, m.data(), l.data(),
                              o.data());
        }
      }
      for (int64_t r = 0; r < M; ++r) {
        const float inv = 1.f / l[r];
        T* dst = op + ((sp.start + item.q0 + r / G) * sh.H + item.head * G + r % G) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[r * D + d] * inv);
      }
    }
    if constexpr (Path::kTileRows > 0) Path::release();
  });
}

bool supported_head_dim(int64_t d) { return d == 64 || d == 128; }

// The bf16 path this process takes: AMX tiles where compiled in, granted by the kernel and
// not turned off with PDSERVE_NO_AMX=1 (read per call, so a benchmark can pair the two).
bool use_amx() {
#ifdef PDS_AMX
  const char* off = std::getenv("PDSERVE_NO_AMX");
  return !(off && *off && std::strcmp(off, "0") != 0) && AmxDot::permitted();
#else
  return false;
#endif
}

}  // namespace

// out, q: [T, H, D]; k_cache, v_cache: [num_blocks, block_size, KVH, D], all bf16 or all fp32, holding
// every span's K/V already; spans: [S, 3] int64 (first row, end row, context length);
// block_tables: [S, max_blocks] int64. Writes the spans' rows of out.
void prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                       torch::Tensor spans, torch::Tensor block_tables, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [T, H, D] of one shape");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "k/v caches must be [NB, BS, KVH, D]");
  const auto dt = q.scalar_type();
  TORCH_CHECK((dt == torch::kBFloat16 || dt == torch::kFloat32) && out.scalar_type() == dt &&
                  k_cache.scalar_type() == dt && v_cache.scalar_type() == dt,
              "prefill_attention takes q, out and caches of one dtype, bf16 or float32");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q, out and the caches must be contiguous");
  TORCH_CHECK(spans.scalar_type() == torch::kInt64 && block_tables.scalar_type() == torch::kInt64 &&
                  spans.is_contiguous() && block_tables.is_contiguous(),
              "spans and block_tables must be contiguous int64");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(supported_head_dim(D), "prefill_attention supports head_dim 64 or 128, not ", D);
  TORCH_CHECK(k_cache.size(3) == D && KVH > 0 && H % KVH == 0, "q heads must be a multiple of the KV heads");
  TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 3 && block_tables.dim() == 2 &&
                  block_tables.size(0) == spans.size(0),
              "spans must be [S, 3] and block_tables [S, max_blocks]");
  const int64_t S = spans.size(0), max_blocks = block_tables.size(1);
  const int64_t* sd = spans.data_ptr<int64_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  std::vector<Span> list;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t start = sd[3 * s], end = sd[3 * s + 1], ctx = sd[3 * s + 2];
    TORCH_CHECK(0 <= start && start < end && end <= T, "span ", s, ": rows [", start, ", ", end, ") out of range");
    TORCH_CHECK(end - start <= ctx && ctx <= max_blocks * BS, "span ", s, ": context ", ctx, " does not fit");
    const int64_t* table = bt + s * max_blocks;
    for (int64_t b = 0; b < (ctx + BS - 1) / BS; ++b)
      TORCH_CHECK(0 <= table[b] && table[b] < NB, "span ", s, ": block id ", table[b], " out of range");
    list.push_back({start, end - start, ctx, table});
  }
  const Shape sh{H, KVH, H / KVH, D, BS, KVH * D, BS * KVH * D};
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == torch::kFloat32) {
    prefill<F32Dot<float>, float>(out, q, k_cache, v_cache, list, sh, sc);
    return;
  }
#ifdef PDS_BF16_DOT
#ifdef PDS_AMX
  if (use_amx()) {
    prefill<AmxDot, bf16>(out, q, k_cache, v_cache, list, sh, sc);
    return;
  }
#endif
  prefill<Bf16Dot, bf16>(out, q, k_cache, v_cache, list, sh, sc);
#else
  prefill<F32Dot<bf16>, bf16>(out, q, k_cache, v_cache, list, sh, sc);
#endif
}

void register_prefill_attention(pybind11::module& m) {
  m.def("prefill_attention", &prefill_attention,
        "causal attention of prefill spans over the paged bf16 or fp32 KV cache, written into out (CPU)");
  m.attr("prefill_attention_head_dims") = pybind11::make_tuple(64, 128);
  m.def("prefill_attention_path", [] {
#ifdef PDS_BF16_DOT
    return use_amx() ? "amx-bf16" : "avx512-bf16";
#else
    return "fp32";
#endif
  }, "which bf16 path prefill_attention takes in this process now: amx-bf16, avx512-bf16 or fp32 (portable)");
}
