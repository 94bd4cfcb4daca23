// Storage-format kernels: quantize and dequantize (kbit/formats.py is their reference).
//
// Thread mapping, both kernels: a quad of 4 lanes owns one block of 32 elements, lane q of the quad
// owns 8 of them (8q .. 8q+7; dequantize to fp32 uses another split, see elem_in_block), so every lane
// moves 16 bytes of fp16 in one vector access and a warp covers 8 blocks. The seeds' one-element-per-lane
// mapping needs a 2-byte access per lane.
#include "common.cuh"

namespace kbit {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerThread = 4;
constexpr int kBlocksPerCta = kThreads / 4 * kBlocksPerThread;

// Dequantize's code extraction. Bits 0..3 of x (one bit-plane's bits of four values) go to bits 0, 8, 16
// and 24 by one multiply: 0x00204081 puts bit i at i + 7j (j = 0..3), only j = i lands on a multiple of 8,
// and no two products share a bit position, so nothing carries. Shifted by s, the multiplier and mask put
// the bits at 8i + s instead. OR-ing plane b in at s = b + 2 builds four bytes of 4 * code, the codebook's
// byte offsets, so each value then costs one PRMT to reach its table entry (the nibble spread this replaced
// needed three more instructions per value, six at BITS = 5).
// `shift` is a constant once the caller's loop unrolls.
__device__ __forceinline__ uint32_t spread_to_bytes(uint32_t four_bits, int shift) {
  return (four_bits * (0x00204081u << shift)) & (0x01010101u << shift);
}

// Loads 8 consecutive elements starting at e0 as float. kChecked: zeros past n, scalar loads when the
// vector access is not allowed; unchecked callers guarantee a whole, aligned vector.
template <bool kChecked, typename T>
__device__ __forceinline__ void load8(const T* x, int64_t e0, int64_t n, bool vec, float (&v)[8]) {
  if (!kChecked || (vec && e0 + 8 <= n)) {
    if constexpr (sizeof(T) == 2) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + e0);
      const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = to_float(h[i]);
    } else {
      const float4 a = *reinterpret_cast<const float4*>(x + e0);
      const float4 b = *reinterpret_cast<const float4*>(x + e0 + 4);
      v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = e0 + i < n ? to_float(x[e0 + i]) : 0.0f;
  }
}

// Dequantize's element mapping inside a block: lane q's value i is element elem_in_block<T>(q, i). 16-bit
// outputs: elements 8q .. 8q+7 (one 16-byte store per lane, 64 contiguous bytes per quad). fp32: elements
// 4q .. 4q+3 and 16+4q .. 16+4q+3, so each of the two 16-byte stores of a quad covers 64 contiguous bytes
// (with 8q .. 8q+7 each store wrote every other 16 bytes and dequantize to fp32 ran at ~60% of copy speed).
template <typename T>
__device__ __forceinline__ int elem_in_block(int q, int i) {
  return sizeof(T) == 2 ? 8 * q + i : (i < 4 ? 4 * q + i : 12 + 4 * q + i);
}

// This lane's 8 bits of the bit-plane word at `word` (bit i = the code bit of its value i): byte q
// (little-endian) for 16-bit outputs, nibbles q and 4 + q for fp32.
template <typename T>
__device__ __forceinline__ uint32_t load_lane_bits(const uint32_t* word, int q) {
  if constexpr (sizeof(T) == 2) {
    return __ldg(reinterpret_cast<const uint8_t*>(word) + q);
  } else {
    const uint32_t w = __ldg(word);
    return ((w >> (4 * q)) & 0xFu) | ((w >> (12 + 4 * q)) & 0xF0u);
  }
}

