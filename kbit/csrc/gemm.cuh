// The fused dequantize + GEMM kernel: y[M, N] = x[M, K] @ W_hat[N, K]^T, W_hat read from the GEMM layout.
//
// Reads top to bottom:
//   GemmConfig      compile-time sizes of one configuration (bits K, 8-token tiles MB)
//   pair_offset     turns one 2K-bit pair of codes of a lane's bit string into a pair-table address
//   StepCursor      a step's coordinates, advanced step by step instead of recomputed by division
//   load_step       issues the cp.async copies of one pipeline step into a shared-memory stage
//   compute_step    looks a warp's 16 x 256 weight codes up in the pair table, runs the MMAs per block of
//                   32 columns and applies each block's scale to the fp32 result
//   store_tile      writes a finished output tile (per-tensor scale, bias, dtype conversion)
//   gemm_kernel     the persistent, stream-K main loop and the split-K reduction
//
// Roles: the weights are the MMA's A operand (16 output features x 16 k), the activations its B operand
// (16 k x 8 tokens), so one m16n8k16 serves up to 8 tokens with no wasted weight work (C^T = W X^T).
// Each warp owns 16 weight rows of the CTA's tile (8 or 16 warps); the warps share a step's activations.
//
// Work: a step is (token pass, CTA row tile, 256-column k-group). The total step range is cut into
// `grid` contiguous pieces (stream-K), one per CTA, so every SM streams weights whatever the shape.
// A tile whose k-groups span several CTAs is reduced deterministically: each contributor stores its
// fp32 partial, fences, and bumps the tile's counter; the last to arrive sums all partials in CTA order.
#pragma once

#include "common.cuh"

