// CPU kernels of kbit: quantize, dequantize and y = x @ W_hat^T straight from the storage format
// (kbit/formats.py: blocks of 32, one 32-bit word per bit plane, an E4M4 absmax byte per block, a codebook of
// 2**bits floats, a per-tensor power-of-two scale). No derived layout: a weight row is a run of blocks, each
// `bits` consecutive words, so the weight stays the one resident copy.
//
// One SIMD layer (`Simd`) per instruction set, chosen by the compiler flags kbit/_build_cpu.py picks from the CPU:
// AVX-512 (16 lanes: a plane's half-word is a lane mask, the codebook lookup one vpermps / vpermt2ps), AVX2 (8 lanes:
// variable shifts, vpermps per 8 entries plus blends), NEON (4 lanes: byte-table lookups), else plain C++.
// The GEMM dequantizes each block once into registers (codebook entries already multiplied by the block scale) and
// multiplies it against up to 16 activation rows and several weight rows at a time; threads split the output rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace {

constexpr int BLOCK = 32;
#ifndef KBIT_CPU_CHUNK
#define KBIT_CPU_CHUNK 8
#endif

// ----------------------------------------------------------------------------- E4M4 (bit for bit as kbit.formats)
float decode_e4m4(uint8_t code) {
  const int e = code >> 4, m = code & 0xF;
  return e == 0 ? static_cast<float>(m) * 0x1p-14f : std::ldexp(1.0f + static_cast<float>(m) / 16.0f, e - 11);
}

uint8_t encode_e4m4(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const int exp = (u >> 23) & 0xFF;
  if (exp - 127 < -10) return static_cast<uint8_t>(std::nearbyint(static_cast<double>(x) * 16384.0));
  const uint32_t man = u & 0x7FFFFF, rem = man & 0x7FFFF;
  uint32_t m4 = man >> 19;
  m4 += (rem > 0x40000 || (rem == 0x40000 && (m4 & 1))) ? 1 : 0;
  const int e = exp - 127 + 11 + static_cast<int>(m4 >> 4);
  return e > 15 ? 0xFF : static_cast<uint8_t>((e << 4) | (m4 & 0xF));
}

// Block scale of every E4M4 code times the tensor scale: the float32 product the reference computes.
struct BlockScales {
  float of[256];
  explicit BlockScales(float scale) {
    static const struct Decoded {  // once per process: ldexp costs microseconds per call at small layers
      float of[256];
      Decoded() {
        for (int c = 0; c < 256; ++c) of[c] = decode_e4m4(static_cast<uint8_t>(c));
      }
    } decoded;
    for (int c = 0; c < 256; ++c) of[c] = decoded.of[c] * scale;
  }
};