// 16-byte global store. Through PTX so that it stays one vector store: written as a uint4 assignment, the
// compiler split the first block's store into four 4-byte stores (dequantize lost ~15% of its bandwidth).
__device__ __forceinline__ void store16(void* p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

template <bool kChecked, typename T>
__device__ __forceinline__ void store_lane(T* out, int64_t b0, int q, int64_t n, bool vec, const float (&v)[8]) {
  if (!kChecked || (vec && b0 + kBlock <= n)) {
    if constexpr (sizeof(T) == 2) {
      store16(out + b0 + 8 * q, pack_pair<T>(v[0], v[1]), pack_pair<T>(v[2], v[3]), pack_pair<T>(v[4], v[5]),
              pack_pair<T>(v[6], v[7]));
    } else {
      store16(out + b0 + 4 * q, __float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
              __float_as_uint(v[3]));
      store16(out + b0 + 16 + 4 * q, __float_as_uint(v[4]), __float_as_uint(v[5]), __float_as_uint(v[6]),
              __float_as_uint(v[7]));
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int64_t e = b0 + elem_in_block<T>(q, i);
      if (e < n) out[e] = from_float<T>(v[i]);
    }
  }
}

// One level of quantize's binary search: if u > mid, add `step` to the midpoint offset (if advance) and set
// `bit` in the bit-plane byte. Predicated adds: the compiler's select-then-add form cost a fifth more issues.
// `advance` is a constant once the caller's loop unrolls.
__device__ __forceinline__ void search_level(float u, float mid, bool advance, uint32_t step, uint32_t bit,
                                             uint32_t& at, uint32_t& plane) {
  if (advance)
    asm("{\n\t.reg .pred p;\n\tsetp.gt.f32 p, %2, %3;\n\t@p add.u32 %0, %0, %4;\n\t@p or.b32 %1, %1, %5;\n\t}"
        : "+r"(at), "+r"(plane) : "f"(u), "f"(mid), "r"(step), "r"(bit));
  else
    asm("{\n\t.reg .pred p;\n\tsetp.gt.f32 p, %1, %2;\n\t@p or.b32 %0, %0, %3;\n\t}"
        : "+r"(plane) : "f"(u), "f"(mid), "r"(bit));
}

// True when every block of this CTA lies wholly inside n elements and vector access is allowed: the CTA
// then takes the unchecked path (one decision per CTA, so __syncthreads inside either path is safe).
__device__ __forceinline__ bool cta_is_whole(int64_t n, bool vec) {
  return vec && (static_cast<int64_t>(blockIdx.x) + 1) * kBlocksPerCta * kBlock <= n;
}

// Both kernels give each thread kBlocksPerThread blocks, kThreads / 4 blocks apart (so every access of the
// warp stays coalesced), and issue all of a thread's global loads before any arithmetic: a single block per
// thread left too few bytes in flight to cover DRAM latency (quantize reached 30-42% of copy bandwidth,
// dequantize 57-69%).
template <typename T, int BITS>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const T* __restrict__ x, int64_t n, bool vec,
                                                            const float* __restrict__ codebook,
                                                            const float* __restrict__ scale,
                                                            uint32_t* __restrict__ packed,
                                                            uint8_t* __restrict__ absmax) {
  const int64_t nb = (n + kBlock - 1) / kBlock;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kBlocksPerCta + (threadIdx.x >> 2);
  const int q = threadIdx.x & 3;

  // The input first, the tables second: building the tables before issuing the loads put a second global
  // round trip (the codebook) in front of every CTA's data.
  float v[kBlocksPerThread][8];
  if (cta_is_whole(n, vec)) {
#pragma unroll
    for (int j = 0; j < kBlocksPerThread; ++j) load8<false>(x, (first + j * (kThreads / 4)) * kBlock + q * 8, n, vec, v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < kBlocksPerThread; ++j) {
      const int64_t block = first + j * (kThreads / 4);
      load8<true>(x, block * kBlock + q * 8, block < nb ? n : 0, vec, v[j]);
    }
  }
  // Midpoints between adjacent codebook entries: the code is the number of midpoints below v.
  __shared__ float mids[(1 << BITS) - 1];
  __shared__ float inv_dec[256];  // 1 / decode_e4m4(code), 0 for code 0: a lookup instead of a division
  if (threadIdx.x < (1 << BITS) - 1)
    mids[threadIdx.x] = __fmul_rn(__fadd_rn(codebook[threadIdx.x], codebook[threadIdx.x + 1]), 0.5f);
  static_assert(kThreads >= 256, "one thread per E4M4 code");
  inv_dec[threadIdx.x] = threadIdx.x ? __frcp_rn(decode_e4m4(threadIdx.x)) : 0.0f;
  __syncthreads();
  const float inv_scale = __frcp_rn(*scale);
  const uint8_t* mids_bytes = reinterpret_cast<const uint8_t*>(mids);
  const float top_mid = mids[(1 << (BITS - 1)) - 1];
#pragma unroll
  for (int j = 0; j < kBlocksPerThread; ++j) {
    const int64_t block = first + j * (kThreads / 4);
    // Every lane runs the shuffles (out-of-range blocks hold zeros), so the full mask is always valid.
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[j][i] = __fmul_rn(v[j][i], inv_scale);
      m = fmaxf(m, fabsf(v[j][i]));
    }
    m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 2));
    const uint32_t code = encode_e4m4(m);
    const float r = inv_dec[code];

    // Binary search over the midpoints, branch-free. The comparison at step 2^b decides bit b of the code, so
    // it advances the midpoint offset by 2^b and sets bit i of this lane's byte of bit-plane b.
    uint32_t planes[BITS] = {};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float u = __fmul_rn(v[j][i], r);
      uint32_t at = 0;  // byte offset of the midpoint to compare with: 4 * (code bits decided so far)
