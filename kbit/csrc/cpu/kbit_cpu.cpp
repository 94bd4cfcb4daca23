// CPU kernels of kbit: quantize, dequantize, y = x @ W_hat^T straight from the storage format, and unrepack
// (kbit/formats.py: blocks of 32, one 32-bit word per bit plane, an E4M4 absmax byte per block, a codebook of
// 2**bits floats, a per-tensor power-of-two scale). No derived layout: a weight row is a run of blocks, each
// `bits` consecutive words, so the weight stays the one resident copy.
//
// One SIMD layer (`Simd`) per instruction set, chosen by the compiler flags kbit/_build_cpu.py picks from the CPU:
// AVX-512 (16 lanes: a plane's half-word is a lane mask, the codebook lookup one vpermps / vpermt2ps), AVX2 (8 lanes:
// variable shifts, vpermps per 8 entries plus blends), NEON (4 lanes: byte-table lookups), else plain C++.
// The GEMM dequantizes each block once into registers (codebook entries already multiplied by the block scale) and
// multiplies it against up to 8 activation rows and several weight rows at a time; threads split the output rows.
// With AVX-512, whole groups of 16 output rows instead go through the row-lane kernels (table lookups for 16 rows
// at once, see `row_lanes`), whose cost falls with K.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
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

#if defined(__AVX512F__)
// ----------------------------------------------------------------------------- row-lane GEMM (AVX-512, K=2..5)
// The lookup-table idea of T-MAC turned to exact float32: the 16 lanes hold 16 weight rows, not 16 weights of one
// row, so one vpermps looks up a 16-entry float table for 16 rows at once and the activation side is shared:
//   K=2: the table of an activation pair, T[i] = x[2q] * cb[code a] + x[2q+1] * cb[code b] (i holds both 2-bit
//        codes): one lookup and one add per two weights;
//   K=3, 4: the codebook itself; one lookup per weight, multiplied by the broadcast activation;
//   K=5: likewise from the 32-entry codebook in two registers (vpermt2ps).
// The block scale multiplies each block's partial sum once. A lane's index comes from its row's bit-plane words
// (transposed from 16 rows, see Group) by shifts and bit selects, so the decoding cost falls with K.
namespace row_lanes {

constexpr int L = 16;  // rows per lane group

inline __m512i select(uint32_t mask, __m512i a, __m512i b) {  // bits of a where mask is set, else of b
  return _mm512_ternarylogic_epi32(_mm512_set1_epi32(static_cast<int>(mask)), a, b, 0xCA);
}

template <int S>
inline __m512i shift_right(__m512i v) {  // by S bits, left for negative S
  if constexpr (S > 0) return _mm512_srli_epi32(v, S);
  else if constexpr (S < 0) return _mm512_slli_epi32(v, -S);
  else return v;
}

// r[i] lane j <- r[j] lane i: unpacks of dword and qword pairs, then two rounds of 128-bit lane shuffles.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4)
    for (int j = 0; j < 2; ++j) {
      r[i + j] = _mm512_unpacklo_epi64(t[i + j], t[i + j + 2]);
      r[i + j + 2] = _mm512_unpackhi_epi64(t[i + j], t[i + j + 2]);
    }
  for (int i = 0; i < 8; ++i) {
    const int lo = (i / 4) * 8 + i % 4;  // pairs of rows 4 apart within each half
    t[i] = _mm512_shuffle_i32x4(r[lo], r[lo + 4], 0x88);
    t[i + 8] = _mm512_shuffle_i32x4(r[lo], r[lo + 4], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {  // r[4 * lane128 + column]; the qword unpacks left columns 1 and 2 swapped
    const int column = i == 1 ? 2 : i == 2 ? 1 : i;
    r[column] = _mm512_shuffle_i32x4(t[i], t[i + 4], 0x88);
    r[8 + column] = _mm512_shuffle_i32x4(t[i], t[i + 4], 0xDD);
    r[4 + column] = _mm512_shuffle_i32x4(t[i + 8], t[i + 12], 0x88);
    r[12 + column] = _mm512_shuffle_i32x4(t[i + 8], t[i + 12], 0xDD);
  }
}

// A block scale from its E4M4 code (as BlockScales, lanes at a time): for e > 0 the float's bits are the code's
// shifted left by 19 plus (127 - 11) << 23; e = 0 is m * 2^-14.
inline __m512 block_scales(__m512i code, __m512 tensor_scale) {
  const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(code, 19), _mm512_set1_epi32(116 << 23)));
  const __m512 small = _mm512_mul_ps(_mm512_cvtepi32_ps(code), _mm512_set1_ps(0x1p-14f));
  const __mmask16 is_normal = _mm512_cmpge_epi32_mask(code, _mm512_set1_epi32(16));
  return _mm512_mul_ps(_mm512_mask_blend_ps(is_normal, small, normal), tensor_scale);
}