// ----------------------------------------------------------------------------- SIMD layers
// Each provides: lanes W, accumulators it can hold in registers (MAX_ACC), a vector type V, and
//   Codebook(cb32)            the codebook in registers (32 floats, zero-padded)
//   table<BITS>(cb, s)        the codebook times a block scale
//   codes<BITS>(p)            what weights() reads of a block's bit-plane words p (p itself, or its codes)
//   weights<BITS>(c, t, g)    lanes g*W .. g*W+W-1 of that block: t[code]
//   zero / load / store / fma / hsum.
#if defined(__AVX512F__)
struct Simd {
  static constexpr int W = 16, MAX_ACC = 24;
  using V = __m512;
  struct Codebook {
    __m512 lo, hi;
    Codebook() = default;
    explicit Codebook(const float* cb) : lo(_mm512_loadu_ps(cb)), hi(_mm512_loadu_ps(cb + 16)) {}
  };
  using Table = Codebook;
  template <int BITS>
  static inline Table table(const Codebook& cb, float s) {
    Table t = cb;
    const __m512 sv = _mm512_set1_ps(s);
    t.lo = _mm512_mul_ps(cb.lo, sv);
    if (BITS == 5) t.hi = _mm512_mul_ps(cb.hi, sv);
    return t;
  }
#if defined(__GFNI__) && defined(__AVX512VBMI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
  // All 32 codes of a block at once, one byte each: the block's planes as 8x8 bit matrices (row b of matrix q =
  // byte q of plane b, one vpermb) transposed by one gf2p8affineqb against the identity.
  static constexpr const char* name = "avx512_gfni";
  using Codes = __m256i;
  template <int BITS>
  static inline Codes codes(const uint32_t* p) {
    alignas(32) static const uint8_t order[32] = {
#define KBIT_ROW(q) BITS > 7 ? 4 * 7 + q : 31, BITS > 6 ? 4 * 6 + q : 31, BITS > 5 ? 4 * 5 + q : 31, \
                    BITS > 4 ? 4 * 4 + q : 31, BITS > 3 ? 4 * 3 + q : 31, BITS > 2 ? 4 * 2 + q : 31, \
                    BITS > 1 ? 4 * 1 + q : 31, 4 * 0 + q
        KBIT_ROW(0), KBIT_ROW(1), KBIT_ROW(2), KBIT_ROW(3)
#undef KBIT_ROW
    };
    const __m256i planes = _mm256_maskz_loadu_epi8((1u << (4 * BITS)) - 1, p);  // byte 31 stays zero
    const __m256i matrices = _mm256_permutexvar_epi8(_mm256_load_si256(reinterpret_cast<const __m256i*>(order)), planes);
    return _mm256_gf2p8affine_epi64_epi8(_mm256_set1_epi64x(0x8040201008040201LL), matrices, 0);
  }
  template <int BITS>
  static inline V weights(const Codes& c, const Table& t, int g) {
    const __m512i idx = _mm512_cvtepu8_epi32(g == 0 ? _mm256_castsi256_si128(c) : _mm256_extracti128_si256(c, 1));
    return BITS == 5 ? _mm512_permutex2var_ps(t.lo, idx, t.hi) : _mm512_permutexvar_ps(idx, t.lo);
  }
#else
  static constexpr const char* name = "avx512";
  using Codes = const uint32_t*;
  template <int BITS>
  static inline Codes codes(const uint32_t* p) { return p; }
  template <int BITS>
  static inline V weights(const Codes& p, const Table& t, int g) {
    // Bit j of plane b is bit b of lane j's code: each half plane is the lane mask of an OR.
    __m512i c = _mm512_setzero_si512();
    for (int b = 0; b < BITS; ++b)
      c = _mm512_mask_or_epi32(c, static_cast<__mmask16>(p[b] >> (16 * g)), c, _mm512_set1_epi32(1 << b));
    return BITS == 5 ? _mm512_permutex2var_ps(t.lo, c, t.hi) : _mm512_permutexvar_ps(c, t.lo);
  }
#endif
  static inline V zero() { return _mm512_setzero_ps(); }
  static inline V load(const float* x) { return _mm512_loadu_ps(x); }
  static inline void store(float* y, V v) { _mm512_storeu_ps(y, v); }
  static inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static inline float hsum(V v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Simd {
  static constexpr int W = 8, MAX_ACC = 8;
  static constexpr const char* name = "avx2";
  using V = __m256;
  using Codes = const uint32_t*;
  template <int BITS>
  static inline Codes codes(const uint32_t* p) { return p; }
  struct Codebook {
    __m256 q[4];
    Codebook() = default;
    explicit Codebook(const float* cb) {
      for (int i = 0; i < 4; ++i) q[i] = _mm256_loadu_ps(cb + 8 * i);
    }
  };
  using Table = Codebook;
  template <int BITS>
  static inline Table table(const Codebook& cb, float s) {
    Table t = cb;
    const __m256 sv = _mm256_set1_ps(s);
    for (int i = 0; i < ((1 << BITS) + 7) / 8; ++i) t.q[i] = _mm256_mul_ps(cb.q[i], sv);
    return t;
  }
  template <int BITS>
  static inline V weights(const Codes& p, const Table& t, int g) {
    const __m256i shifts = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * g));
    const __m256i one = _mm256_set1_epi32(1);
    __m256i c = _mm256_setzero_si256();
    for (int b = 0; b < BITS; ++b) {
      const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(p[b])), shifts), one);
      c = _mm256_or_si256(c, _mm256_slli_epi32(bit, b));
    }
    // vpermps looks up 8 entries by the code's low 3 bits; code bits 3 and 4 choose among the eighths (blendv
    // reads each lane's sign bit).
    const __m256 v0 = _mm256_permutevar8x32_ps(t.q[0], c);
    if (BITS <= 3) return v0;
    const __m256 bit3 = _mm256_castsi256_ps(_mm256_slli_epi32(c, 28));
    const __m256 lo = _mm256_blendv_ps(v0, _mm256_permutevar8x32_ps(t.q[1], c), bit3);
    if (BITS == 4) return lo;
    const __m256 hi = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.q[2], c), _mm256_permutevar8x32_ps(t.q[3], c), bit3);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(c, 27)));
  }
  static inline V zero() { return _mm256_setzero_ps(); }
  static inline V load(const float* x) { return _mm256_loadu_ps(x); }
  static inline void store(float* y, V v) { _mm256_storeu_ps(y, v); }
  static inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static inline float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
};
#elif defined(__ARM_NEON) && defined(__aarch64__)
struct Simd {
  static constexpr int W = 4, MAX_ACC = 16;
  static constexpr const char* name = "neon";
  using V = float32x4_t;
  using Codes = const uint32_t*;
  template <int BITS>
  static inline Codes codes(const uint32_t* p) { return p; }
  struct Codebook {
    float32x4_t q[8];
    explicit Codebook(const float* cb) {
      for (int i = 0; i < 8; ++i) q[i] = vld1q_f32(cb + 4 * i);
    }
  };
  struct Table {
    uint8x16x4_t lo, hi;  // the scaled codebook as two 64-byte tables for tbl/tbx
  };
  template <int BITS>
  static inline Table table(const Codebook& cb, float s) {
    Table t;
    t.lo.val[0] = vreinterpretq_u8_f32(vmulq_n_f32(cb.q[0], s));
    t.lo.val[1] = vreinterpretq_u8_f32(vmulq_n_f32(cb.q[1], s));
    t.lo.val[2] = vreinterpretq_u8_f32(vmulq_n_f32(cb.q[2], s));
    t.lo.val[3] = vreinterpretq_u8_f32(vmulq_n_f32(cb.q[3], s));
    if (BITS == 5) {
      t.hi.val[0] = vreinterpretq_u8_f32(vmulq_n_f32(cb.q[4], s));
      t.hi.val[1] = vreinterpretq_u8_f32(vmulq_n_f32(cb.q[5], s));
      t.hi.val[2] = vreinterpretq_u8_f32(vmulq_n_f32(cb.q[6], s));
      t.hi.val[3] = vreinterpretq_u8_f32(vmulq_n_f32(cb.q[7], s));
    }
    return t;
  }
  template <int BITS>
  static inline V weights(const Codes& p, const Table& t, int g) {
    const int32_t base[4] = {-4 * g, -4 * g - 1, -4 * g - 2, -4 * g - 3};
    const int32x4_t right = vld1q_s32(base);  // vshl by a negative count shifts right
    uint32x4_t c = vdupq_n_u32(0);
    for (int b = 0; b < BITS; ++b) {
      const uint32x4_t bit = vandq_u32(vshlq_u32(vdupq_n_u32(p[b]), right), vdupq_n_u32(1));
      c = vorrq_u32(c, vshlq_u32(bit, vdupq_n_s32(b)));
    }
    // Byte indices 4 * code + 0..3 of each lane's float in the tables.
    const uint8x16_t idx = vreinterpretq_u8_u32(vaddq_u32(vmulq_n_u32(c, 0x04040404u), vdupq_n_u32(0x03020100u)));
    uint8x16_t r = vqtbl4q_u8(t.lo, idx);
    if (BITS == 5) r = vqtbx4q_u8(r, t.hi, vsubq_u8(idx, vdupq_n_u8(64)));  // indices past 63: the upper table
    return vreinterpretq_f32_u8(r);
  }
  static inline V zero() { return vdupq_n_f32(0.0f); }
  static inline V load(const float* x) { return vld1q_f32(x); }
  static inline void store(float* y, V v) { vst1q_f32(y, v); }
  static inline V fma(V a, V b, V c) { return vfmaq_f32(c, a, b); }
  static inline float hsum(V v) { return vaddvq_f32(v); }
};
#else
struct Simd {  // plain C++, one lane
  static constexpr int W = 1, MAX_ACC = 16;
  static constexpr const char* name = "scalar";
  using V = float;
  using Codes = const uint32_t*;
  template <int BITS>
  static inline Codes codes(const uint32_t* p) { return p; }
  struct Codebook {
    const float* cb;
    explicit Codebook(const float* c) : cb(c) {}
  };
  struct Table {
    float q[32];
  };
  template <int BITS>
  static inline Table table(const Codebook& cb, float s) {
    Table t;
    for (int i = 0; i < (1 << BITS); ++i) t.q[i] = cb.cb[i] * s;
    return t;
  }
  template <int BITS>
  static inline V weights(const Codes& p, const Table& t, int j) {
    uint32_t c = 0;
    for (int b = 0; b < BITS; ++b) c |= ((p[b] >> j) & 1u) << b;
    return t.q[c];
  }
  static inline V zero() { return 0.0f; }
  static inline V load(const float* x) { return *x; }
  static inline void store(float* y, V v) { *y = v; }
  static inline V fma(V a, V b, V c) { return a * b + c; }
  static inline float hsum(V v) { return v; }
};
#endif