#pragma unroll
      for (int b = BITS - 1; b >= 0; --b) {
        const float mid = b == BITS - 1 ? top_mid : *reinterpret_cast<const float*>(mids_bytes + at + 4 * ((1 << b) - 1));
        search_level(u, mid, b > 0, 4u << b, 1u << i, at, planes[b]);
      }
    }
    if (block >= nb) continue;
    // Lane q owns byte q of every bit-plane word (little-endian): byte stores, no shuffles.
    uint8_t* out = reinterpret_cast<uint8_t*>(packed + block * BITS) + q;
#pragma unroll
    for (int b = 0; b < BITS; ++b) out[4 * b] = static_cast<uint8_t>(planes[b]);
    if (q == 0) absmax[block] = static_cast<uint8_t>(code);
  }
}

// One thread's blocks of dequantize. kChecked: some block may be past the end or partial (the last CTA), so
// loads and stores are bounds-checked; otherwise every address is the thread's base plus a constant.
// The codebook goes to shared memory (cb) only after the data loads are issued, so its global round trip
// overlaps theirs instead of preceding them.
template <bool kChecked, typename T, int BITS>
__device__ __forceinline__ void dequantize_blocks(const uint32_t* __restrict__ packed,
                                                  const uint8_t* __restrict__ absmax,
                                                  const float* __restrict__ codebook, float* cb,
                                                  const float* __restrict__ scale, int64_t first, int q,
                                                  int64_t n, bool vec, T* __restrict__ out) {
  const int64_t nb = (n + kBlock - 1) / kBlock;
  const uint32_t* words = packed + first * BITS;
  uint32_t bits[kBlocksPerThread][BITS], code[kBlocksPerThread];
#pragma unroll
  for (int j = 0; j < kBlocksPerThread; ++j) {
    const bool ok = !kChecked || first + j * (kThreads / 4) < nb;
#pragma unroll
    for (int b = 0; b < BITS; ++b) bits[j][b] = ok ? load_lane_bits<T>(words + j * (kThreads / 4) * BITS + b, q) : 0u;
    code[j] = ok ? __ldg(absmax + first + j * (kThreads / 4)) : 0u;
  }
  if (threadIdx.x < (1 << BITS)) cb[threadIdx.x] = codebook[threadIdx.x];  // entry i in bank i: no conflicts
  __syncthreads();
  const float tensor_scale = *scale;
#pragma unroll
  for (int j = 0; j < kBlocksPerThread; ++j) {
    const int64_t block = first + j * (kThreads / 4);
    if (kChecked && block >= nb) break;
    const float block_scale = __fmul_rn(decode_e4m4(code[j]), tensor_scale);
    uint32_t offsets[2] = {0u, 0u};  // byte i of offsets[h]: 4 * code of value 4h + i
#pragma unroll
    for (int b = 0; b < BITS; ++b) {
      const uint32_t x = bits[j][b];
      offsets[0] |= spread_to_bytes(x & 15u, 2 + b);
      offsets[1] |= spread_to_bytes(x >> 4, 2 + b);
    }
    const uint8_t* cb_bytes = reinterpret_cast<const uint8_t*>(cb);
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t at = __byte_perm(offsets[i / 4], 0u, 0x4440u | (i % 4));
      v[i] = __fmul_rn(*reinterpret_cast<const float*>(cb_bytes + at), block_scale);
    }
    store_lane<kChecked>(out, block * kBlock, q, n, vec, v);
  }
}

