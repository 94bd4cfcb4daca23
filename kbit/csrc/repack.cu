// Storage format <-> GEMM layout (kbit/layout.py documents the layout; repack_reference and unrepack_reference are
// the references). repack runs once per weight at load time; unrepack when the storage format of a layer that keeps
// only the GEMM layout is asked for (saving, moving off the GPU, dequantizing). One thread handles one lane's bit
// string for one (tile, k-group): 16 runs of 8 codes (four column pairs), each cut from one storage block, every bit
// at the offset the fused kernel reads it from (pair_bit_offset).
#include "common.cuh"

namespace kbit {
namespace {

constexpr int kThreads = 256;

// What one thread handles: a lane (g = lane / 4 row pair, q = lane % 4 column quad) of one (16-row tile, k-group).
// The kernels unpack it by structured binding, in the members' order.
struct LaneOfPiece {
  int lane, g, q, j, tile;
  int64_t piece;
  __device__ LaneOfPiece(int64_t idx, int k_groups) {
    lane = static_cast<int>(idx & 31), g = lane >> 2, q = lane & 3;
    const int64_t tj = idx >> 5;  // tile * k_groups + kgroup
    j = static_cast<int>(tj % k_groups), tile = static_cast<int>(tj / k_groups);
    piece = layout_piece(tile, j, k_groups);
  }
};

// A lane's bit string of one (tile, k-group): its BITS vectors of 16 bytes.
template <int BITS>
__device__ __forceinline__ void load_lane_string(const uint4* __restrict__ b_gemm, int64_t piece, int lane,
                                                 uint32_t (&words)[4 * BITS]) {
#pragma unroll
  for (int v = 0; v < BITS; ++v) {
    const uint4 w = b_gemm[(piece * BITS + v) * 32 + lane];
    words[4 * v] = w.x, words[4 * v + 1] = w.y, words[4 * v + 2] = w.z, words[4 * v + 3] = w.w;
  }
}

template <int BITS>
__global__ void __launch_bounds__(kThreads) repack_kernel(const uint32_t* __restrict__ packed,
                                                          const uint8_t* __restrict__ absmax, int N, int K_w,
                                                          int k_groups, int64_t total_threads,
                                                          uint4* __restrict__ b_gemm, uint8_t* __restrict__ a_gemm) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= total_threads) return;
  const auto [lane, g, q, j, tile, piece] = LaneOfPiece(idx, k_groups);
  const int blocks_per_row = K_w / kBlock;

  uint32_t words[4 * BITS];
#pragma unroll
  for (int i = 0; i < 4 * BITS; ++i) words[i] = 0;
#pragma unroll
  for (int t = 0; t < 8; ++t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * tile + g + 8 * r, kb = 8 * j + t;
      const bool inside = row < N && kb < blocks_per_row;
      const int64_t blk = static_cast<int64_t>(row) * blocks_per_row + kb;
      uint32_t planes[BITS];
#pragma unroll
      for (int b = 0; b < BITS; ++b) planes[b] = inside ? packed[blk * BITS + b] >> (2 * q) : 0u;
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        const int pair = 8 * t + 2 * (s >> 1) + r, e = s & 1;  // column 8p + 2q + e
#pragma unroll
        for (int b = 0; b < BITS; ++b) {
          const int o = pair_bit_offset(BITS, pair, e * BITS + b);
          words[o >> 5] |= ((planes[b] >> (8 * (s >> 1) + e)) & 1u) << (o & 31);
        }
      }
      if (q == 0) a_gemm[((piece * 2 + r) * 8 + g) * 8 + t] = inside ? absmax[blk] : 0;
    }
  }
#pragma unroll
  for (int v = 0; v < BITS; ++v)
    b_gemm[(piece * BITS + v) * 32 + lane] = make_uint4(words[4 * v], words[4 * v + 1], words[4 * v + 2], words[4 * v + 3]);
}