constexpr int GROUPS = BLOCK / Simd::W;  // vectors per block

// ----------------------------------------------------------------------------- GEMM
struct GemmArgs {
  const float* x;  // the activations as panels (panel_of): K = padded in_features
  const uint32_t* planes;  // [N * K / 32 * bits]
  const uint8_t* absmax;  // [N * K / 32]
  const float* bias;  // [N] or null
  float* y;  // [M, N]
  int64_t M, N, K;
};

// y[m0 .. m0+MT, n0 .. n0+NR] for MT activation rows and NR weight rows: every block is dequantized once per
// weight row, its vectors multiplied against all MT rows (MT * NR accumulators stay in registers).
template <int BITS, int MT, int NR>
inline void tile(const GemmArgs& a, const Simd::Codebook& cb, const BlockScales& bs, int64_t m0, int64_t n0) {
  const int64_t blocks = a.K / BLOCK;
  Simd::V acc[NR][MT];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = Simd::zero();
  const float* x = a.x + m0 * a.K;  // this chunk's panel
  for (int64_t kb = 0; kb < blocks; ++kb) {
    Simd::Table t[NR];
    Simd::Codes p[NR];
    for (int r = 0; r < NR; ++r) {
      const int64_t block = (n0 + r) * blocks + kb;
      p[r] = Simd::codes<BITS>(a.planes + block * BITS);
      t[r] = Simd::table<BITS>(cb, bs.of[a.absmax[block]]);
    }
    for (int g = 0; g < GROUPS; ++g) {
      Simd::V w[NR];
      for (int r = 0; r < NR; ++r) w[r] = Simd::weights<BITS>(p[r], t[r], g);
      for (int m = 0; m < MT; ++m) {
        const Simd::V xv = Simd::load(x + (kb * MT + m) * BLOCK + g * Simd::W);
        for (int r = 0; r < NR; ++r) acc[r][m] = Simd::fma(xv, w[r], acc[r][m]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    const float b = a.bias ? a.bias[n0 + r] : 0.0f;
    for (int m = 0; m < MT; ++m) a.y[(m0 + m) * a.N + n0 + r] = Simd::hsum(acc[r][m]) + b;
  }
}

// Weight rows per tile for MT activation rows: as many as the accumulator registers allow, at most 4.
constexpr int rows_for(int mt) { return Simd::MAX_ACC / mt >= 4 ? 4 : Simd::MAX_ACC / mt; }

template <int BITS, int MT>
void rows(const GemmArgs& a, const Simd::Codebook& cb, const BlockScales& bs, int64_t m0, int64_t n0, int64_t n1) {
  constexpr int NR = rows_for(MT);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) tile<BITS, MT, NR>(a, cb, bs, m0, n);
  for (; n < n1; ++n) tile<BITS, MT, 1>(a, cb, bs, m0, n);
}

// Activation rows go in chunks of CHUNK, 4, 2, 1 (the largest that fits what is left).
constexpr int CHUNK = KBIT_CPU_CHUNK;
int64_t chunk_at(int64_t left) { return left >= CHUNK ? CHUNK : left >= 4 ? 4 : left >= 2 ? 2 : 1; }

// x [M, K] -> panels: chunk by chunk (rows m0 .. m0+mt), block by block, its mt rows of 32 back to back, so that
// the tile loop reads each chunk's activations in one sequential stream (rows K apart would share cache sets).
at::Tensor panel_of(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / BLOCK;
  at::Tensor out = at::empty_like(x);
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t m0 = 0, mt; m0 < M; m0 += mt) {
    mt = chunk_at(M - m0);
    for (int64_t kb = 0; kb < blocks; ++kb)
      for (int64_t m = 0; m < mt; ++m)
        std::memcpy(dst + m0 * K + (kb * mt + m) * BLOCK, src + (m0 + m) * K + kb * BLOCK, BLOCK * sizeof(float));
  }
  return out;
}

template <int BITS>
void gemm_rows(const GemmArgs& a, const Simd::Codebook& cb, const BlockScales& bs, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0, mt; m0 < a.M; m0 += mt) {
    switch (mt = chunk_at(a.M - m0)) {
      case CHUNK: rows<BITS, CHUNK>(a, cb, bs, m0, n0, n1); break;
      case 4: rows<BITS, 4>(a, cb, bs, m0, n0, n1); break;
      case 2: rows<BITS, 2>(a, cb, bs, m0, n0, n1); break;
      default: rows<BITS, 1>(a, cb, bs, m0, n0, n1);
    }
  }
}