// The rows n0 .. n0+15 of a weight (fewer in the last group: its other lanes read zeros and are never stored, so
// that a row sums in the same order whether or not its group is whole), 16 blocks at a time (a span): each row's
// plane words and E4M4 codes transposed so that word b of block kb is one vector with a row per lane (rows are far
// apart: gathers cost more).
constexpr int SPAN = 16;
template <int BITS>
struct Group {
  const uint32_t* planes;  // row n0, block 0
  const uint8_t* absmax;
  int64_t blocks;
  int rows;  // lanes that hold a weight row
  alignas(64) __m512i words[SPAN * BITS];  // [block * BITS + b]
  alignas(64) __m512 scales[SPAN];
  void start(const GemmArgs& a, int64_t n0) {
    blocks = a.K / BLOCK;
    rows = static_cast<int>(std::min<int64_t>(L, a.N - n0));
    planes = a.planes + n0 * blocks * BITS;
    absmax = a.absmax + n0 * blocks;
  }
  __mmask16 lanes() const { return static_cast<__mmask16>((1u << rows) - 1); }
  void load(int64_t kb0, __m512 tensor_scale, int ahead) {
    const int64_t count = std::min<int64_t>(SPAN, blocks - kb0);
    __m512i r[16];
    for (int b = 0; b < BITS; ++b) {  // words kb0 * BITS + 16 b .. of each row
      const int64_t first = kb0 * BITS + 16 * b, left = count * BITS - 16 * b;
      if (left <= 0) break;
      const __mmask16 mask = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
      for (int l = 0; l < L; ++l)
        r[l] = l < rows ? _mm512_maskz_loadu_epi32(mask, planes + l * blocks * BITS + first) : _mm512_setzero_si512();
      transpose16(r);
      for (int i = 0; i < 16; ++i) words[16 * b + i] = r[i];
    }
    for (int l = 0; l < L; ++l) {
      const uint8_t* codes = absmax + l * blocks + kb0;
      alignas(16) uint8_t tail[16] = {};
      if (l >= rows) codes = tail;
      else if (count < SPAN) codes = static_cast<const uint8_t*>(std::memcpy(tail, codes, count));
      r[l] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    }
    transpose16(r);
    for (int i = 0; i < SPAN; ++i) scales[i] = block_scales(r[i], tensor_scale);
    // 16 rows far apart are too many streams for the hardware prefetcher: each span fetches its share of the lane
    // group `ahead` groups on (a contiguous region, the next tile's) into L2.
    const int64_t region_span = SPAN * L;  // blocks of that region per span of this one
    const char* words_ahead = reinterpret_cast<const char*>(planes + (ahead * blocks + kb0) * L * BITS);
    for (int64_t at = 0; at < region_span * BITS * 4; at += 64) _mm_prefetch(words_ahead + at, _MM_HINT_T1);
    const char* codes_ahead = reinterpret_cast<const char*>(absmax + (ahead * blocks + kb0) * L);
    for (int64_t at = 0; at < region_span; at += 64) _mm_prefetch(codes_ahead + at, _MM_HINT_T1);
  }
};

// What every lane group reads of the activations.
struct Inputs {
  const float* x;  // [M, K] row-major, zero-padded
  const float* tables;  // pair_tables (K=2, one activation row) or null
  __m512 cb16;  // entry i: codebook entry i mod 2^K (the codebook repeated below K = 4; K = 5's first half)
  __m512 cb_hi;  // K = 5: entries 16-31
  __m512 tensor_scale;
};