namespace kbit {

constexpr int kKGroup = 256;              // k columns per pipeline step
constexpr int kXRowHalves = kKGroup + 32; // padded activation row in shared memory: conflict-free 16B reads
constexpr int kSmemBudget = 227 * 1024 - 1024;  // opt-in maximum per CTA on sm_90, less static smem

// Warps per CTA. Decode (MB <= 2) is bound by instruction latency, so it gets 16 warps sharing one set of
// tables; larger MB needs the registers for its accumulators and the shared memory for activations.
__host__ __device__ constexpr int gemm_warps(int mb) { return mb <= 2 ? 16 : 8; }

template <int K, int MB>
struct GemmConfig {
  static constexpr int kWarps = gemm_warps(MB);
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kTileRows = kWarps * 16;         // weight rows per CTA tile
  static constexpr int kBStage = kWarps * K * 32 * 16;  // each warp: K vectors of 16 B per lane
  static constexpr int kAbsStage = kWarps * 128;        // each warp: 16 rows x 8 blocks
  static constexpr int kXStage = MB * 8 * kXRowHalves * 2;  // MB*8 tokens x 256 k (+ padding)
  static constexpr int kStage = kBStage + kAbsStage + kXStage;
  // Pair table: entry p = (codebook[p & (2^K-1)], codebook[p >> K]) as a 16-bit pair, one copy per
  // lane (entry-major, so lane l always hits bank l), fewer copies when that would pass 32 KB (K = 5).
  static constexpr int kPairs = 1 << (2 * K);
  static constexpr int kCopies = kPairs * 32 * 4 <= 32768 ? 32 : 32768 / (kPairs * 4);
  static constexpr int kPairTable = kPairs * kCopies * 4;
  static constexpr int kScaleTable = 256 * 4;  // E4M4 code -> float
  // The tables are static shared memory (their addresses fold into the LDS instructions); the pipeline
  // stages are dynamic: as many as fit (2 to 4).
  static constexpr int kFit = (kSmemBudget - kPairTable - kScaleTable) / kStage;
  static constexpr int kStages = kFit > 4 ? 4 : kFit;
  static_assert(kStages >= 2, "configuration does not fit in shared memory");
  static constexpr int kSmem = kStages * kStage;  // dynamic part
  static constexpr int kSmemTotal = kSmem + kPairTable + kScaleTable;
  static constexpr int kPartialFloats = kWarps * MB * 32 * 4;  // one CTA's partial output tile
};

// Byte offset into the pair table of the pair at bits [o, o + 2K) of a lane's bit string (4K words):
// (pair << log2(copies * 4)) | lane_offset. o is a compile-time constant once the caller's loops unroll,
// and the table is a static shared array, so this is a shift and one LOP3 feeding LDS [reg + table].
template <int K, int kCopies>
__device__ __forceinline__ uint32_t pair_offset(const uint32_t (&w)[4 * K], int o, uint32_t lane_offset) {
  constexpr int kShift = kCopies == 32 ? 7 : kCopies == 16 ? 6 : kCopies == 8 ? 5 : 4;
  static_assert((1 << kShift) == kCopies * 4, "copies must be a power of two");
  const int wi = o >> 5, bi = o & 31;
  const uint32_t v = bi + 2 * K <= 32 ? w[wi] >> bi : __funnelshift_r(w[wi], w[wi + 1], bi);
  return ((v << kShift) & (((1u << (2 * K)) - 1u) << kShift)) | lane_offset;
}

// Position of a pipeline step in (token pass, CTA row tile, k-group) order. The kernel walks its steps in
// order, so it advances cursors instead of dividing: one cursor for the copies, one for the math.
struct StepCursor {
  int kgroup, ntile, mpass;
  __device__ StepCursor(const GemmParams& p, int step) {
    const int tile = step / p.k_groups;
    kgroup = step - tile * p.k_groups;
    mpass = tile / p.n_tiles;
    ntile = tile - mpass * p.n_tiles;
  }
  __device__ void advance(const GemmParams& p) {
    if (++kgroup == p.k_groups) {
      kgroup = 0;
      if (++ntile == p.n_tiles) ntile = 0, ++mpass;
    }
  }
  __device__ int tile(const GemmParams& p) const { return mpass * p.n_tiles + ntile; }
};

template <int K, int MB, typename T>
__device__ __forceinline__ void load_step(const GemmParams& p, uint8_t* stage, const StepCursor& c) {
  using Cfg = GemmConfig<K, MB>;
  const int tid = threadIdx.x;
  // Weights: one 16-row tile per warp, K*32 contiguous 16-byte vectors at B_gemm[tile16][kgroup];
  // each thread copies exactly K of them.
  constexpr int kVecsPerWarp = K * 32;
  static_assert(Cfg::kWarps * kVecsPerWarp == K * Cfg::kThreads, "K vectors per thread");
  const int64_t first16 = static_cast<int64_t>(c.ntile) * Cfg::kWarps;
  const uint4* b = p.b + (first16 * p.k_groups + c.kgroup) * kVecsPerWarp;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const int i = tid + j * Cfg::kThreads, w = i / kVecsPerWarp;
    cp_async16(stage + i * 16, b + static_cast<uint32_t>(w * p.k_groups) * kVecsPerWarp + (i - w * kVecsPerWarp));
  }
  // Block scales: 128 bytes per warp tile.
  if (tid < Cfg::kWarps * 8)
    cp_async16(stage + Cfg::kBStage + tid * 16,
               p.absmax + ((first16 + (tid >> 3)) * p.k_groups + c.kgroup) * 128 + (tid & 7) * 16);
  // Activations: MB*8 token rows x 256 columns; rows past M and columns past K_x are zero-filled.
  const T* x = static_cast<const T*>(p.x);
  uint8_t* xs = stage + Cfg::kBStage + Cfg::kAbsStage;
#pragma unroll
  for (int i = tid; i < MB * 8 * 32; i += Cfg::kThreads) {
    const int row = i >> 5, col = (i & 31) * 8;
    const int m = c.mpass * MB * 8 + row, kcol = c.kgroup * kKGroup + col;
    const bool ok = m < p.M && kcol < p.K_x;
    cp_async16(xs + (row * kXRowHalves + col) * 2, ok ? x + static_cast<int64_t>(m) * p.lda + kcol : x, ok ? 16 : 0);
  }
}