template <typename F>
void with_bits(int64_t bits, F&& f) {
  switch (bits) {
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    default: TORCH_CHECK(false, "kbit_cpu: bits must be 2..5, got ", bits);
  }
}

void padded_codebook(const at::Tensor& codebook, float out[32]) {
  const at::Tensor cb = codebook.to(at::kFloat).contiguous();
  std::memset(out, 0, 32 * sizeof(float));
  std::memcpy(out, cb.data_ptr<float>(), cb.numel() * sizeof(float));
}

at::Tensor dequantize_fp32(const at::Tensor& packed, const at::Tensor& absmax, const at::Tensor& codebook,
                           int64_t bits, int64_t blocks, double scale);

// Activation rows from which a dequantized weight and the BLAS GEMM beat the fused loop (it dequantizes every
// block once per 16 rows; BLAS reaches the FMA peak).
constexpr int64_t BLAS_ROWS = 64;

at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& absmax, const at::Tensor& codebook,
                const at::Tensor& scale, const std::optional<at::Tensor>& bias, int64_t bits, int64_t out_features,
                int64_t in_features_padded) {
  const int64_t M = x.size(0), N = out_features, K = in_features_padded;
  at::Tensor xf = x.to(at::kFloat).contiguous();
  if (xf.size(1) < K) xf = at::constant_pad_nd(xf, {0, K - xf.size(1)});  // zero columns meet the zero padding
  const float s = scale.item<float>();
  at::Tensor y;
  if (M >= BLAS_ROWS) {
    const at::Tensor w = dequantize_fp32(packed, absmax, codebook, bits, N * K / BLOCK, s).view({N, K});
    y = at::mm(xf, w.t());
    if (bias) y.add_(bias->to(at::kFloat));
    return y.to(x.scalar_type());
  }
  y = at::empty({M, N}, xf.options());
  at::Tensor bf = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  alignas(64) float cb32[32];
  padded_codebook(codebook, cb32);
  const BlockScales bs(s);
  const at::Tensor panels = panel_of(xf);
  GemmArgs a{panels.data_ptr<float>(), reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()),
             absmax.data_ptr<uint8_t>(), bias ? bf.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, N, K};
  // At least 2^19 weights (~0.1 ms) per thread: a small layer runs on the calling thread, where waking the pool
  // would cost more than it saves (on a machine shared with other work, a descheduled thread stalls the barrier).
  const int64_t grain = std::max<int64_t>(4, (1 << 19) / K);
  with_bits(bits, [&](auto B) {
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      const Simd::Codebook cb(cb32);
      gemm_rows<decltype(B)::value>(a, cb, bs, n0, n1);
    });
  });
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