// The inverse: the 8 bits a lane holds of each plane word of a storage block are ORed across the block's four lanes
// (q = 0..3, adjacent in the warp) by two shuffles; lane q = 0 writes the word. Padding rows and k-groups are
// dropped. Every thread count is a multiple of 32 and warps never straddle it, so whole warps return together.
template <int BITS>
__global__ void __launch_bounds__(kThreads) unrepack_kernel(const uint4* __restrict__ b_gemm,
                                                            const uint8_t* __restrict__ a_gemm, int N, int K_w,
                                                            int k_groups, int64_t total_threads,
                                                            uint32_t* __restrict__ packed, uint8_t* __restrict__ absmax) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= total_threads) return;
  const auto [lane, g, q, j, tile, piece] = LaneOfPiece(idx, k_groups);
  const int blocks_per_row = K_w / kBlock;

  uint32_t words[4 * BITS];
  load_lane_string<BITS>(b_gemm, piece, lane, words);
#pragma unroll
  for (int t = 0; t < 8; ++t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = 16 * tile + g + 8 * r, kb = 8 * j + t;
      const bool inside = row < N && kb < blocks_per_row;
      const int64_t blk = static_cast<int64_t>(row) * blocks_per_row + kb;
#pragma unroll
      for (int b = 0; b < BITS; ++b) {
        uint32_t plane = 0;
#pragma unroll
        for (int s = 0; s < 8; ++s) {
          const int pair = 8 * t + 2 * (s >> 1) + r, e = s & 1;
          const int o = pair_bit_offset(BITS, pair, e * BITS + b);
          plane |= ((words[o >> 5] >> (o & 31)) & 1u) << (8 * (s >> 1) + e + 2 * q);
        }
        plane |= __shfl_xor_sync(0xffffffffu, plane, 1);
        plane |= __shfl_xor_sync(0xffffffffu, plane, 2);
        if (inside && q == 0) packed[blk * BITS + b] = plane;
      }
      if (inside && q == 0) absmax[blk] = a_gemm[((piece * 2 + r) * 8 + g) * 8 + t];
    }
  }
}

// Code e of pair `pair` in a lane's bit string: bits e * BITS .. e * BITS + BITS - 1 of the pair's 2k-bit index.
// At BITS = 2, 4, 5 the pairs lie back to back (one shift, or a funnel shift across two words, and a mask); at 3 the
// pair is the low 6 bits of byte pair % 4 of byte_pair_word's word. pair and e are constants once the loops unroll.
template <int BITS>
__device__ __forceinline__ uint32_t pair_code(const uint32_t (&words)[4 * BITS], int pair, int e) {
  constexpr uint32_t kMask = (1u << BITS) - 1u;
  if constexpr (BITS == 3) {
    return byte_pair_word<BITS>(words, pair) >> (8 * (pair % 4) + e * BITS) & kMask;
  } else {
    const int o = 2 * BITS * pair + e * BITS, w = o >> 5, s = o & 31;
    return (s + BITS <= 32 ? words[w] >> s : __funnelshift_r(words[w], words[w + 1], s)) & kMask;
  }
}

// The dense [N, K_w] weight straight from the GEMM layout, the values dequantize gives from the storage the layout
// holds (unrepack): codebook[code] * (decode_e4m4(absmax) * *scale), rounded once to T. One thread per lane's bit
// string, as unrepack: its 16 runs of 8 codes are row g + 8r, columns 32t + 8p + 2q + e of the (tile, k-group), each
// column pair one 2-element store (a quad's four lanes: 8 consecutive columns).
template <typename T, int BITS>
__global__ void __launch_bounds__(kThreads) dequantize_layout_kernel(const uint4* __restrict__ b_gemm,
                                                                     const uint8_t* __restrict__ a_gemm,
                                                                     const float* __restrict__ codebook,
                                                                     const float* __restrict__ scale, int N, int K_w,
                                                                     int k_groups, int64_t total_threads,
                                                                     T* __restrict__ out) {
  __shared__ float cb[1 << BITS];
  if (threadIdx.x < (1 << BITS)) cb[threadIdx.x] = codebook[threadIdx.x];
  __syncthreads();
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= total_threads) return;
  const auto [lane, g, q, j, tile, piece] = LaneOfPiece(idx, k_groups);
  const int blocks_per_row = K_w / kBlock;
  const float tensor_scale = *scale;

  uint32_t words[4 * BITS];
  load_lane_string<BITS>(b_gemm, piece, lane, words);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = 16 * tile + g + 8 * r;
    if (row >= N) continue;
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const int kb = 8 * j + t;
      if (kb >= blocks_per_row) continue;
      const float block_scale = __fmul_rn(decode_e4m4(a_gemm[((piece * 2 + r) * 8 + g) * 8 + t]), tensor_scale);
      T* dst = out + static_cast<int64_t>(row) * K_w + kb * kBlock + 2 * q;
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const int pair = 8 * t + 2 * p + r;
        const float lo = __fmul_rn(cb[pair_code<BITS>(words, pair, 0)], block_scale);
        const float hi = __fmul_rn(cb[pair_code<BITS>(words, pair, 1)], block_scale);
        if constexpr (sizeof(T) == 2) {
          *reinterpret_cast<uint32_t*>(dst + 8 * p) = pack_pair<T>(lo, hi);
        } else {
          *reinterpret_cast<float2*>(dst + 8 * p) = make_float2(lo, hi);
        }
      }
    }
  }
}