// Nibble i of w[k] holds the code of weight 4i+k in its low BITS bits (bits above hold other codes' bits, which
// a 16-entry table that repeats the codebook ignores).
template <int BITS, int k>
inline __m512i code_nibbles(const __m512i p[BITS]) {
  __m512i w = shift_right<k>(p[0]);
  w = select(0x11111111u, w, shift_right<k - 1>(p[1]));
  if constexpr (BITS > 2) w = select(0x33333333u, w, shift_right<k - 2>(p[2]));
  if constexpr (BITS > 3) w = select(0x77777777u, w, shift_right<k - 3>(p[3]));
  return w;
}

// K=5: byte i of w[k] holds the code of weight 8i+k in its low 5 bits (vpermt2ps reads an index's low 5 bits).
template <int k>
inline __m512i code_bytes(const __m512i p[5]) {
  __m512i w = shift_right<k>(p[0]);
  w = select(0x01010101u, w, shift_right<k - 1>(p[1]));
  w = select(0x03030303u, w, shift_right<k - 2>(p[2]));
  w = select(0x07070707u, w, shift_right<k - 3>(p[3]));
  return select(0x0F0F0F0Fu, w, shift_right<k - 4>(p[4]));
}

// Block kb's partial sums by codebook lookups: one per weight and lane group, shared by the MT activation rows.
// A weight's code is field f of word k: nibbles (8 fields of 4 bits, K <= 4) or bytes (4 of 8, K = 5).
template <int BITS, int MT, int NG>
inline void codebook_block(const GemmArgs& a, const Inputs& in, const Group<BITS>* g, int64_t m0, int64_t kb,
                           __m512 (&part)[MT][NG]) {
  constexpr int WORDS = BITS == 5 ? 8 : 4, FIELDS = BLOCK / WORDS, FIELD_BITS = 32 / FIELDS;
  __m512i w[NG][WORDS];
  for (int t = 0; t < NG; ++t) {
    const __m512i* p = g[t].words + (kb % SPAN) * BITS;
    if constexpr (BITS == 5) {
      w[t][0] = code_bytes<0>(p), w[t][1] = code_bytes<1>(p), w[t][2] = code_bytes<2>(p), w[t][3] = code_bytes<3>(p);
      w[t][4] = code_bytes<4>(p), w[t][5] = code_bytes<5>(p), w[t][6] = code_bytes<6>(p), w[t][7] = code_bytes<7>(p);
    } else {
      w[t][0] = code_nibbles<BITS, 0>(p), w[t][1] = code_nibbles<BITS, 1>(p);
      w[t][2] = code_nibbles<BITS, 2>(p), w[t][3] = code_nibbles<BITS, 3>(p);
    }
  }
  constexpr int CH = MT * NG >= 4 ? 1 : 2;  // two chains per accumulator when there are few: FMA latency
  __m512 chain[CH][MT][NG];
  for (int c = 0; c < CH; ++c)
    for (int m = 0; m < MT; ++m)
      for (int t = 0; t < NG; ++t) chain[c][m][t] = _mm512_setzero_ps();
  const float* xb = in.x + m0 * a.K + kb * BLOCK;
#pragma GCC unroll 8
  for (int i = 0; i < FIELDS; ++i) {
#pragma GCC unroll 8
    for (int k = 0; k < WORDS; ++k) {
      __m512 v[NG];
      for (int t = 0; t < NG; ++t) {
        const __m512i index = _mm512_srli_epi32(w[t][k], FIELD_BITS * i);
        v[t] = BITS == 5 ? _mm512_permutex2var_ps(in.cb16, index, in.cb_hi) : _mm512_permutexvar_ps(index, in.cb16);
      }
      for (int m = 0; m < MT; ++m) {
        const __m512 xv = _mm512_set1_ps(xb[m * a.K + WORDS * i + k]);
        for (int t = 0; t < NG; ++t) chain[k % CH][m][t] = _mm512_fmadd_ps(xv, v[t], chain[k % CH][m][t]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int t = 0; t < NG; ++t)
      part[m][t] = CH == 2 ? _mm512_add_ps(chain[0][m][t], chain[CH - 1][m][t]) : chain[0][m][t];
}

// K=2, one activation row: the table of every activation pair, T[q][i] with i = a0 | a1 << 1 | b0 << 2 | b1 << 3
// (a: plane-0 bits, b: plane-1 bits of weights 2q and 2q+1), so that the index is a select of the two planes.
at::Tensor pair_tables(const float* x, int64_t K, const float* cb) {
  at::Tensor out = at::empty({K / 2, L}, at::kFloat);
  alignas(64) float first[L], second[L];
  for (int i = 0; i < L; ++i) {
    first[i] = cb[(i & 1) | ((i >> 2) & 1) << 1];
    second[i] = cb[((i >> 1) & 1) | ((i >> 3) & 1) << 1];
  }
  const __m512 a = _mm512_load_ps(first), b = _mm512_load_ps(second);
  float* t = out.data_ptr<float>();
  for (int64_t q = 0; q < K / 2; ++q)
    _mm512_storeu_ps(t + q * L, _mm512_fmadd_ps(_mm512_set1_ps(x[2 * q + 1]), b, _mm512_mul_ps(_mm512_set1_ps(x[2 * q]), a)));
  return out;
}

// Block kb's partial sums by pair-table lookups (K=2, one activation row): one per two weights and lane group.
template <int NG>
inline void pair_block(const Inputs& in, const Group<2>* g, int64_t kb, __m512 (&part)[1][NG]) {
  __m512i even[NG], odd[NG];  // nibble k: the index of pair 2k, 2k+1 (weights 4k, 4k+1 and 4k+2, 4k+3)
  for (int t = 0; t < NG; ++t) {
    const __m512i* p = g[t].words + (kb % SPAN) * 2;
    even[t] = select(0x33333333u, p[0], _mm512_slli_epi32(p[1], 2));
    odd[t] = select(0x33333333u, _mm512_srli_epi32(p[0], 2), p[1]);
  }
  for (int t = 0; t < NG; ++t) part[0][t] = _mm512_setzero_ps();
  const float* tb = in.tables + kb * (BLOCK / 2) * L;
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    const __m512 te = _mm512_loadu_ps(tb + 2 * k * L), to = _mm512_loadu_ps(tb + (2 * k + 1) * L);
    for (int t = 0; t < NG; ++t) {
      const __m512 e = _mm512_permutexvar_ps(_mm512_srli_epi32(even[t], 4 * k), te);
      const __m512 o = _mm512_permutexvar_ps(_mm512_srli_epi32(odd[t], 4 * k), to);
      part[0][t] = _mm512_add_ps(part[0][t], _mm512_add_ps(e, o));
    }
  }
}

// Every K (codebook) or K=2 (pair tables): y[m0 .. m0+MT, rows of NG lane groups] = x . W^T, span by span; per
// block, each lane group's partial sums times its block scales.
template <int BITS, int MT, int NG, bool PAIRS>
void tile(const GemmArgs& a, const Inputs& in, int64_t m0, int64_t n0) {
  const int64_t blocks = a.K / BLOCK;
  Group<BITS> g[NG];
  __m512 acc[MT][NG];
  for (int t = 0; t < NG; ++t) {
    g[t].start(a, n0 + t * L);
    for (int m = 0; m < MT; ++m) acc[m][t] = _mm512_setzero_ps();
  }
  for (int64_t kb0 = 0; kb0 < blocks; kb0 += SPAN) {
    for (int t = 0; t < NG; ++t) g[t].load(kb0, in.tensor_scale, NG);
    for (int64_t kb = kb0; kb < std::min<int64_t>(kb0 + SPAN, blocks); ++kb) {
      __m512 part[MT][NG];
      if constexpr (PAIRS) pair_block<NG>(in, g, kb, part);
      else codebook_block<BITS, MT, NG>(a, in, g, m0, kb, part);
      for (int t = 0; t < NG; ++t)
        for (int m = 0; m < MT; ++m) acc[m][t] = _mm512_fmadd_ps(part[m][t], g[t].scales[kb - kb0], acc[m][t]);
    }
  }
  for (int t = 0; t < NG; ++t)
    for (int m = 0; m < MT; ++m) {
      __m512 y = acc[m][t];
      const __mmask16 lanes = g[t].lanes();
      if (a.bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(lanes, a.bias + n0 + t * L));
      _mm512_mask_storeu_ps(a.y + (m0 + m) * a.N + n0 + t * L, lanes, y);
    }
}

// Rows n0 .. n1 (lane groups; the last may be partial) for every activation row, in chunks of up to 8 activation rows.
template <int BITS, int MT, int NG, bool PAIRS>
void groups_of(const GemmArgs& a, const Inputs& in, int64_t m0, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NG * L <= n1; n += NG * L) tile<BITS, MT, NG, PAIRS>(a, in, m0, n);
  for (; n < n1; n += L) tile<BITS, MT, 1, PAIRS>(a, in, m0, n);
}

// Lane groups per tile: with one activation row, several (independent chains for the adds' and FMAs' latency; the
// pair lookups have registers for 4, the codebook's nibble words for 2).
template <int BITS, int MT>
void groups(const GemmArgs& a, const Inputs& in, int64_t m0, int64_t n0, int64_t n1) {
  if constexpr (BITS == 2 && MT == 1)
    if (in.tables) return groups_of<BITS, MT, 4, true>(a, in, m0, n0, n1);
  groups_of<BITS, MT, MT == 1 ? 2 : 1, false>(a, in, m0, n0, n1);
}

template <int BITS>
void rows(const GemmArgs& a, const Inputs& in, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0, mt; m0 < a.M; m0 += mt) {
    mt = a.M - m0 >= 8 ? 8 : a.M - m0 >= 4 ? 4 : a.M - m0 >= 2 ? 2 : 1;
    switch (mt) {
      case 8: groups<BITS, 8>(a, in, m0, n0, n1); break;
      case 4: groups<BITS, 4>(a, in, m0, n0, n1); break;
      case 2: groups<BITS, 2>(a, in, m0, n0, n1); break;
      default: groups<BITS, 1>(a, in, m0, n0, n1);
    }
  }
}

}  // namespace row_lanes
#endif

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