// ----------------------------------------------------------------------------- dequantize
at::Tensor dequantize_fp32(const at::Tensor& packed, const at::Tensor& absmax, const at::Tensor& codebook,
                           int64_t bits, int64_t blocks, double scale) {
  at::Tensor out = at::empty({blocks * BLOCK}, packed.options().dtype(at::kFloat));
  alignas(64) float cb32[32];
  padded_codebook(codebook, cb32);
  const BlockScales bs(static_cast<float>(scale));
  const uint32_t* planes = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  const uint8_t* am = absmax.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  with_bits(bits, [&](auto B) {
    constexpr int BITS = decltype(B)::value;
    at::parallel_for(0, blocks, 2048, [&](int64_t b0, int64_t b1) {
      const Simd::Codebook cb(cb32);
      for (int64_t b = b0; b < b1; ++b) {
        const Simd::Table t = Simd::table<BITS>(cb, bs.of[am[b]]);
        const Simd::Codes c = Simd::codes<BITS>(planes + b * BITS);
        for (int g = 0; g < GROUPS; ++g) Simd::store(o + b * BLOCK + g * Simd::W, Simd::weights<BITS>(c, t, g));
      }
    });
  });
  return out;
}

at::Tensor dequantize(const at::Tensor& packed, const at::Tensor& absmax, const at::Tensor& codebook, int64_t bits,
                      int64_t n, at::ScalarType dtype, const at::Tensor& scale) {
  const at::Tensor flat = dequantize_fp32(packed, absmax, codebook, bits, absmax.numel(), scale.item<float>());
  const at::Tensor w = flat.narrow(0, 0, n);
  return dtype == at::kFloat ? (n == flat.numel() ? flat : w.contiguous()) : w.to(dtype);
}