template <typename T, int BITS>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const uint32_t* __restrict__ packed,
                                                              const uint8_t* __restrict__ absmax,
                                                              const float* __restrict__ codebook,
                                                              const float* __restrict__ scale, int64_t n,
                                                              bool vec, T* __restrict__ out) {
  __shared__ float cb[1 << BITS];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kBlocksPerCta + (threadIdx.x >> 2);
  const int q = threadIdx.x & 3;
  if (cta_is_whole(n, vec))
    dequantize_blocks<false, T, BITS>(packed, absmax, codebook, cb, scale, first, q, n, vec, out);
  else
    dequantize_blocks<true, T, BITS>(packed, absmax, codebook, cb, scale, first, q, n, vec, out);
}

int64_t grid_for(int64_t n) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  return (blocks + kBlocksPerCta - 1) / kBlocksPerCta;
}

template <template <typename, int> class Fn, typename... Args>
cudaError_t dispatch(DType dtype, int k, Args&&... args) {
  auto for_type = [&](auto type) {
    using T = typename decltype(type)::type;
    return with_bits(k, cudaErrorInvalidValue, [&](auto bits) { return Fn<T, decltype(bits)::value>::run(args...); });
  };
  switch (dtype) {
    case DType::F16: return for_type(std::common_type<__half>{});
    case DType::BF16: return for_type(std::common_type<__nv_bfloat16>{});
    case DType::F32: return for_type(std::common_type<float>{});
  }
  return cudaErrorInvalidValue;
}

template <typename T, int BITS>
struct QuantizeLaunch {
  static cudaError_t run(const void* x, int64_t n, const float* codebook, const float* scale, uint32_t* packed,
                         uint8_t* absmax, cudaStream_t stream) {
    const bool vec = reinterpret_cast<uintptr_t>(x) % 16 == 0;
    quantize_kernel<T, BITS><<<grid_for(n), kThreads, 0, stream>>>(static_cast<const T*>(x), n, vec, codebook, scale,
                                                                 packed, absmax);
    return cudaGetLastError();
  }
};

template <typename T, int BITS>
struct DequantizeLaunch {
  static cudaError_t run(const uint32_t* packed, const uint8_t* absmax, const float* codebook, const float* scale,
                         int64_t n, void* out, cudaStream_t stream) {
    const bool vec = reinterpret_cast<uintptr_t>(out) % 16 == 0;
    dequantize_kernel<T, BITS><<<grid_for(n), kThreads, 0, stream>>>(packed, absmax, codebook, scale, n, vec,
                                                                   static_cast<T*>(out));
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t quantize(const void* x, DType x_dtype, int64_t n, const float* codebook, int k, const float* scale,
                     uint32_t* packed, uint8_t* absmax, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch<QuantizeLaunch>(x_dtype, k, x, n, codebook, scale, packed, absmax, stream);
}

cudaError_t dequantize(const uint32_t* packed, const uint8_t* absmax, const float* codebook, int k,
                       const float* scale, int64_t n, void* out, DType out_dtype, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch<DequantizeLaunch>(out_dtype, k, packed, absmax, codebook, scale, n, out, stream);
}

}  // namespace kbit