// Activation rows from which a dequantized weight and the BLAS GEMM beat the fused loop. The loop redoes its lookups
// every few rows but multiplies at about BLAS's float32 rate; dequantizing first writes 4 bytes a weight, which costs
// as much as hundreds of rows of those lookups (docs/PERFORMANCE.md, CPU).
constexpr int64_t BLAS_ROWS = 1024;

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
  // Every output row goes through the row-lane kernels where there are (AVX-512), else through the tiles
  // above, which read the activations as panels.
#if defined(__AVX512F__)
  constexpr bool row_lane_kernels = true;
  alignas(64) float cb16[16];
  for (int i = 0; i < 16; ++i) cb16[i] = cb32[i % (1 << bits)];
  // Pair tables pay off for one activation row; with more, one codebook lookup serves them all.
  const at::Tensor tables = bits == 2 && M == 1 ? row_lanes::pair_tables(xf.data_ptr<float>(), K, cb32) : at::Tensor();
  const row_lanes::Inputs in{xf.data_ptr<float>(), tables.defined() ? tables.data_ptr<float>() : nullptr,
                             _mm512_load_ps(cb16), _mm512_load_ps(cb32 + 16), _mm512_set1_ps(s)};
#else
  constexpr bool row_lane_kernels = false;
  const BlockScales bs(s);