// ----------------------------------------------------------------------------- quantize
// Codes as kbit.formats.nearest_codes: v = x * (1 / d), then the count of codebook midpoints strictly below v.
std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& A, const at::Tensor& codebook, int64_t bits,
                                            const at::Tensor& scale) {
  const at::Tensor x = A.reshape(-1).to(at::kFloat).contiguous();
  const int64_t n = x.numel(), blocks = (n + BLOCK - 1) / BLOCK;
  at::Tensor packed = at::empty({blocks * bits}, x.options().dtype(at::kInt));
  at::Tensor absmax = at::empty({blocks}, x.options().dtype(at::kByte));
  const at::Tensor cb = codebook.to(at::kFloat).contiguous();
  const int levels = 1 << bits;
  float mids[31];
  for (int i = 0; i + 1 < levels; ++i) mids[i] = (cb.data_ptr<float>()[i + 1] + cb.data_ptr<float>()[i]) * 0.5f;
  const float inv_scale = 1.0f / scale.item<float>();
  const float* src = x.data_ptr<float>();
  uint32_t* planes = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  uint8_t* am = absmax.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1024, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float v[BLOCK];
      const int64_t start = b * BLOCK, count = std::min<int64_t>(BLOCK, n - start);
      float peak = 0.0f;
      for (int j = 0; j < BLOCK; ++j) {
        v[j] = j < count ? src[start + j] * inv_scale : 0.0f;
        peak = std::max(peak, std::fabs(v[j]));
      }
      const uint8_t code = encode_e4m4(peak);
      am[b] = code;
      const float d = decode_e4m4(code), recip = d > 0.0f ? 1.0f / d : 0.0f;
      uint8_t codes[BLOCK];
      for (int j = 0; j < BLOCK; ++j) {
        const float t = v[j] * recip;
        uint8_t c = 0;
        for (int i = 0; i + 1 < levels; ++i) c += t > mids[i];
        codes[j] = c;
      }
      for (int p = 0; p < bits; ++p) {
        uint32_t word = 0;
        for (int j = 0; j < BLOCK; ++j) word |= static_cast<uint32_t>((codes[j] >> p) & 1) << j;
        planes[b * bits + p] = word;
      }
    }
  });
  return {packed, absmax};
}

std::string isa() { return Simd::name; }

}  // namespace

TORCH_LIBRARY(kbit_cpu, m) {
  m.def("gemm(Tensor x, Tensor packed, Tensor absmax, Tensor codebook, Tensor scale, Tensor? bias, int bits, "
        "int out_features, int in_features_padded) -> Tensor");
  m.def("dequantize(Tensor packed, Tensor absmax, Tensor codebook, int bits, int n, ScalarType dtype, "
        "Tensor scale) -> Tensor");
  m.def("quantize(Tensor A, Tensor codebook, int bits, Tensor scale) -> (Tensor, Tensor)");
  m.def("isa() -> str", &isa);
  m.impl("gemm", c10::DispatchKey::CPU, &gemm);
  m.impl("dequantize", c10::DispatchKey::CPU, &dequantize);
  m.impl("quantize", c10::DispatchKey::CPU, &quantize);
}