// One warp, one step: 16 weight rows x 256 k against MB*8 tokens, accumulated into acc.
template <int K, int MB, typename T>
__device__ __forceinline__ void compute_step(const uint8_t* stage, const uint8_t* pair_tbl, const float* scale_tbl,
                                             int token_rows, float (&acc)[MB][4]) {
  using Cfg = GemmConfig<K, MB>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  uint32_t w[4 * K];
  const uint4* bv = reinterpret_cast<const uint4*>(stage) + warp * K * 32 + lane;
#pragma unroll
  for (int v = 0; v < K; ++v) {
    const uint4 t = bv[v * 32];
    w[4 * v] = t.x; w[4 * v + 1] = t.y; w[4 * v + 2] = t.z; w[4 * v + 3] = t.w;
  }
  const uint8_t* ab = stage + Cfg::kBStage + warp * 128;
  const uint2 scales_lo = *reinterpret_cast<const uint2*>(ab + g * 8);       // row g, blocks 0..7
  const uint2 scales_hi = *reinterpret_cast<const uint2*>(ab + 64 + g * 8);  // row g + 8
  const uint8_t* xs = stage + Cfg::kBStage + Cfg::kAbsStage;
  const uint32_t lane_offset = (lane % Cfg::kCopies) * 4;

#pragma unroll
  for (int t = 0; t < 8; ++t) {
    const uint32_t lo_word = t < 4 ? scales_lo.x : scales_lo.y, hi_word = t < 4 ? scales_hi.x : scales_hi.y;
    const float s_lo = scale_tbl[(lo_word >> (8 * (t & 3))) & 0xFFu];  // block t of row g
    const float s_hi = scale_tbl[(hi_word >> (8 * (t & 3))) & 0xFFu];  // block t of row g + 8
    uint32_t h[2][4];  // [row g / g+8][pair j]: codebook values of columns 8q + 2j, 8q + 2j + 1 of block t
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t off = pair_offset<K, Cfg::kCopies>(w, ((2 * t + r) * 8 + 2 * j) * K, lane_offset);
        h[r][j] = *reinterpret_cast<const uint32_t*>(pair_tbl + off);
      }
    }
    const uint32_t a0[4] = {h[0][0], h[1][0], h[0][1], h[1][1]};  // k-step 0: columns 8q + 0..3
    const uint32_t a1[4] = {h[0][2], h[1][2], h[0][3], h[1][3]};  // k-step 1: columns 8q + 4..7
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) {
      const int row = mb * 8 + g;
      uint4 xv = make_uint4(0, 0, 0, 0);
      if (row < token_rows) xv = *reinterpret_cast<const uint4*>(xs + (row * kXRowHalves + t * 32 + 8 * q) * 2);
      // One block of 32 columns in unit scale, then its E4M4 scale in fp32: accumulator rows are weight
      // rows (g: d0, d1; g + 8: d2, d3), so each row takes its own block scale, rounded exactly once.
      float blk[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      mma_16816<T>(blk, a0, xv.x, xv.y);
      mma_16816<T>(blk, a1, xv.z, xv.w);
      acc[mb][0] = fmaf(blk[0], s_lo, acc[mb][0]);
      acc[mb][1] = fmaf(blk[1], s_lo, acc[mb][1]);
      acc[mb][2] = fmaf(blk[2], s_hi, acc[mb][2]);
      acc[mb][3] = fmaf(blk[3], s_hi, acc[mb][3]);
    }
  }
}

template <int K, int MB, typename T>
__device__ __forceinline__ void store_tile(const GemmParams& p, const StepCursor& c, const float (&acc)[MB][4]) {
  using Cfg = GemmConfig<K, MB>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const float s = *p.scale;
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int n = c.ntile * Cfg::kTileRows + warp * 16 + g + 8 * (i >> 1);
    if (n >= p.N) continue;
    const float b = bias ? to_float(bias[n]) : 0.0f;
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) {
      const int m = c.mpass * MB * 8 + mb * 8 + 2 * q + (i & 1);
      if (m < p.M) y[static_cast<int64_t>(m) * p.N + n] = from_float<T>(acc[mb][i] * s + b);
    }
  }
}

// First step owned by CTA b, and the CTA that owns step s (inverse of the stream-K cut).
__device__ __forceinline__ int first_step_of(const GemmParams& p, int b) {
  return static_cast<int>(static_cast<int64_t>(b) * p.total_steps / p.grid);
}
__device__ __forceinline__ int cta_of_step(const GemmParams& p, int s) {
  return static_cast<int>((static_cast<int64_t>(s + 1) * p.grid - 1) / p.total_steps);
}

