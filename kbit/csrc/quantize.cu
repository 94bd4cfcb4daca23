// Storage-format kernels: quantize and dequantize (kbit/formats.py is their reference).
//
// Thread mapping, both kernels: a quad of 4 lanes owns one block of 32 elements, lane q of the quad
// owns elements 8q .. 8q+7, so every lane moves 16 bytes of fp16 in one vector access and a warp
// covers 8 blocks. The seeds' one-element-per-lane mapping needs a 2-byte access per lane.
#include "common.cuh"

namespace kbit {
namespace {

constexpr int kThreads = 256;

// Loads 8 consecutive elements starting at e0 (zeros past n) as float.
template <typename T>
__device__ __forceinline__ void load8(const T* x, int64_t e0, int64_t n, bool vec, float (&v)[8]) {
  if (vec && e0 + 8 <= n) {
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

template <typename T>
__device__ __forceinline__ void store8(T* out, int64_t e0, int64_t n, bool vec, const float (&v)[8]) {
  if (vec && e0 + 8 <= n) {
    if constexpr (sizeof(T) == 2) {
      uint4 raw;
      T* h = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int i = 0; i < 8; ++i) h[i] = from_float<T>(v[i]);
      *reinterpret_cast<uint4*>(out + e0) = raw;
    } else {
      *reinterpret_cast<float4*>(out + e0) = make_float4(v[0], v[1], v[2], v[3]);
      *reinterpret_cast<float4*>(out + e0 + 4) = make_float4(v[4], v[5], v[6], v[7]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (e0 + i < n) out[e0 + i] = from_float<T>(v[i]);
  }
}

template <typename T, int K>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const T* __restrict__ x, int64_t n, bool vec,
                                                            const float* __restrict__ codebook,
                                                            const float* __restrict__ scale,
                                                            uint32_t* __restrict__ packed,
                                                            uint8_t* __restrict__ absmax) {
  // Midpoints between adjacent codebook entries: the code is the number of midpoints below v.
  __shared__ float mids[(1 << K) - 1];
  if (threadIdx.x < (1 << K) - 1)
    mids[threadIdx.x] = __fmul_rn(__fadd_rn(codebook[threadIdx.x], codebook[threadIdx.x + 1]), 0.5f);
  __syncthreads();

  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t block = t >> 2, nb = (n + kBlock - 1) / kBlock;
  const unsigned quad_mask = __ballot_sync(0xFFFFFFFFu, block < nb);
  if (block >= nb) return;
  const int q = threadIdx.x & 3;

  float v[8];
  load8(x, block * kBlock + q * 8, n, vec, v);
  const float inv_scale = __frcp_rn(*scale);
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[i] = __fmul_rn(v[i], inv_scale);
    m = fmaxf(m, fabsf(v[i]));
  }
  m = fmaxf(m, __shfl_xor_sync(quad_mask, m, 1));
  m = fmaxf(m, __shfl_xor_sync(quad_mask, m, 2));
  const uint32_t code = encode_e4m4(m);
  const float dec = decode_e4m4(code);
  const float r = dec > 0.0f ? __frcp_rn(dec) : 0.0f;

  uint32_t planes[K];  // this lane's 8 bits of each bit-plane word, at bits 0..7
#pragma unroll
  for (int b = 0; b < K; ++b) planes[b] = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float u = __fmul_rn(v[i], r);
    int c = 0;
#pragma unroll
    for (int s = 1 << (K - 1); s; s >>= 1) c += u > mids[c + s - 1] ? s : 0;
#pragma unroll
    for (int b = 0; b < K; ++b) planes[b] |= static_cast<uint32_t>((c >> b) & 1) << i;
  }
#pragma unroll
  for (int b = 0; b < K; ++b) {
    uint32_t w = planes[b] << (8 * q);
    w |= __shfl_xor_sync(quad_mask, w, 1);
    w |= __shfl_xor_sync(quad_mask, w, 2);
    if (q == (b & 3)) packed[block * K + b] = w;
  }
  if (q == 0) absmax[block] = static_cast<uint8_t>(code);
}

template <typename T, int K>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const uint32_t* __restrict__ packed,
                                                              const uint8_t* __restrict__ absmax,
                                                              const float* __restrict__ codebook,
                                                              const float* __restrict__ scale, int64_t n,
                                                              bool vec, T* __restrict__ out) {
  __shared__ float cb[1 << K];  // entry i sits in bank i: distinct codes never conflict
  if (threadIdx.x < (1 << K)) cb[threadIdx.x] = codebook[threadIdx.x];
  __syncthreads();

  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t block = t >> 2, nb = (n + kBlock - 1) / kBlock;
  if (block >= nb) return;
  const int q = threadIdx.x & 3;

  uint32_t w[K];
#pragma unroll
  for (int b = 0; b < K; ++b) w[b] = __ldg(packed + block * K + b) >> (8 * q);
  const float block_scale = __fmul_rn(decode_e4m4(__ldg(absmax + block)), *scale);
  float v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    int c = 0;
#pragma unroll
    for (int b = 0; b < K; ++b) c |= ((w[b] >> i) & 1) << b;
    v[i] = __fmul_rn(cb[c], block_scale);
  }
  store8(out, block * kBlock + q * 8, n, vec, v);
}

int64_t grid_for(int64_t n) {
  const int64_t threads = (n + kBlock - 1) / kBlock * 4;
  return (threads + kThreads - 1) / kThreads;
}

template <template <typename, int> class Fn, typename... Args>
cudaError_t dispatch(DType dtype, int k, Args&&... args) {
#define KBIT_CASE_K(T)                                            \
  switch (k) {                                                    \
    case 2: return Fn<T, 2>::run(std::forward<Args>(args)...);    \
    case 3: return Fn<T, 3>::run(std::forward<Args>(args)...);    \
    case 4: return Fn<T, 4>::run(std::forward<Args>(args)...);    \
    case 5: return Fn<T, 5>::run(std::forward<Args>(args)...);    \
    default: return cudaErrorInvalidValue;                        \
  }
  switch (dtype) {
    case DType::F16: KBIT_CASE_K(__half)
    case DType::BF16: KBIT_CASE_K(__nv_bfloat16)
    case DType::F32: KBIT_CASE_K(float)
  }
#undef KBIT_CASE_K
  return cudaErrorInvalidValue;
}

template <typename T, int K>
struct QuantizeLaunch {
  static cudaError_t run(const void* x, int64_t n, const float* codebook, const float* scale, uint32_t* packed,
                         uint8_t* absmax, cudaStream_t stream) {
    const bool vec = reinterpret_cast<uintptr_t>(x) % 16 == 0;
    quantize_kernel<T, K><<<grid_for(n), kThreads, 0, stream>>>(static_cast<const T*>(x), n, vec, codebook, scale,
                                                                 packed, absmax);
    return cudaGetLastError();
  }
};

template <typename T, int K>
struct DequantizeLaunch {
  static cudaError_t run(const uint32_t* packed, const uint8_t* absmax, const float* codebook, const float* scale,
                         int64_t n, void* out, cudaStream_t stream) {
    const bool vec = reinterpret_cast<uintptr_t>(out) % 16 == 0;
    dequantize_kernel<T, K><<<grid_for(n), kThreads, 0, stream>>>(packed, absmax, codebook, scale, n, vec,
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
