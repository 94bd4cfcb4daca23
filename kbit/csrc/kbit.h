// kbit CUDA core: the host-side interface. Framework-free: plain pointers, cudaError_t results.
// binding.cpp is the only file that knows about PyTorch.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>
#include <cuda_runtime.h>

namespace kbit {

// ---------------------------------------------------------------------------- format constants
// The numbers of the storage format (owner: kbit/formats.py) and of the GEMM layout (owner: kbit/layout.py) that
// the C++ side needs. tests/test_constants.py reads this block and checks each value against Python's.
// KBIT_CONSTANTS_BEGIN
constexpr int kBlock = 32;           // weights per quantization block (formats.BLOCK_SIZE)
constexpr int kMinBits = 2;          // bits per weight (formats.SUPPORTED_BITS)
constexpr int kMaxBits = 5;
constexpr int kLayoutTileRows = 16;  // weight rows per tile of the GEMM layout (layout.TILE_ROWS)
constexpr int kLayoutNAlign = 256;   // the layout pads N to this (layout.N_ALIGN)
constexpr int kKGroup = 256;         // columns per k-group of the layout and per pipeline step (layout.K_GROUP)
constexpr int kXColumnAlign = 8;     // the GEMM reads x in 16-byte pieces: columns a multiple of this (layout.X_ALIGN)
// KBIT_CONSTANTS_END

// K_w: a weight's columns, the binding's and Python's in_features_padded (in_features rounded up to 32); K_x: x's.
// Dimensions of the GEMM layout of an [N, K_w] weight: B_gemm [tiles16 / 16, k_groups, 16, k, 32, 4], absmax_gemm
// [tiles16 / 16, k_groups, 16, 2, 8, 8] (layout.gemm_shapes). A piece is one 16-row tile's k*512 bytes of codes
// (128 of scales) of one k-group; the 16 tiles of a 256-row block lie next to each other per k-group, so a CTA
// tile's pieces of one k-group are one contiguous range.
constexpr int kLayoutBlockTiles = kLayoutNAlign / kLayoutTileRows;
constexpr int64_t layout_tiles16(int64_t N) {
  return (N + kLayoutNAlign - 1) / kLayoutNAlign * kLayoutBlockTiles;
}
constexpr int64_t layout_k_groups(int64_t K_w) { return (K_w + kKGroup - 1) / kKGroup; }
// Pipeline steps per CTA tile: one k-group each, or k_split of them (the warps splitting k; GemmParams::k_split).
constexpr int gemm_k_steps(int64_t K_w, int k_split) {
  return static_cast<int>((layout_k_groups(K_w) + k_split - 1) / k_split);
}
// A lane's bit string (kbit/layout.py, pair_bit_offsets): the string bit that holds bit n (0 .. 2k-1) of the table
// index of pair P (0..63; code e = 0 in the low k bits). k = 3 puts 12 of every 16 pairs in the low 6 bits of a byte
// and gathers the other 4 from those bytes' top 2 bits, so every pair is addressed byte-wise.
__host__ __device__ constexpr int pair_bit_offset(int k, int P, int n) {
  if (k != 3) return 2 * k * P + n;
  const int u = P / 16, s = P / 4 % 4, i = P % 4;
  return s < 3 ? 96 * u + 32 * s + 8 * i + n : 96 * u + 32 * (n / 2) + 8 * i + 6 + n % 2;
}
// Piece number of 16-row tile `tile16`, k-group `kgroup`: codes at piece * k*512 bytes, scales at piece * 128.
__host__ __device__ constexpr int64_t layout_piece(int64_t tile16, int kgroup, int k_groups) {
  return (tile16 / kLayoutBlockTiles * k_groups + kgroup) * kLayoutBlockTiles + tile16 % kLayoutBlockTiles;
}

// The one switch on the bit width: f(std::integral_constant<int, BITS>{}) for k = BITS in kMinBits..kMaxBits,
// `otherwise` for any other k. Each kernel family instantiates its templates per BITS through it.
template <typename R, typename F>
R with_bits(int k, R otherwise, F&& f) {
  switch (k) {
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    default: return otherwise;
  }
}
static_assert(kMinBits == 2 && kMaxBits == 5, "with_bits lists the bit widths");

enum class DType : uint8_t { F16 = 0, BF16 = 1, F32 = 2 };

// ---------------------------------------------------------------------------- storage format
// Quantize n elements of x (flat) in blocks of 32: packed [nb * k] bit-plane words, absmax [nb] E4M4.
// scale: device pointer to the per-tensor power-of-two scale (see kbit/formats.py).
cudaError_t quantize(const void* x, DType x_dtype, int64_t n, const float* codebook, int k, const float* scale,
                     uint32_t* packed, uint8_t* absmax, cudaStream_t stream);

// Reconstruct n elements: out[i] = codebook[code] * (decode_e4m4(absmax[block]) * *scale).
cudaError_t dequantize(const uint32_t* packed, const uint8_t* absmax, const float* codebook, int k,
                       const float* scale, int64_t n, void* out, DType out_dtype, cudaStream_t stream);

// ---------------------------------------------------------------------------- GEMM layout
// Storage format of an [N, K_w] weight -> GEMM layout (kbit/layout.py documents the shapes).
cudaError_t repack(const uint32_t* packed, const uint8_t* absmax, int k, int N, int K_w, uint32_t* b_gemm,
                   uint8_t* absmax_gemm, cudaStream_t stream);
// The inverse: GEMM layout -> storage format, bit for bit.
cudaError_t unrepack(const uint32_t* b_gemm, const uint8_t* absmax_gemm, int k, int N, int K_w, uint32_t* packed,
                     uint8_t* absmax, cudaStream_t stream);
// The dense weight out[N, K_w] straight from the GEMM layout: dequantize of unrepack's storage, value for value.
cudaError_t dequantize_layout(const uint32_t* b_gemm, const uint8_t* absmax_gemm, const float* codebook, int k,
                              const float* scale, int N, int K_w, void* out, DType out_dtype, cudaStream_t stream);

// ---------------------------------------------------------------------------- fused GEMM
// y[M, N] = (x[M, K_x] @ W_hat[N, K_w]^T) * scale + bias, with W_hat from the GEMM layout (scale per tensor, or per
// 256 output rows: GemmParams::row_scales).
// The SMs a grid leaves idle. Launched early (programmatic dependent launch), CTAs start on idle SMs while the previous
// kernel runs, so they have time to copy settled weights into their stages; on a full grid they start in its tail.
enum class GridRoom : uint8_t {
  kFull,        // a CTA on every SM
  kBelowSms,    // fewer CTAs than SMs
  kHalfOrLess,  // at most half the SMs: the whole grid starts beside a previous grid of its size
};

// Where the parts of a tile cut in parts (GemmLaunch::tile_parts) are summed. The warp-specialized kernel (gemm_ws.cuh,
// ws_cluster_reduce): in a thread-block cluster of those parts where the GPU holds every tile's cluster at once, else
// through L2 (the binding reads KBIT_WS_CLUSTERS: 0 kL2, 1 kRequired, unset kWhereTheyFit). gemm.cuh's kernels (up
// to 16 tokens, sm_90): always in a cluster, kRequired (GemmConfig::kClustered, cluster_finish_tile); kL2 where
// tiles are not cut in parts.
enum class ClusterUse : uint8_t {
  kL2,            // through L2 always
  kWhereTheyFit,  // in clusters where they fit
  kRequired,      // in clusters wherever the parts are few enough (kMaxClusterCtas), or the launch fails (tests: a
                  // call that passes ran the cluster path)
};

// One struct carries everything from host to kernel (flash-attention style).
struct GemmParams {
  const void* x;            // [M, lda] fp16/bf16, 16-byte aligned rows; columns >= K_x read as 0
  const uint4* b;           // B_gemm  [n_tiles16, k_groups, k, 32, 4] words
  const uint8_t* absmax;    // absmax_gemm [n_tiles16, k_groups, 2, 8, 8]
  const float* codebook;    // [2^k]
  const float* scale;       // per-tensor scale (device scalar); with row_scales one per 256 output rows (a block of the
                            // layout), [ceil(N / 256)]
  const void* bias;         // [N] in x's dtype, or nullptr
  void* y;                  // [M, N] in x's dtype, row-major
  float* partials;          // split-K workspace, gemm_plan().partial_floats: every word kPartialEmpty before the
                            // launch, and again after it
  int M, N, K_x, lda;
  int k_groups;             // K_w / 256, rounded up
  int n_tiles;              // CTA row tiles along N
  int grid;                 // CTAs, in groups of cut_group, each owning cut_group * steps_per_cta + extra_steps
                            // consecutive units of cut_unit pipeline steps (token passes x n_tiles x k_steps in all):
                            // a CTA owns steps_per_cta units, one more if it is among the first extra_steps of its
                            // group (cut.h)
  int steps_per_cta;
  int extra_steps;
  int mb;                   // 8-token MMA tiles per pass: 1, 2 or 4 (mma.sync); 8 or 16 (wgmma)
  int ws_tokens;            // 0: gemm.cuh's kernel; 32, 64, 128, 256: the warp-specialized kernel (gemm_ws.cuh, sm_90a)
                            // with that many tokens per tile (mb = ws_tokens / 8)
  uint8_t k;                // bits
  bool row_scales;          // scale holds one float per 256 output rows: sibling projections fused into one launch,
                            // each padded to 256 rows with its own per-tensor scale (kbit/fusion.py); epilogue only
  uint16_t cut_unit;        // pipeline steps per unit of the cut: 1, or k_steps where every CTA owns whole tiles (the
                            // warp-specialized kernel; gemm.cuh's kernels cut in steps: 1)
  int k_steps;              // pipeline steps per tile: k_groups, or k_groups / k_split rounded up
  DType dtype;              // of x, y, bias
  bool dependent_launch;    // launched with programmatic stream serialization (sm_90; see common.cuh)
  bool weights_settled;     // with dependent_launch: b, absmax and codebook are not being written by the previous
                            // kernel (the host knows, kbit/ops.py), so the kernel reads them before the wait
  uint8_t k_split;          // 1: each warp owns its rows of a CTA tile; 8 (mma.sync, mb <= 2): the CTA's 8 warps split
                            // the k-groups of one 32-row (mb = 2: 16-row) tile (gemm.cuh, GemmConfig::kKSplit)
  GridRoom grid_room;       // the SMs the grid leaves idle: how much of its settled weights a CTA copies into its
                            // stages before the wait (gemm.cuh, gemm_main)
  bool weights_stream;      // the weights are read once and exceed L2: copied evict-first (gemm.cuh up to 16
                            // tokens, GemmConfig::kWeightsStreamed; gemm_ws.cuh, ws_copy_weights)
  uint8_t wgmma_tiles;      // 0: mma.sync; 1 or 2: the wgmma path (sm_90a) with that many row tiles per warp; with
                            // ws_tokens: 0 the default tiles, 1 128-row tiles (WsConfig's GROUPS = 2)
  ClusterUse clusters;      // host only: how the launch sums tiles cut in parts (ClusterUse)
  uint16_t cut_group;       // CTAs per group of the cut (grid above): grid (one group: the stream-K cut), or the CTAs
                            // sharing one tile (its parts: the planner's tile_parts; in gemm.cuh's kernels a cluster)
  uint16_t cut_group_reciprocal;  // a CTA's group without a division (cut.h, make_cut)
};
// 128 bytes: a larger struct made ptxas compile every GEMM configuration differently, and small shapes ran slower
// (docs/PERFORMANCE.md, "Instructive failures").
static_assert(sizeof(GemmParams) == 128, "GemmParams grew: measure the GEMM before changing this");

// A split-K partial not yet written: a NaN whose payload no arithmetic produces (the GPU's arithmetic NaN is
// 0x7FFFFFFF), so each word of a partial tile says by itself whether it has landed.
constexpr uint32_t kPartialEmpty = 0xFFBADBADu;

// One configuration of the fused GEMM, as built. kbit/planner.py plans every call from this list (through the
// binding's gemm_configs): it never picks one that is not built, or that this GPU cannot run.
struct GemmConfigInfo {
  int bits, mb, wgmma_tiles;  // GemmConfig<bits, mb, wgmma_tiles, 0, k_split> of gemm.cuh, or with ws_tokens:
  int k_split;                // warps splitting one tile's k-groups (GemmParams), 1 with ws_tokens
  int ws_tokens;              // > 0: WsConfig<bits, ws_tokens> of gemm_ws.cuh (mb = ws_tokens / 8; wgmma_tiles 0,
                              // or 1: 128-row tiles below 256 tokens)
  int tile_rows;              // weight rows per CTA tile
  int smem_bytes;             // shared memory per CTA, static included
  int cc_major_min, cc_major_max;  // the compute capabilities (major) its code is built for
};
// Whether (k, mb, wgmma_tiles, k_split, ws_tokens) is built; fills info if it is.
bool gemm_config_info(int k, int mb, int wgmma_tiles, int k_split, int ws_tokens, GemmConfigInfo* info);
// Every built configuration, every bit width.
std::vector<GemmConfigInfo> gemm_configs();

// How a GEMM will run: its configuration's launch, sized on the host before allocating its workspace.
struct GemmPlan {
  int mb, m_passes, grid, total_steps;
  int cut_group;            // CTAs per group of the cut (GemmParams): grid, or the parts of one tile
  int cut_unit;             // steps per unit of the cut (GemmParams): 1, or k_steps (whole tiles)
  int wgmma_tiles;          // 0: mma.sync; 1 or 2: wgmma with that many row tiles per warp (GemmParams)
  int k_split;              // warps splitting one tile's k-groups (GemmParams)
  int ws_tokens;            // 0, or tokens per tile of the warp-specialized kernel (GemmParams)
  int tile_rows;            // weight rows per CTA tile
  int64_t partial_floats;   // floats of split-K workspace (0 when every CTA owns whole tiles)
  int smem_bytes;           // shared memory per CTA the configuration needs
  int smem_limit;           // the device's opt-in maximum per CTA (0 if unknown)
  int cc_major;             // the device's compute capability, major (0 if unknown)
  bool built;               // whether the configuration is built for the device's architecture
  bool weights_stream;      // one token pass over more weight bytes than L2 holds (GemmParams)
  bool clustered;           // gemm.cuh's kernels: each tile in cut_group parts, summed in a cluster (ClusterUse)
  const char* refused;      // why the launch cannot run (nullptr: it can); the configuration's own facts aside
};

// The grid and the cut of the steps among its CTAs, as kbit/planner.py chose them (cut.h): the steps in one group
// (tile_parts = 0, whole_tiles = false), whole tiles per CTA, or each tile in tile_parts parts (grid = tiles x parts).
// Tile parts on gemm.cuh's kernels (mma.sync, up to 16 tokens, sm_90): 2 to 8 parts of a tile, on one thread-block
// cluster of that many CTAs, summed in shared memory (ClusterUse).
struct GemmLaunch {
  int grid, tile_parts;
  bool whole_tiles;
};

// The configuration (k, mb, wgmma_tiles, k_split, ws_tokens) run for M tokens on `launch`; chooses nothing. num_sms:
// multiprocessors of the device. A configuration that is not built comes back with built = false and nothing else
// set; a launch that does not fit it with `refused` set.
GemmPlan gemm_plan(int M, int N, int K_w, int k, int mb, int wgmma_tiles, int k_split, int ws_tokens,
                   const GemmLaunch& launch, int num_sms);
// Fills the plan-derived fields of p; p.k must already be set.
void gemm_fill_params(GemmParams& p, const GemmPlan& plan, int N, int K_w);
cudaError_t gemm(const GemmParams& p, cudaStream_t stream);
// Clusters of `ctas` CTAs (1..8) of gemm.cuh's clustered kernels the current device runs at once (0: none; gemm_k4.cu).
int gemm_clusters_at_once(int ctas);

}  // namespace kbit