template <int K, int MB, typename T>
__global__ void __launch_bounds__(GemmConfig<K, MB>::kThreads, 1) gemm_kernel(const GemmParams p) {
  using Cfg = GemmConfig<K, MB>;
  extern __shared__ __align__(16) uint8_t stages[];
  __shared__ __align__(16) uint32_t pair_tbl[Cfg::kPairTable / 4];
  __shared__ float scale_tbl[256];
  __shared__ int s_last_arrival;

  const int first = first_step_of(p, blockIdx.x), last = first_step_of(p, blockIdx.x + 1);
  const int tid = threadIdx.x;

  // Fill the pipeline first so the copies overlap the table construction below.
  StepCursor load_at(p, first);
#pragma unroll
  for (int s = 0; s < Cfg::kStages - 1; ++s) {
    if (first + s < last) {
      load_step<K, MB, T>(p, stages + s * Cfg::kStage, load_at);
      load_at.advance(p);
    }
    cp_async_commit();
  }
  for (int e = tid; e < Cfg::kPairs; e += Cfg::kThreads) {
    const uint32_t v = pack_pair<T>(p.codebook[e & ((1 << K) - 1)], p.codebook[e >> K]);
#pragma unroll
    for (int c = 0; c < Cfg::kCopies; ++c) pair_tbl[e * Cfg::kCopies + c] = v;
  }
  static_assert(Cfg::kThreads >= 256, "one thread per E4M4 code builds the scale table");
  if (tid < 256) scale_tbl[tid] = decode_e4m4(tid);

  float acc[MB][4] = {};
  StepCursor c(p, first);
  int load_slot = Cfg::kStages - 1, slot = 0;
  for (int step = first; step < last; ++step, c.advance(p)) {
    cp_async_wait<Cfg::kStages - 2>();
    __syncthreads();  // this step's stage is visible to all; every warp is done with the previous one
    if (step + Cfg::kStages - 1 < last) {
      load_step<K, MB, T>(p, stages + load_slot * Cfg::kStage, load_at);
      load_at.advance(p);
    }
    cp_async_commit();
    load_slot = load_slot + 1 == Cfg::kStages ? 0 : load_slot + 1;

    const int token_rows = min(MB * 8, p.M - c.mpass * MB * 8);
    compute_step<K, MB, T>(stages + slot * Cfg::kStage, reinterpret_cast<const uint8_t*>(pair_tbl), scale_tbl,
                           token_rows, acc);
    slot = slot + 1 == Cfg::kStages ? 0 : slot + 1;
    if (c.kgroup != p.k_groups - 1 && step != last - 1) continue;

    // ---- the tile ends here for this CTA: store it, or reduce it with the other contributors
    const int tile = c.tile(p);
    const int tile_first = tile * p.k_groups, tile_last = tile_first + p.k_groups - 1;
    if (tile_first >= first && tile_last < last) {
      store_tile<K, MB, T>(p, c, acc);
    } else {
      const int warp = tid >> 5, lane = tid & 31;
      auto partial = [&](int cta, int tile) {
        const int slot = tile == first_step_of(p, cta) / p.k_groups ? 0 : 1;
        return p.partials + (static_cast<int64_t>(cta) * 2 + slot) * Cfg::kPartialFloats + (warp * MB * 32 + lane) * 4;
      };
      float* mine = partial(blockIdx.x, tile);
#pragma unroll
      for (int mb = 0; mb < MB; ++mb)
        *reinterpret_cast<float4*>(mine + mb * 128) = make_float4(acc[mb][0], acc[mb][1], acc[mb][2], acc[mb][3]);
      __threadfence();  // partial visible device-wide before the counter says so
      __syncthreads();
      const int cta_first = cta_of_step(p, tile_first), cta_last = cta_of_step(p, tile_last);
      if (tid == 0) s_last_arrival = atomicAdd(p.counters + tile, 1) == cta_last - cta_first;
      __syncthreads();
      if (s_last_arrival) {
        __threadfence();
        float sum[MB][4] = {};
        for (int cta = cta_first; cta <= cta_last; ++cta) {  // fixed order: deterministic result
          const float* part = partial(cta, tile);
#pragma unroll
          for (int mb = 0; mb < MB; ++mb) {
            const float4 v = __ldcg(reinterpret_cast<const float4*>(part + mb * 128));
            sum[mb][0] += v.x; sum[mb][1] += v.y; sum[mb][2] += v.z; sum[mb][3] += v.w;
          }
        }
        store_tile<K, MB, T>(p, c, sum);
      }
    }
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) acc[mb][0] = acc[mb][1] = acc[mb][2] = acc[mb][3] = 0.0f;
  }
  cp_async_wait<0>();
}

// Host side: launch one configuration (instantiated per bit width in gemm_k{2,3,4,5}.cu).
template <int K, int MB, typename T>
cudaError_t launch_gemm(const GemmParams& p, cudaStream_t stream) {
  using Cfg = GemmConfig<K, MB>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(gemm_kernel<K, MB, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmem);
  if (attr != cudaSuccess) return attr;
  gemm_kernel<K, MB, T><<<p.grid, Cfg::kThreads, Cfg::kSmem, stream>>>(p);
  return cudaGetLastError();
}

template <int K, typename T>
cudaError_t launch_gemm_mb(const GemmParams& p, cudaStream_t stream) {
  switch (p.mb) {
    case 1: return launch_gemm<K, 1, T>(p, stream);
    case 2: return launch_gemm<K, 2, T>(p, stream);
    case 4: return launch_gemm<K, 4, T>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

// Explicit list of instantiations, one file per bit width so ninja builds them in parallel.
#define KBIT_INSTANTIATE_GEMM(K)                                                                 \
  template <>                                                                                    \
  cudaError_t gemm_for_bits<K>(const GemmParams& p, cudaStream_t stream) {                       \
    return p.dtype == DType::BF16 ? launch_gemm_mb<K, __nv_bfloat16>(p, stream)                  \
                                  : launch_gemm_mb<K, __half>(p, stream);                        \
  }

template <int K>
cudaError_t gemm_for_bits(const GemmParams& p, cudaStream_t stream);

int gemm_smem_bytes(int k, int mb);

}  // namespace kbit