#endif
  const at::Tensor panels = row_lane_kernels ? xf : panel_of(xf);
  GemmArgs a{panels.data_ptr<float>(), reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()),
             absmax.data_ptr<uint8_t>(), bias ? bf.data_ptr<float>() : nullptr, y.data_ptr<float>(), M, N, K};
  // At least 2^19 weights (~0.1 ms) per thread: a small layer runs on the calling thread, where waking the pool
  // would cost more than it saves (on a machine shared with other work, a descheduled thread stalls the barrier).
  // Threads take units of 16 rows, lane groups.
  constexpr int64_t UNIT = 16;
  const int64_t grain = std::max<int64_t>(1, (1 << 19) / K / UNIT);
  with_bits(bits, [&](auto B) {
    constexpr int BITS = decltype(B)::value;
    at::parallel_for(0, (N + UNIT - 1) / UNIT, grain, [&](int64_t u0, int64_t u1) {
      const int64_t n0 = u0 * UNIT, n1 = std::min(u1 * UNIT, N);
#if defined(__AVX512F__)
      row_lanes::rows<BITS>(a, in, n0, n1);
#else
      gemm_rows<BITS>(a, Simd::Codebook(cb32), bs, n0, n1);
#endif
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

// ----------------------------------------------------------------------------- unrepack
// GEMM layout -> storage format, bit for bit as kbit.layout.unrepack_reference (kbit/layout.py describes the layout:
// 16-row tiles, k-groups of 256 columns, per lane a string of 128 * bits bits holding pairs of codes).
constexpr int LAYOUT_TILE_ROWS = 16, LAYOUT_TILES = 16, LAYOUT_K_GROUP = 256, LAYOUT_LANES = 32, LAYOUT_PAIRS = 64;

// String bit of bit n of pair P's index (layout.pair_bit_offsets).
int pair_bit_offset(int bits, int P, int n) {
  if (bits != 3) return 2 * bits * P + n;
  const int u = P / 16, s = P / 4 % 4, i = P % 4;
  return s < 3 ? 96 * u + 32 * s + 8 * i + n : 96 * u + 32 * (n / 2) + 8 * i + 6 + n % 2;
}

std::tuple<at::Tensor, at::Tensor> unrepack(const at::Tensor& b_gemm, const at::Tensor& absmax_gemm, int64_t bits,
                                            int64_t out_features, int64_t in_features_padded) {
  const int64_t N = out_features, K = in_features_padded, blocks = K / BLOCK, k = bits;
  const int64_t nb = b_gemm.size(0), kg = b_gemm.size(1);
  at::Tensor packed = at::zeros({N * blocks * k}, b_gemm.options());
  at::Tensor absmax = at::empty({N * blocks}, absmax_gemm.options());
  const at::Tensor bc = b_gemm.contiguous(), ac = absmax_gemm.contiguous();
  const uint32_t* words = reinterpret_cast<const uint32_t*>(bc.data_ptr<int32_t>());
  const uint8_t* codes = ac.data_ptr<uint8_t>();
  uint32_t* planes = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  uint8_t* am = absmax.data_ptr<uint8_t>();
  int offset[LAYOUT_PAIRS][10];
  for (int P = 0; P < LAYOUT_PAIRS; ++P)
    for (int n = 0; n < 2 * k; ++n) offset[P][n] = pair_bit_offset(static_cast<int>(k), P, n);
  // Threads take 16-row tiles (each writes only its own rows).
  at::parallel_for(0, nb * LAYOUT_TILES, 1, [&](int64_t T0, int64_t T1) {
    for (int64_t T = T0; T < T1; ++T) {
      const int64_t bi = T / LAYOUT_TILES, i = T % LAYOUT_TILES;
      for (int64_t j = 0; j < kg; ++j) {
        const int64_t tile = (bi * kg + j) * LAYOUT_TILES + i;  // [block, kgroup, i]
        for (int l = 0; l < LAYOUT_LANES; ++l) {
          const int g = l / 4, q = l % 4;
          auto bit = [&](int o) {  // string bit o: vec o / 128, word (o % 128) / 32, bit o % 32
            return (words[((tile * k + o / 128) * LAYOUT_LANES + l) * 4 + (o % 128) / 32] >> (o % 32)) & 1u;
          };
          for (int P = 0; P < LAYOUT_PAIRS; ++P) {
            const int t = P / 8, p = P / 2 % 4, r = P % 2;
            const int64_t row = T * LAYOUT_TILE_ROWS + g + 8 * r;
            for (int e = 0; e < 2; ++e) {
              const int64_t col = j * LAYOUT_K_GROUP + 32 * t + 8 * p + 2 * q + e;
              if (row >= N || col >= K) continue;
              uint32_t* block_planes = planes + (row * blocks + col / BLOCK) * k;
              for (int b = 0; b < k; ++b) block_planes[b] |= bit(offset[P][e * k + b]) << (col % BLOCK);
            }
          }
        }
        for (int r = 0; r < 2; ++r)  // absmax_gemm [block, kgroup, i, r, g, t]
          for (int g = 0; g < 8; ++g)
            for (int t = 0; t < 8; ++t) {
              const int64_t row = T * LAYOUT_TILE_ROWS + g + 8 * r, block = j * 8 + t;
              if (row < N && block < blocks) am[row * blocks + block] = codes[((tile * 2 + r) * 8 + g) * 8 + t];
            }
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
  m.def("unrepack(Tensor b_gemm, Tensor absmax_gemm, int bits, int out_features, int in_features_padded) -> "
        "(Tensor, Tensor)");
  m.def("isa() -> str", &isa);
  m.impl("gemm", c10::DispatchKey::CPU, &gemm);
  m.impl("dequantize", c10::DispatchKey::CPU, &dequantize);
  m.impl("quantize", c10::DispatchKey::CPU, &quantize);
  m.impl("unrepack", c10::DispatchKey::CPU, &unrepack);
}