// One thread per (16-row tile, k-group, lane), in blocks of kThreads.
struct Grid {
  int k_groups;
  int64_t threads, blocks;
  Grid(int N, int K_w)
      : k_groups(static_cast<int>(layout_k_groups(K_w))),
        threads(layout_tiles16(N) * k_groups * 32),
        blocks((threads + kThreads - 1) / kThreads) {}
};

}  // namespace

cudaError_t repack(const uint32_t* packed, const uint8_t* absmax, int k, int N, int K_w, uint32_t* b_gemm,
                   uint8_t* absmax_gemm, cudaStream_t stream) {
  if (N <= 0 || K_w <= 0 || K_w % kBlock) return cudaErrorInvalidValue;
  const Grid grid(N, K_w);
  return with_bits(k, cudaErrorInvalidValue, [&](auto bits) {
    repack_kernel<decltype(bits)::value><<<grid.blocks, kThreads, 0, stream>>>(
        packed, absmax, N, K_w, grid.k_groups, grid.threads, reinterpret_cast<uint4*>(b_gemm), absmax_gemm);
    return cudaGetLastError();
  });
}

cudaError_t unrepack(const uint32_t* b_gemm, const uint8_t* absmax_gemm, int k, int N, int K_w, uint32_t* packed,
                     uint8_t* absmax, cudaStream_t stream) {
  if (N <= 0 || K_w <= 0 || K_w % kBlock) return cudaErrorInvalidValue;
  const Grid grid(N, K_w);
  return with_bits(k, cudaErrorInvalidValue, [&](auto bits) {
    unrepack_kernel<decltype(bits)::value><<<grid.blocks, kThreads, 0, stream>>>(
        reinterpret_cast<const uint4*>(b_gemm), absmax_gemm, N, K_w, grid.k_groups, grid.threads, packed, absmax);
    return cudaGetLastError();
  });
}

cudaError_t dequantize_layout(const uint32_t* b_gemm, const uint8_t* absmax_gemm, const float* codebook, int k,
                              const float* scale, int N, int K_w, void* out, DType out_dtype, cudaStream_t stream) {
  if (N <= 0 || K_w <= 0 || K_w % kBlock) return cudaErrorInvalidValue;
  const Grid grid(N, K_w);
  auto launch = [&](auto type) {
    using T = typename decltype(type)::type;
    return with_bits(k, cudaErrorInvalidValue, [&](auto bits) {
      dequantize_layout_kernel<T, decltype(bits)::value><<<grid.blocks, kThreads, 0, stream>>>(
          reinterpret_cast<const uint4*>(b_gemm), absmax_gemm, codebook, scale, N, K_w, grid.k_groups, grid.threads,
          static_cast<T*>(out));
      return cudaGetLastError();
    });
  };
  switch (out_dtype) {
    case DType::F16: return launch(std::common_type<__half>{});
    case DType::BF16: return launch(std::common_type<__nv_bfloat16>{});
    case DType::F32: return launch(std::common_type<float>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace kbit
