// The fused dequantize + GEMM kernel: y[M, N] = x[M, K] @ W_hat[N, K]^T, W_hat read from the GEMM layout.
//
// Reads top to bottom:
//   GemmConfig      compile-time sizes of one configuration (BITS per weight, 8-token tiles MB, MMA kind)
//   build_tables    the per-CTA lookup table: codes -> 16-bit codebook values
//   block_fragments turns a lane's codes of one block into MMA A-fragment registers (table lookups)
//   SmemLayout      where the tables (at an aligned shared address) and each stage's pieces live
//   StepCursor      a step's coordinates, advanced step by step instead of recomputed by division
//   warp_piece      where a warp's codes and scales of a step lie in the GEMM layout
//   Barriers        the pipeline's mbarriers, per stage: the step landed (full), every warp done with it (empty)
//   load_weights    one step's weights (two bulk copies on sm_90, cp.async per warp on sm_80)
//   load_activations a warp's share (at MB = 1: all) of one step's activation copies (cp.async)
//   compute_step    looks a warp's 32 x 256 (or 16 x 256) weight codes up in the table, runs the MMAs per block of
//                   32 columns and applies each block's scale to the fp32 result (mma.sync; one token: once per step),
//                   or at 16 and 32 tokens per pass to the weights in 16 bits (GemmConfig::kScaleWeights)
//   compute_step_wgmma the same for 64 rows per warpgroup and 64 or 128 tokens, block scales applied to the
//                   weights in 16 bits (wgmma, sm_90)
//   store_tile      writes a finished output tile (per-tensor scale, bias, dtype conversion)
//   gather_k_split  with the warps splitting a tile's k-groups: their sums into warp 0's, through shared memory
//   finish_tile     stores a finished tile, or reduces it with the other CTAs that hold parts of it
//   cluster_finish_tile a tile cut in parts on one thread-block cluster: the parts summed through the CTAs' shared
//                   memory, not L2
//   gemm_main       the persistent, stream-K main loop, one inner loop per tile: no CTA-wide barrier per step; a
//                   stage is refilled once every warp is done with it, its weights by one thread (sm_90), the
//                   warps taking turns, at MB = 1 its activations by that thread's warp
//   gemm_kernel     the entry point (and what sm_80 builds of it)
//
// Roles: the weights are the MMA's A operand (16 output features x 16 k), the activations its B operand
// (16 k x 8 tokens), so one m16n8k16 serves up to 8 tokens with no wasted weight work (C^T = W X^T).
// Each of the 8 warps owns one or two row tiles of 16 weight rows; the warps share a step's activations.
// Two tensor-core paths share everything but the math (GemmConfig::kWgmma):
//   mma.sync m16n8k16, up to 32 tokens per pass (all GPUs): each warp loads its activation fragments from
//     shared memory into registers, and scales each block's fp32 result (one FFMA per accumulator per block), or
//     at 16 and 32 tokens per pass, where that is as many FFMAs as A registers or more, the weights (one HMUL2 per
//     register);
//   wgmma m64nNk16, N = 64 or 128 tokens per pass (sm_90a): each warpgroup's 4 warps supply 64 weight rows from
//     registers, the tensor cores read the activations from shared memory themselves, and the block scales
//     are applied to the weights in 16 bits (one HMUL2 per register, whatever the token count), so a pass
//     of up to 128 tokens costs one table lookup per weight pair and no FFMA per token.
//
// Work: a step is (token pass, CTA row tile, 256-column k-group). With the warps splitting k (GemmConfig::kKSplit,
// small shapes), a CTA tile is 32 rows (16 at 16 tokens) and a step 8 k-groups, one per warp, summed in shared memory
// at the tile's end.
// The total step range is cut into
// `grid` contiguous pieces (stream-K), one per CTA, so every SM streams weights whatever the shape.
// A tile whose k-groups span several CTAs is reduced deterministically by the CTA that holds its first
// k-group (which reaches it last, at the end of its range): every other contributor stores its fp32 partial,
// the reducer waits until each word has landed, adds the partials in CTA order to its own accumulators and
// stores the tile. A reducer only waits for CTAs after it, and each of those publishes before it could wait
// for anything itself: the waits need no more than CTAs starting in index order, and the grid is at most one
// CTA per SM (so all start at once when the GPU is not shared).
// Up to 16 tokens on sm_90 the host may instead cut each tile's k-steps in 2 to 8 parts on a thread-block cluster of
// as many CTAs (GemmConfig::kClustered): the parts meet in the cluster's shared memory (cluster_finish_tile).

#include <atomic>

#include "common.cuh"
#include "cut.h"
#include "moe.h"

namespace kbit {

// Shared address space of a CTA on sm_90: kReservedSmem bytes reserved by the system, then static, then
// dynamic shared memory, up to kSharedTop (227 KB opt-in per CTA). Static shared memory (barriers, flags) is
// assumed to stay under kStaticSmemMax; the kernel checks its layout at run time.
constexpr int kReservedSmem = 1024;
constexpr int kSharedTop = kReservedSmem + 227 * 1024;
constexpr int kStaticSmemMax = 2048;

// Warps per CTA, and row tiles (16 weight rows each) per warp. A warp owns two row tiles: each activation
// fragment it loads then serves both, and the per-step work that does not scale with the rows (barrier
// waits, copy issue, cursors) is paid once per 32 rows. Eight warps leave each thread the registers for both
// tiles' codes and accumulators. BITS = 5 keeps one tile per warp at MB >= 2: two would need 42 KB of codes per
// stage, too few stages (and, at MB = 2, more shared memory than sm_80 has).
// wgmma: one or two row tiles (CTA tiles of 128 or 256 rows). With two, each step's activations (MB*8 tokens x
// 256 k, 16-64 KB from L2) serve twice the weights: with one at 128 tokens, the activations were 4x the
// weights' bytes and the kernel ran at the rate the SM takes data in. But half the tiles means more split-K and 2x
// larger partials: on small shapes one is faster (docs/PERFORMANCE.md, "Measured choices"). BITS = 5 at 128 tokens
// has one only: two would not fit two stages.
constexpr int kGemmWarps = 8;
// The k split at 16 tokens: one row tile (16-row CTA tiles), as two would not leave room for two stages of 16 token
// rows x 2048 k of activations.
// wgmma_tiles: 0 for mma.sync, else the wgmma path's row tiles per warp (the host picks them per shape).
__host__ __device__ constexpr int gemm_row_tiles(int k, int mb, int wgmma_tiles, int k_split) {
  return wgmma_tiles ? wgmma_tiles : k_split > 1 && mb > 1 ? 1 : k != 5 || mb == 1 ? 2 : 1;
}
__host__ __device__ constexpr int gemm_tile_rows(int k, int mb, int wgmma_tiles, int k_split) {
  return kGemmWarps / k_split * gemm_row_tiles(k, mb, wgmma_tiles, k_split) * 16;
}

// The most shared memory per CTA on sm_80-class GPUs (A100: 163 KB).
constexpr int kSm80SmemMax = 163 * 1024;

// The most parts of one tile summed in a thread-block cluster (GemmConfig::kClustered; gemm_ws.cuh, ws_cluster_reduce):
// 8, the portable cluster size.
constexpr int kMaxClusterCtas = 8;

// WG: 0 for mma.sync, else the wgmma path (sm_90a) with WG row tiles per warp. G: 0 for one weight, else the
// grouped GEMM of a mixture-of-experts layer (moe.h) with that GroupedEpilogue. KS: warps splitting one tile's
// k-groups (kKSplit). BC: one token, the MMA's columns the step's blocks (kBlockColumns). ST: up to 16 tokens, the
// weights streamed through L2 evict-first (kWeightsStreamed). CL: up to 16 tokens, each tile's k range in parts on one
// thread-block cluster, summed in shared memory (kClustered).
template <int BITS, int MB, int WG, int G = 0, int KS = 1, bool BC = false, bool ST = false, bool CL = false>
struct GemmConfig {
  static constexpr int kBits = BITS, kMB = MB;
  static constexpr bool kWgmma = WG > 0;
  static constexpr bool kGrouped = G != 0;
  static constexpr GroupedEpilogue kEpilogue = static_cast<GroupedEpilogue>(G);
  using Params = std::conditional_t<kGrouped, GroupedGemmParams, GemmParams>;  // what the kernel receives
  static constexpr int kWarps = kGemmWarps;
  // KS = 1: each warp owns its row tiles of the CTA tile, and a step is one k-group. KS = kWarps (mma.sync, up to 16
  // tokens): every warp the same 32 rows (16 at MB = 2), a step KS k-groups, warp w the step's w-th; at the tile's
  // end the warps' sums meet in shared memory (gather_k_split). Small shapes then need no split-K across CTAs:
  // 4096 -> 4096 is 128 tiles of 32 rows, one per CTA, where 256-row tiles were 16, each split over ~8 CTAs handing
  // off through L2 (docs/PERFORMANCE.md, performance model: fixed cost per call).
  static constexpr int kKSplit = KS;
  static_assert(KS == 1 || (KS == kGemmWarps && WG == 0 && G == 0 && MB <= 2),
                "k split across warps: mma.sync, MB <= 2");
  static constexpr int kRowTiles = gemm_row_tiles(BITS, MB, WG, KS);
  static constexpr int kFrags = kRowTiles * MB;         // accumulator fragments per warp (row tile, token tile)
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kTileRows = gemm_tile_rows(BITS, MB, WG, KS);        // weight rows per CTA tile
  // How the E4M4 block scales apply. mma.sync at one 8-token tile: each block's fp32 MMA result times its scale, one
  // FFMA per accumulator and block (8 x 2 x 4 per step at two row tiles), the scales decoded in sixteenths
  // (e4m4_pair_to_float_sixteenths). From two token tiles that takes as many FFMAs as there are A registers (MB = 2)
  // or more, so the weights are scaled instead (kScaleWeights), as wgmma does: one HMUL2 per looked-up register in 16
  // bits, rounded once like the dequantized weights cuBLAS would read, the MMAs accumulating straight into the sums
  // (no block sums, no FFMA). Its scales stay 16-bit pairs of two blocks (e4m4_pair_bits: one PRMT and one shift per
  // two blocks, each HMUL2 reading its half), their unit kE4M4PairUnit<T> undone by the lookup table, which holds the
  // codebook times its inverse (kTableFactor; exact: powers of two, the codebook within [-1, 1]), so each weight is
  // the 16-bit codebook value times the scale, rounded once (fp16 subnormals where the reference's weights are).
  // At one token tile the 64 FFMAs are fewer than the 128 HMUL2s.
  static constexpr bool kScaleWeights = !kWgmma && MB >= 2;
  template <typename T>
  static constexpr float kTableFactor = kScaleWeights ? 1.0f / kE4M4PairUnit<T> : 1.0f;
  // The accumulators hold the output times 1 / kAccScale: sixteenths with the FFMA per block, the whole value where
  // the weights are scaled (kScaleWeights; wgmma).
  static constexpr float kAccScale = kWgmma || kScaleWeights ? 1.0f : 16.0f;
  // Who copies a step's activations. MB = 1 (up to 8 token rows, 4-byte pieces): the warp that issues the step's
  // weights, so that the other warps only wait for the stage and compute. More tokens: every warp its share (one
  // warp copying 16-32 rows was slower than every warp copying 2-4).
  // With KS > 1 every warp copies its own k-group's.
  static constexpr bool kActsByIssuer = !kWgmma && MB == 1 && KS == 1;
  static constexpr int kBStage = kWarps * kRowTiles * BITS * 32 * 16;  // per row tile: BITS vectors of 16 B per lane
  static constexpr int kAbsStage = kWarps * kRowTiles * 128;        // per row tile: 16 rows x 8 blocks
  // Activations, MB*8 tokens x KS*256 k (load_activations): wgmma's core matrices (8 tokens x 8 k, 128 B each), or
  // padded token rows of kXRow halves (mma.sync; k-group KS * kstep + w at 256w in each). Those are read two ways:
  //   MB = 1 (kXPairsTransposed): one predicated 16-byte load per lane and block (at M = 1 only lanes 0..3 load:
  //     one wavefront, not four), the block's pieces transposed on the way in; rows KS*512 + 64 B apart (64 mod 128),
  //     so the two rows of one 8-lane phase hit different banks;
  //   MB >= 2: ldmatrix in the rows' natural order, 16-byte copies; rows 528 B apart (16 mod 128), so the 8 rows
  //     of one matrix hit 8 different 16-byte bank groups. Transposing there costs 4x the copy instructions
  //     (docs/PERFORMANCE.md#instructive-failures).
  static constexpr bool kXPairsTransposed = !kWgmma && MB == 1;
  // One token (M = 1, BITS = 2..4; launch_gemm_mb picks it): the MMA's 8 columns are a step's 8 blocks, not 8 tokens.
  // For block t the lanes of column t load the token's activations and the others zeros (token row 1 of the stage,
  // which one token leaves free: clear_block_columns), so each MMA adds block t's sums to column t only and the
  // accumulators hold a step's 8 blocks apart. Each lane then scales its two columns (blocks 2q, 2q + 1) once per
  // step, where with tokens in the columns every block's result took one FFMA per accumulator and its scale decoded
  // per block; the quad's four lanes meet at the tile's end
  // (sum_block_columns). Even and odd blocks accumulate apart, 8 MMAs each: all 16 MMAs of a row tile in one
  // accumulator were no faster, four accumulators slower. Not with the k split, whose one step per CTA leaves
  // nothing to save. Same shared memory as MB = 1.
  static constexpr bool kBlockColumns = BC;
  static_assert(!BC || (MB == 1 && WG == 0 && G == 0 && KS == 1 && BITS <= 4),
                "block columns: mma.sync, one token, no k split, BITS <= 4");
  // One pass of up to 16 tokens over more weight bytes than L2 holds (GemmParams::weights_stream): the step's bulk
  // copies carry an L2 evict-first policy, so that the weights streaming past do not push out the split-K partials
  // published early and polled at the kernel's end, whose poll then takes less time. A configuration of its own: the
  // copy chosen at run time (a branch between the two copies) made the shapes whose weights fit in L2 slower
  // (docs/PERFORMANCE.md, "Measured choices").
  static constexpr bool kWeightsStreamed = ST;
  static_assert(!ST || (MB <= 2 && WG == 0 && G == 0 && KS == 1), "weights streamed evict-first: up to 16 tokens");
  // Up to 16 tokens (sm_90): each tile's k-steps cut in parts (GemmParams::cut_group CTAs per tile, the grouped cut of
  // cut.h), the parts of a tile on one thread-block cluster of as many CTAs, summed through distributed shared memory
  // instead of split-K partials in L2 (cluster_finish_tile). Same shared memory as without.
  static constexpr bool kClustered = CL;
  static_assert(!CL || (MB <= 2 && WG == 0 && G == 0 && !ST), "tile parts in clusters: mma.sync, up to 16 tokens");
  static constexpr int kXRow = KS * kKGroup + (kXPairsTransposed ? 32 : 8);
  static constexpr int kXStage = kWgmma ? MB * 8 * kKGroup * 2 : MB * 8 * kXRow * 2;
  // Lookup table (see "Lookup tables" below): how one lane turns its codes into A-fragment registers.
  //   BITS = 2: quad table, 256 rows of 256 B, row = one byte of codes (4 codes), lane l's copy at 8l (LDS.64);
  //   BITS = 4: pair table, 256 rows of 256 B, row = one byte of codes (2 codes), lane l's copy at 4l (bytes
  //          128..255 of each row unused: the PRMT address needs the 256 B stride);
  //   BITS = 3: the same rows, row = a byte whose low 6 bits are a pair (rows repeat every 64: the top 2 bits are
  //          another pair's, kbit/layout.py);
  //   BITS = 5: pair table, entry p = (pair p) at (p << log2(copies * 4)) + 4 * (l % copies); 32 copies would take
  //          128 KB: 16 (64 KB) at MB = 1, 8 (32 KB) at larger MB or KS, which need the room for activations (and to
  //          fit sm_80's 163 KB). 8 copies means 4 lanes share each, 3 wavefronts per lookup on average; 16, 2.
  //   wgmma: the compact pair table for every BITS (32 copies up to BITS = 3, 8 at 4 and 5): the activation stages of
  //          64-128 tokens need the room the 64 KB row tables would take, and a lookup serves 4-16 MMAs.
  //   byte-row tables (BITS = 2..4) only where two stages fit beside their 64 KB: not the k split at MB = 2, whose
  //          stages hold 16 token rows x 2048 k; it takes the compact pair table (32 copies to BITS = 4, 8 at 5).
  //          Nor BITS = 3 at MB = 2 (kA100KeepsCompact).
  // The E4M4 block scales need no table (e4m4_byte_to_float).
  static constexpr int kPairs = 1 << (2 * BITS);
  static constexpr int kCopyBytes = kWgmma && BITS < 5 ? 8192 : MB == 1 && KS == 1 ? 65536 : 32768;  // the most a compact table may take
  static constexpr int kCopies = kPairs * 32 * 4 <= kCopyBytes ? 32 : kCopyBytes / (kPairs * 4);

  // Shared memory (see "Shared memory layout" below), for a table of `table` bytes. The table starts at a shared
  // address aligned to table_align(table), its size rounded up to a power of two; the stages' pieces fill the space
  // below it ("low", after the reserved and static shared memory) and above it ("high"). A stage is two pieces: the
  // warps' codes (kBStage) and the "small" piece, scales then activations (kAbsStage + kXStage).
  static constexpr int table_align(int table) { return table <= 8192 ? 8192 : table <= 32768 ? 32768 : 65536; }
  static constexpr int kSmall = kAbsStage + kXStage;
  static constexpr int low_budget(int table) {
    return table_align(table) > kReservedSmem + kStaticSmemMax ? table_align(table) - kReservedSmem - kStaticSmemMax : 0;
  }
  static constexpr int high_budget(int table) { return kSharedTop - table_align(table) - table; }
  static constexpr int small_low(int table, int s) {
    return s < low_budget(table) / kSmall ? s : low_budget(table) / kSmall;
  }
  static constexpr int codes_low(int table, int s) {
    const int room = low_budget(table) - small_low(table, s) * kSmall;
    return s < room / kBStage ? s : room / kBStage;
  }
  static constexpr int high_bytes(int table, int s) {
    return (s - codes_low(table, s)) * kBStage + (s - small_low(table, s)) * kSmall;
  }
  static constexpr int stages_beside(int table) {  // the most stages that fit (at most 4), 0 below two
    return high_bytes(table, 4) <= high_budget(table) ? 4 : high_bytes(table, 3) <= high_budget(table) ? 3
         : high_bytes(table, 2) <= high_budget(table) ? 2 : 0;
  }
  // BITS = 3 at MB = 2 keeps the compact table: that is the configuration an A100 (163 KB) runs k = 3 decode with
  // (byte rows would take it to 223 KB, and MB = 1 to 199 KB, past it).
  static constexpr bool kA100KeepsCompact = BITS == 3 && MB == 2;
  static constexpr bool kByteRows = !kWgmma && BITS <= 4 && !kA100KeepsCompact && stages_beside(256 * 256) >= 2;
  static constexpr int kTables = kByteRows ? 256 * 256 : kPairs * kCopies * 4;
  static constexpr int kTableAlign = table_align(kTables);
  static constexpr int kStages = stages_beside(kTables);
  static_assert(kStages >= 2, "configuration does not fit in shared memory");
  static constexpr int kSmallLow = small_low(kTables, kStages), kCodesLow = codes_low(kTables, kStages);  // below the table
  static constexpr int kLowBytes = kSmallLow * kSmall + kCodesLow * kBStage;
  static constexpr int kHighBytes = high_bytes(kTables, kStages);
  // Per-CTA total (static + dynamic) when the dynamic base is below kTableAlign: what the plan checks.
  static constexpr int kSmemTotal = kTableAlign - kReservedSmem + kTables + kHighBytes;
  // Built for sm_80-class GPUs: what fits their shared memory. The host refuses the rest.
  // Not the k split: gather_k_split parks sums in a stage that sm_80's per-warp copies refill without waiting for the
  // other warps (and none of its configurations fits there).
  // Nor clusters, which sm_80 does not have.
  static constexpr bool kOnSm80 = !kWgmma && KS == 1 && !CL && kSmemTotal <= kSm80SmemMax;
  static constexpr int kPartialFloats = kWarps * kFrags * 32 * 4;  // one CTA's partial output tile
};

// ---------------------------------------------------------------------------- lookup tables
// Every CTA builds its table once, in shared memory, from the codebook. Entries are duplicated per lane so
// that 32 lanes reading 32 different entries hit 32 different banks.
//
// Why two kinds. At BITS = 4 a pair of codes is exactly one byte of a lane's bit string, at BITS = 3 a byte's low 6
// bits (or a word gathered from three bytes' top bits), and at BITS = 2 a byte is a quad; one PRMT then places that
// byte at bits 8..15 and the lane's copy offset at bits 0..7: a whole table address in one instruction (the
// generic path needs a shift, a mask and an OR). That needs rows of 256 B, 64 KB per table. BITS = 5 keeps compact
// tables and the shift-and-mask path.
// `code_value` is codebook[threadIdx.x] for the first 2^BITS threads, loaded by the caller before it issued
// the pipeline's first copies: loaded here, behind ~100 KB of weight copies from the same SM, it arrived
// late, and the whole CTA waited for it.
template <class Cfg, typename T>
__device__ __forceinline__ void build_tables(float code_value, uint8_t* tables) {
  constexpr int BITS = Cfg::kBits;
  const int tid = threadIdx.x;
  __shared__ float codebook[1 << BITS];
  if (tid < (1 << BITS)) codebook[tid] = code_value;
  __syncthreads();
  if constexpr (Cfg::kByteRows) {
    // Row e is 16 vectors of 16 B; thread i computes the value of half-row i once and stores its 8 vectors,
    // rotated by i so that the 8 threads of one store wavefront hit 8 different bank groups.
    //   BITS = 2: half-row i is half i % 2 of row i / 2; both halves hold lane copies of the 4 values of quad e;
    //   BITS = 3, 4: half-row i is the first half of row i, lane copies of the pair in its low 2 * BITS bits.
    constexpr int kHalfRows = BITS == 2 ? 512 : 256;
    uint4* rows = reinterpret_cast<uint4*>(tables);
    for (int i = tid; i < kHalfRows; i += Cfg::kThreads) {
      const int e = BITS == 2 ? i >> 1 : i;
      uint4 v;
      if constexpr (BITS == 2) {
        const uint32_t lo = pack_pair<T>(codebook[e & 3], codebook[(e >> 2) & 3]);
        const uint32_t hi = pack_pair<T>(codebook[(e >> 4) & 3], codebook[e >> 6]);
        v = make_uint4(lo, hi, lo, hi);
      } else {
        constexpr int kCode = (1 << BITS) - 1;
        const uint32_t w = pack_pair<T>(codebook[e & kCode], codebook[(e >> BITS) & kCode]);
        v = make_uint4(w, w, w, w);
      }
      uint4* half_row = rows + e * 16 + (BITS == 2 ? (i & 1) * 8 : 0);
#pragma unroll
      for (int j = 0; j < 8; ++j) half_row[(i + j) & 7] = v;
    }
  } else {
    // Consecutive threads store consecutive 16-byte vectors (4 copies of one pair), or words with fewer than 4
    // copies: each warp's store is as few wavefronts as its bytes need. One thread storing all copies of one pair put
    // a warp's 32 stores in one or two banks, which showed in the k split's time at 16 tokens.
    constexpr int kWords = Cfg::kCopies >= 4 ? 4 : 1;  // per store
    for (int i = tid; i < Cfg::kPairs * Cfg::kCopies / kWords; i += Cfg::kThreads) {
      const int e = i / (Cfg::kCopies / kWords);
      const uint32_t v = pack_pair<T>(codebook[e & ((1 << BITS) - 1)], codebook[e >> BITS]);
      if constexpr (kWords == 4) reinterpret_cast<uint4*>(tables)[i] = make_uint4(v, v, v, v);
      else reinterpret_cast<uint32_t*>(tables)[i] = v;
    }
  }
}

// A lane's lookup base: the table's (aligned) shared address OR'd with this lane's copy offset. Row tables
// (BITS = 2, 4): byte 0 = the lane's offset in a row, bytes 2..3 = the table's; compact tables: low bits = the
// lane's copy offset, the rest the table's.
template <class Cfg>
__device__ __forceinline__ uint32_t lane_select(uint32_t table, int lane) {
  constexpr int BITS = Cfg::kBits;
  uint32_t sel = table | (Cfg::kByteRows && BITS == 2 ? lane * 8u : (lane % Cfg::kCopies) * 4u);
  // Opaque to the compiler, ptxas included (an empty asm is not: ptxas saw through it): otherwise it re-derives the
  // offset from the thread index, or splits off a constant table address, inside every lookup. Every lane calls this.
  return __shfl_sync(0xffffffffu, sel, lane);
}

// Byte b of `codes` at bits 8..15, bytes 0, 2 and 3 of `sel` (lane offset, table address) around it: the
// shared address of a row-table entry in one PRMT.
__device__ __forceinline__ uint32_t byte_row_address(uint32_t codes, int b, uint32_t sel) {
  return __byte_perm(codes, sel, 0x7604u | (b << 4));
}

// Loads from 32-bit shared addresses: a C++ pointer would make ptxas add the shared window's base to
// every lookup (one IMAD per lookup).
// Not volatile, so they schedule freely: the table never changes after the CTA's __syncthreads, and every
// address depends on codes loaded (in C++) after it.
__device__ __forceinline__ uint32_t lds32(uint32_t address) {
  uint32_t v;
  asm("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(address));
  return v;
}
__device__ __forceinline__ uint2 lds64(uint32_t address) {
  uint2 v;
  asm("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(address));
  return v;
}

// Predicated 16-byte shared load into v: lanes with `active` false load nothing and keep v. A quarter-warp
// with no active lane costs the shared-memory pipe no wavefront. v is read and written ("+r"): a
// conditionally written output with no earlier value would be live from the kernel's entry for ptxas
// (64 more registers at MB = 2, spilled). Volatile: the compiler must not move it above the wait for the
// barrier that says the data landed (an asm without memory operands looks free to move).
__device__ __forceinline__ void lds128_if(bool active, uint32_t address, uint4& v) {
  asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %5, 0;\n\t@p ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n\t}\n"
      : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
      : "r"(address), "r"(static_cast<int>(active)));
}

// A 16-byte shared load from a pipeline stage. Volatile, as lds128_if: it must stay after the wait for the stage.
__device__ __forceinline__ uint4 lds128_stage(uint32_t address) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(address));
  return v;
}

// A-fragment registers of block t: h[r][j] = codebook values of columns 8j + 2q, 8j + 2q + 1 of row g + 8r,
// as a 16-bit pair (kbit/layout.py: the MMA's k order is the columns' own). w is the lane's bit string; pair
// P = 8t + 2j + r (its two codes) sits at bits 2P*BITS .. (2P+2)*BITS - 1 (BITS = 3: byte_pair_word): in the order the
// MMA's A registers take the pairs, so at BITS = 2 one 64-bit lookup yields h[0][j], h[1][j] in adjacent registers
// (with rows as the inner index the quads held both pairs of one row: register moves before every MMA).
template <class Cfg>
__device__ __forceinline__ void block_fragments(const uint32_t (&w)[4 * Cfg::kBits], int t,
                                                uint32_t sel, uint32_t (&h)[2][4]) {
  constexpr int BITS = Cfg::kBits;
  constexpr int kShift = Cfg::kCopies == 32 ? 7 : Cfg::kCopies == 16 ? 6 : Cfg::kCopies == 8 ? 5 :
                         Cfg::kCopies == 4 ? 4 : Cfg::kCopies == 2 ? 3 : 2;
  static_assert((1 << kShift) == Cfg::kCopies * 4, "copies must be a power of two");
  constexpr uint32_t kPairMask = ((1u << (2 * BITS)) - 1u) << kShift;  // compact tables: the pair's entry offset
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (Cfg::kByteRows && BITS == 2) {  // pairs 8t + 2j, 8t + 2j + 1: byte j of word t
      const uint2 v = lds64(byte_row_address(w[t], j, sel));
      h[0][j] = v.x;
      h[1][j] = v.y;
    } else {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int pair = 8 * t + 2 * j + r;
        if constexpr (BITS == 3 || BITS == 4) {  // the pair is (the low 2 * BITS bits of) byte pair % 4 of one word
          const uint32_t word = byte_pair_word<BITS>(w, pair);
          if constexpr (Cfg::kByteRows) {
            h[r][j] = lds32(byte_row_address(word, pair % 4, sel));
          } else {  // one shift moves byte pair % 4 to the entry offset's bits, one LOP3 masks and ORs
            const int down = 8 * (pair % 4) - kShift;
            h[r][j] = lds32(((down >= 0 ? word >> down : word << -down) & kPairMask) | sel);
          }
        } else {  // pair at bits [o, o + 2 * BITS): (pair << log2(copies * 4)) | lane offset
          const int o = pair * 2 * BITS, wi = o >> 5, bi = o & 31;
          const uint32_t v = bi + 2 * BITS <= 32 ? w[wi] >> bi : __funnelshift_r(w[wi], w[wi + 1], bi);
          h[r][j] = lds32(((v << kShift) & kPairMask) | sel);
        }
      }
    }
  }
}

// A block's looked-up weights h times its 16-bit scales, s_lo (row g, h[0]) and s_hi (row g + 8, h[1]) each one
// scale in both halves: one HMUL2 per register, the product rounded once, like the dequantized weights cuBLAS would
// read (wgmma, and mma.sync with GemmConfig::kScaleWeights).
template <typename T>
__device__ __forceinline__ void scale_fragments(uint32_t s_lo, uint32_t s_hi, uint32_t (&h)[2][4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) h[0][j] = mul_pair<T>(h[0][j], s_lo), h[1][j] = mul_pair<T>(h[1][j], s_hi);
}

#if KBIT_WGMMA
// The wgmma paths' A operand (here and gemm_ws.cuh): block t's looked-up weights h times each row's E4M4 block scale
// (the whole value); then, once the wgmma group that last read a register set is done, h as the A registers of the
// block's two k16 slices.
template <typename T>
__device__ __forceinline__ void apply_block_scales(uint2 scales_lo, uint2 scales_hi, int t, uint32_t (&h)[2][4]) {
  scale_fragments<T>(splat_pair<T>(e4m4_byte_to_float(t < 4 ? scales_lo.x : scales_lo.y, t & 3)),
                     splat_pair<T>(e4m4_byte_to_float(t < 4 ? scales_hi.x : scales_hi.y, t & 3)), h);
}
__device__ __forceinline__ void wgmma_a_fragments(const uint32_t (&h)[2][4], uint32_t (&a)[2][4]) {
  a[0][0] = h[0][0], a[0][1] = h[1][0], a[0][2] = h[0][1], a[0][3] = h[1][1];  // k16 slice 0: columns 8q + 0..3
  a[1][0] = h[0][2], a[1][1] = h[1][2], a[1][2] = h[0][3], a[1][3] = h[1][3];  // k16 slice 1: columns 8q + 4..7
}
#endif

// ---------------------------------------------------------------------------- shared memory layout
// Dynamic shared memory, by address:
//   [base, table)                   kSmallLow small pieces, then kCodesLow code pieces
//   [table, table + kTables)        the lookup tables, table aligned to kTableAlign
//   [table + kTables, ...)          the other code pieces, then the other small pieces
// Stage s is (codes(s), small(s)); small = the warps' scales (kAbsStage), then the activations.
template <class Cfg>
struct SmemLayout {
  uint8_t* smem;   // the dynamic base
  uint32_t table;  // shared address of the tables
  uint32_t pad;    // bytes from the dynamic base to the tables
  __device__ explicit SmemLayout(uint8_t* dynamic_smem) : smem(dynamic_smem) {
    const uint32_t base = shared_address(smem);
    table = (base + Cfg::kTableAlign - 1) & ~static_cast<uint32_t>(Cfg::kTableAlign - 1);
    pad = table - base;
  }
  __device__ uint8_t* tables() const { return smem + pad; }
  // Whether the launch gave the layout room: the host sizes it from the reserved and static shared memory. Clustered
  // (kClustered), also whether every CTA of the cluster has the first one's layout: sm_90 puts the rank in shared
  // addresses, and cluster_finish_tile reads the other CTAs' stages at this CTA's offsets.
  __device__ bool fits() const {
    uint32_t dynamic_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dynamic_bytes));
    bool as_the_first = true;
#if KBIT_BULK_COPY
    if constexpr (Cfg::kClustered) as_the_first = cluster_window_offset(table) % Cfg::kTableAlign == 0;
#endif
    return as_the_first && static_cast<int>(pad) >= Cfg::kLowBytes &&
           pad + Cfg::kTables + Cfg::kHighBytes <= dynamic_bytes;
  }
  // Offsets from the dynamic base, 32-bit: 64-bit pointers per piece cost sm_80's build spills.
  __device__ uint8_t* codes(int s) const {
    return smem + (s < Cfg::kCodesLow ? Cfg::kSmallLow * Cfg::kSmall + s * Cfg::kBStage
                                      : pad + Cfg::kTables + (s - Cfg::kCodesLow) * Cfg::kBStage);
  }
  __device__ uint8_t* small(int s) const {
    return smem + (s < Cfg::kSmallLow ? s * Cfg::kSmall
                                      : pad + Cfg::kTables + (Cfg::kStages - Cfg::kCodesLow) * Cfg::kBStage +
                                            (s - Cfg::kSmallLow) * Cfg::kSmall);
  }
};

// Position of a pipeline step in (token pass, CTA row tile, k step) order; k step = k-group, or with KS warps
// splitting k the k-groups KS * kstep ... The kernel walks its steps in order, so it advances cursors instead of
// dividing: one cursor for the copies, one for the math.
// Steps per tile: k_groups, or with KS > 1 p.k_steps (k_groups / KS rounded up). KS = 1 reads k_groups itself, the
// parameter the layout's addresses read too.
template <int KS>
__device__ __forceinline__ int steps_per_tile(const GemmParams& p) {
  return KS == 1 ? p.k_groups : p.k_steps;
}
template <int KS>
using KSplit = std::integral_constant<int, KS>;
struct StepCursor {
  int kstep, ntile, mpass;
  template <int KS = 1>
  __device__ StepCursor(const GemmParams& p, int step, KSplit<KS> = {}) {
    const int tile = step / steps_per_tile<KS>(p);
    kstep = step - tile * steps_per_tile<KS>(p);
    mpass = tile / p.n_tiles;
    ntile = tile - mpass * p.n_tiles;
  }
  template <int KS = 1>
  __device__ void advance(const GemmParams& p, KSplit<KS> = {}) {
    if (++kstep == steps_per_tile<KS>(p)) next_tile(p);
  }
  __device__ void next_tile(const GemmParams& p) {
    kstep = 0;
    if (++ntile == p.n_tiles) ntile = 0, ++mpass;
  }
  __device__ int tile(const GemmParams& p) const { return mpass * p.n_tiles + ntile; }
};

// A step's token pass: rows first .. first + rows - 1 of y (x_row says which rows of x they read), all against
// weight `expert`. One weight: pass mpass is rows mpass * MB * 8 .., weight 0. Grouped (moe.h): entry mpass of
// the routing kernel's table, refused (no rows) unless it lies inside y and the experts.
struct TokenPass {
  int first, rows, expert;
};
template <class Cfg>
__device__ __forceinline__ TokenPass token_pass(const GemmParams& p, const StepCursor& c) {
  constexpr int R = Cfg::kMB * 8;
  if constexpr (Cfg::kGrouped) {
    const auto& g = static_cast<const GroupedGemmParams&>(p);
    const int4 t = g.passes[c.mpass];
    const bool ok = t.x >= 0 && t.x < g.num_experts && t.y >= 0 && t.z >= 0 && t.z <= R && t.y <= p.M - t.z;
    return ok ? TokenPass{t.y, t.z, t.x} : TokenPass{0, 0, 0};
  } else {
    const int first = c.mpass * R;
    return {first, min(R, p.M - first), 0};
  }
}

// Where row `row` of y reads its activations: x row x_rows[row] in a grouped GEMM that gathers (clamped into x),
// else x row `row`.
template <class Cfg, typename T>
__device__ __forceinline__ const T* x_row(const GemmParams& p, int row) {
  if constexpr (Cfg::kGrouped) {
    const auto& g = static_cast<const GroupedGemmParams&>(p);
    if (g.x_rows != nullptr) row = min(max(g.x_rows[row], 0), g.x_count - 1);
  }
  return static_cast<const T*>(p.x) + static_cast<int64_t>(row) * p.lda;
}

// The cut (cut.h): one weight, the host's plan (GemmParams); grouped, grid CTAs over num_passes * n_tiles * k_steps
// steps, from the pass count the routing kernel wrote (read after grid_dependency_wait).
__device__ __forceinline__ StreamKCut cut_of(const GemmParams& p) {
  return {p.steps_per_cta, p.extra_steps, p.cut_group, p.cut_group_reciprocal, p.cut_unit};
}
template <class Cfg>
__device__ __forceinline__ StreamKCut stream_k_cut(const GemmParams& p) {
  if constexpr (Cfg::kGrouped) {
    const auto& g = static_cast<const GroupedGemmParams&>(p);
    const int total = min(max(*g.num_passes, 0), g.max_passes) * p.n_tiles * steps_per_tile<Cfg::kKSplit>(p);
    return make_cut(total, static_cast<int>(gridDim.x), static_cast<int>(gridDim.x));  // one group
  } else {
    return cut_of(p);
  }
}

// The pipeline's barriers. Stage s holds one step: the CTA tile's codes and scales, and the activations.
//   full[s]   the step's weights and activations have landed: every warp waits for it
//   empty[s]  every warp is done with the step: the stage's refill waits for it
// No CTA-wide barrier per step: the warps are tied together only as far as the pipeline is deep (with one
// __syncthreads per step every warp waited for the slowest at every step).
template <class Cfg>
struct Barriers {
  uint64_t full[Cfg::kStages];
  uint64_t empty[Cfg::kStages];
  // Lane 0 of each warp initializes every kWarps-th barrier. An mbarrier init takes a warp-uniform
  // address: one thread per barrier made ptxas serialize the 32 lanes' inits in a loop (as slow as one thread doing
  // all of them), one lane per warp runs the warps' inits in parallel.
  static constexpr int kBars = 2 * Cfg::kStages;
  __device__ void init(int warp, int lane) {
    constexpr int S = Cfg::kStages;
    // full[s] completes with one arrival per thread that copied into the stage, after its copies (cp.async),
    // and on sm_90 the issuing lane's, which announces the weights' bytes (bulk copies).
    constexpr int kActCopiers = Cfg::kActsByIssuer ? 32 : Cfg::kThreads;
    if (lane != 0) return;
    for (int i = warp; i < kBars; i += Cfg::kWarps) {
      if (i < S) mbarrier_init(&full[i], KBIT_BULK_COPY ? 1 + kActCopiers : Cfg::kThreads);
      else mbarrier_init(&empty[i - S], Cfg::kWarps);  // lane 0s
    }
  }
};

// The first layout piece (kbit.h) of step c's CTA tile in k-group `kgroup`: the tile's kTileRows / 16 pieces of that
// k-group follow it, codes and scales each one contiguous range (the tile is 16, 32, 128 or 256 rows, aligned to the
// layout's blocks of 256).
template <class Cfg>
__device__ __forceinline__ int64_t tile_piece(const GemmParams& p, const StepCursor& c, int kgroup) {
  static_assert(kLayoutNAlign % Cfg::kTileRows == 0, "a CTA tile must not straddle the layout's blocks");
  int64_t tile16 = static_cast<int64_t>(c.ntile) * (Cfg::kTileRows / kLayoutTileRows);
  if constexpr (Cfg::kGrouped)  // the pass's expert: the weights are stacked
    tile16 += static_cast<int64_t>(token_pass<Cfg>(p, c).expert) * static_cast<const GroupedGemmParams&>(p).expert_tiles16;
  return layout_piece(tile16, kgroup, p.k_groups);
}
// The piece of warp w's first row tile in step c: its kRowTiles pieces follow it, and in shared memory they sit at
// w * kRowTiles. KS = 1: the step's k-group, rows w * kRowTiles * 16 .. of the tile (so the whole tile is one range
// from warp 0's); KS > 1: the tile's rows in k-group KS * kstep + w.
template <class Cfg>
__device__ __forceinline__ int64_t warp_piece(const GemmParams& p, const StepCursor& c, int w) {
  if constexpr (Cfg::kKSplit == 1) return tile_piece<Cfg>(p, c, c.kstep) + w * Cfg::kRowTiles;
  else return tile_piece<Cfg>(p, c, Cfg::kKSplit * c.kstep + w);
}
// The k-group of warp w in step c, and whether the step has it (KS > 1: the tile's last step may have fewer).
template <class Cfg>
__device__ __forceinline__ int warp_kgroup(const StepCursor& c, int w) {
  return Cfg::kKSplit == 1 ? c.kstep : Cfg::kKSplit * c.kstep + w;
}
// Contiguous ranges of a step's weights, one per warp with KS > 1 (those of the k-groups the step has).
template <class Cfg>
__device__ __forceinline__ int weight_ranges(const GemmParams& p, const StepCursor& c) {
  return Cfg::kKSplit == 1 ? 1 : min(Cfg::kKSplit, p.k_groups - Cfg::kKSplit * c.kstep);
}
template <class Cfg>
struct WeightRange {  // bytes of one range
  static constexpr int kCodes = Cfg::kBStage / Cfg::kKSplit, kScales = Cfg::kAbsStage / Cfg::kKSplit;
};
// One step's weights: codes (kBStage bytes) and block scales (kAbsStage). sm_90: two bulk copies per range, issued
// by the one thread that calls this (per-warp copies cost every warp issue slots at every step); sm_80: every thread calls it and copies its warp's row tiles with cp.async (the caller arrives on
// `full`).
template <class Cfg>
__device__ __forceinline__ void load_weights(const GemmParams& p, uint8_t* codes_piece, uint8_t* small_piece,
                                             [[maybe_unused]] uint32_t full, const StepCursor& c) {
  constexpr int BITS = Cfg::kBits;
#if KBIT_BULK_COPY
  using R = WeightRange<Cfg>;
  const int ranges = weight_ranges<Cfg>(p, c);
  mbarrier_arrive_expect_bytes(full, ranges * (R::kCodes + R::kScales));
  for (int j = 0; j < ranges; ++j) {
    const int64_t piece = warp_piece<Cfg>(p, c, j);
    bulk_copy_to_shared(codes_piece + j * R::kCodes, p.b + piece * (BITS * 32), R::kCodes, full, Cfg::kWeightsStreamed);
    bulk_copy_to_shared(small_piece + j * R::kScales, p.absmax + piece * 128, R::kScales, full, Cfg::kWeightsStreamed);
  }
#else
  constexpr int RT = Cfg::kRowTiles;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (Cfg::kKSplit > 1 && warp_kgroup<Cfg>(c, warp) >= p.k_groups) return;
  const int64_t piece = warp_piece<Cfg>(p, c, warp);
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    const int i = warp * RT + r;
    const uint4* src = p.b + (piece + r) * (BITS * 32) + lane;
#pragma unroll
    for (int v = 0; v < BITS; ++v) cp_async16(codes_piece + i * BITS * 512 + (v * 32 + lane) * 16, src + v * 32);
    if (lane < 8) cp_async16(small_piece + i * 128 + lane * 16, p.absmax + (piece + r) * 128 + lane * 16);
  }
#endif
}

// A warp's share of one step's activations (rows past M are not copied: the MMA's token columns are
// independent, and theirs are never stored; columns past K_x are zero-filled): every row (kActsByIssuer), every row
// of its own k-group (KS > 1), or rows warp, warp + kWarps, ... The caller arrives on the stage's barrier. The two
// paths store them differently:
//   mma.sync: token row `row` at row * kXRow halves (KS > 1: warp w's k-group at 256w in it). With kXPairsTransposed, each
//     block of 32 columns has its 4 x 4 pieces of 4 bytes transposed, so that lane q's four column pairs
//     8p + 2q (p = 0..3, its A fragment's k order) sit side by side at 8q: one 16-byte load per lane and block;
//     4 copies of 4 bytes per lane and row, lane l copying pairs l, l + 32, ... (32 pieces of 128 contiguous
//     bytes, and 32 different banks in shared memory). Otherwise in natural order: one 16-byte copy per lane
//     and row (ldmatrix does the transposition).
//   wgmma: the tensor cores' K-major layout without swizzle: token n, columns 8c .. 8c + 7 at
//     (n / 8) * 4096 + c * 128 + (n % 8) * 16 bytes (8 x 8 core matrices, 128 B apart along k). Lane l copies
//     token l % 8 of each 8-token group it copies, chunks l / 8 + 4i: 16-byte copies, each instruction filling 4
//     whole core matrices.
template <class Cfg, typename T>
__device__ __forceinline__ void load_activations(const GemmParams& p, uint8_t* small_piece, const StepCursor& c) {
  constexpr int MB = Cfg::kMB;
  constexpr bool kEveryRow = Cfg::kActsByIssuer || Cfg::kKSplit > 1;
  constexpr int kStride = kEveryRow ? 1 : Cfg::kWarps;  // rows (token groups) between a warp's copies
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, first_row = kEveryRow ? 0 : warp;
  const int kgroup = warp_kgroup<Cfg>(c, warp);
  if (Cfg::kKSplit > 1 && kgroup >= p.k_groups) return;
  const T* x = static_cast<const T*>(p.x);
  uint8_t* xs = small_piece + Cfg::kAbsStage + (Cfg::kKSplit > 1 ? warp * kKGroup * 2 : 0);
  const TokenPass pass = token_pass<Cfg>(p, c);
  const int rows = pass.rows, kcol0 = kgroup * kKGroup;
  if constexpr (Cfg::kWgmma) {
    const int n = lane & 7;
#pragma unroll
    for (int group = first_row; group < MB; group += kStride) {
      if (group * 8 + n >= rows) continue;
      const T* src = x_row<Cfg, T>(p, pass.first + group * 8 + n) + kcol0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int chunk = (lane >> 3) + 4 * i;
        const bool ok = kcol0 + chunk * 8 < p.K_x;
        cp_async16(xs + group * 4096 + chunk * 128 + n * 16, ok ? src + chunk * 8 : x, ok ? 16 : 0);
      }
    }
  } else {
#pragma unroll
    for (int row = first_row; row < MB * 8; row += kStride) {
      if (row >= rows) break;
      const T* src = x_row<Cfg, T>(p, pass.first + row) + kcol0;
      if constexpr (Cfg::kXPairsTransposed) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int piece = 32 * u + lane, t = piece >> 4, p4 = (piece >> 2) & 3, q = piece & 3;
          const int col = 32 * t + 8 * p4 + 2 * q;  // pair p4 of lane q in block t
          const bool ok = kcol0 + col < p.K_x;
          cp_async4(xs + (row * Cfg::kXRow + 32 * t + 8 * q + 2 * p4) * 2, ok ? src + col : x, ok ? 4 : 0);
        }
      } else {
        const int col = 8 * lane;
        const bool ok = kcol0 + col < p.K_x;
        cp_async16(xs + (row * Cfg::kXRow + col) * 2, ok ? src + col : x, ok ? 16 : 0);
      }
    }
  }
}

// Block columns (GemmConfig::kBlockColumns): the first 128 bytes of every stage's token row 1 zero, the activations
// of the lanes whose column is not the block's (compute_step). Once per CTA; with one token nothing else writes there.
template <class Cfg>
__device__ __forceinline__ void clear_block_columns(const SmemLayout<Cfg>& layout) {
  const int s = threadIdx.x / 8, v = threadIdx.x % 8;
  static_assert(Cfg::kStages * 8 <= Cfg::kThreads, "one 16-byte store per thread");
  if (s < Cfg::kStages)
    reinterpret_cast<uint4*>(layout.small(s) + Cfg::kAbsStage + Cfg::kXRow * 2)[v] = make_uint4(0u, 0u, 0u, 0u);
}

// One warp's codes (its bit string, kbit/layout.py) and E4M4 block scales of one step's row tile r:
// scales_lo = row g's 8 blocks, scales_hi = row g + 8's. tid: the thread index (compute_step's).
template <class Cfg>
__device__ __forceinline__ void load_tile_codes(const uint8_t* codes_piece, const uint8_t* small_piece, int r,
                                                uint32_t (&w)[4 * Cfg::kBits], uint2& scales_lo, uint2& scales_hi,
                                                uint32_t tid) {
  constexpr int BITS = Cfg::kBits, RT = Cfg::kRowTiles;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2;
  const uint4* bv = reinterpret_cast<const uint4*>(codes_piece) + (warp * RT + r) * BITS * 32 + lane;
  const uint8_t* ab = small_piece + (warp * RT + r) * 128;
#pragma unroll
  for (int v = 0; v < BITS; ++v) {
    const uint4 t = bv[v * 32];
    w[4 * v] = t.x; w[4 * v + 1] = t.y; w[4 * v + 2] = t.z; w[4 * v + 3] = t.w;
  }
  scales_lo = *reinterpret_cast<const uint2*>(ab + g * 8);
  scales_hi = *reinterpret_cast<const uint2*>(ab + 64 + g * 8);
}

// One warp, one step: its row tiles (16 weight rows each) x 256 k against MB*8 tokens, accumulated into acc
// (fragment r * MB + mb). Token rows at or past x_rows (the rows this pass has) are stale: they reach only
// their own output columns (the MMA's columns are independent), and those are never stored. With transposed
// pairs (MB = 1) those rows are not even loaded: at M = 1 only lanes 0..3 load activations, one wavefront per 16-byte
// load instead of four (with block columns the others load zeros, still one wavefront, and the step's scales follow
// its 16 MMAs). Otherwise one ldmatrix per token tile and block: lane l points at token
// l % 8, columns 8 * (l / 8) .. + 7 of the block, so register i is the B fragment of k-step i / 2, half i % 2.
// tid: the thread index (gemm_main's math_tid).
template <class Cfg, typename T>
__device__ __forceinline__ void compute_step(const uint8_t* codes_piece, const uint8_t* small_piece, uint32_t sel,
                                             int x_rows, float (&acc)[Cfg::kFrags][4], uint32_t tid) {
  constexpr int BITS = Cfg::kBits, MB = Cfg::kMB;
  constexpr int RT = Cfg::kRowTiles;
  const int lane = tid & 31, g = lane >> 2, q = lane & 3;
  uint32_t w[RT][4 * BITS];
  uint2 scales_lo[RT], scales_hi[RT];
#pragma unroll
  for (int r = 0; r < RT; ++r) load_tile_codes<Cfg>(codes_piece, small_piece, r, w[r], scales_lo[r], scales_hi[r], tid);
  constexpr int XR = Cfg::kXRow;
  const int xk = Cfg::kKSplit > 1 ? (tid >> 5) * kKGroup : 0;  // the warp's k-group in the token rows
  const int x_row = Cfg::kBlockColumns ? 0 : g;  // block columns: row 0 or 1 per block (below)
  const uint32_t xs = shared_address(small_piece + Cfg::kAbsStage) +
                      (xk + (Cfg::kXPairsTransposed ? x_row * XR + 8 * q : (lane & 7) * XR + 8 * (lane >> 3))) * 2;
  uint4 xv[MB] = {};  // per token tile, reloaded per block
  float2 block_scales_lo[RT], block_scales_hi[RT];
  uint32_t scale_pairs_lo[RT], scale_pairs_hi[RT];  // kScaleWeights: blocks t, t + 1 as a 16-bit pair
  float block_sums[RT][2][4] = {};  // block columns: a step's sums, column n = block n, block t in accumulator t % 2

#pragma unroll
  for (int t = 0; t < 8; ++t) {
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) {
      const uint32_t at = xs + (mb * 8 * XR + t * 32) * 2;
      // Block columns: the lanes of column t the token's activations (row 0), the others 64 zero bytes of row 1 in the
      // other bank half (64 bytes apart modulo 128): the warp's load is one wavefront.
      if constexpr (Cfg::kBlockColumns) xv[mb] = lds128_stage(xs + (g == t ? t * 32 : XR + 32 * (t & 1)) * 2);
      else if constexpr (Cfg::kXPairsTransposed) lds128_if(mb * 8 + g < x_rows, at, xv[mb]);
      else ldmatrix_x4(at, xv[mb]);
    }
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      uint32_t h[2][4];
      block_fragments<Cfg>(w[r], t, sel, h);
      if constexpr (Cfg::kScaleWeights) {  // rows g and g + 8 times block t's scales (GemmConfig::kScaleWeights)
        if (t % 2 == 0) {
          scale_pairs_lo[r] = e4m4_pair_bits<T>(t < 4 ? scales_lo[r].x : scales_lo[r].y, t & 3);
          scale_pairs_hi[r] = e4m4_pair_bits<T>(t < 4 ? scales_hi[r].x : scales_hi[r].y, t & 3);
        }
        scale_fragments<T>(splat_half(scale_pairs_lo[r], t % 2), splat_half(scale_pairs_hi[r], t % 2), h);
      }
      const uint32_t a0[4] = {h[0][0], h[1][0], h[0][1], h[1][1]};  // k-step 0: columns 8q + 0..3
      const uint32_t a1[4] = {h[0][2], h[1][2], h[0][3], h[1][3]};  // k-step 1: columns 8q + 4..7
      if constexpr (Cfg::kBlockColumns) {  // block t's sums into column t (the other columns' activations are 0)
        mma_16816<T>(block_sums[r][t % 2], a0, xv[0].x, xv[0].y);
        mma_16816<T>(block_sums[r][t % 2], a1, xv[0].z, xv[0].w);
      } else if constexpr (Cfg::kScaleWeights) {
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) {
          mma_16816<T>(acc[r * MB + mb], a0, xv[mb].x, xv[mb].y);
          mma_16816<T>(acc[r * MB + mb], a1, xv[mb].z, xv[mb].w);
        }
      } else {
        if (t % 2 == 0) {  // blocks t and t + 1 of rows g and g + 8, in sixteenths (GemmConfig::kAccScale)
          block_scales_lo[r] = e4m4_pair_to_float_sixteenths(t < 4 ? scales_lo[r].x : scales_lo[r].y, t & 3);
          block_scales_hi[r] = e4m4_pair_to_float_sixteenths(t < 4 ? scales_hi[r].x : scales_hi[r].y, t & 3);
        }
        const float s_lo = t % 2 ? block_scales_lo[r].y : block_scales_lo[r].x;
        const float s_hi = t % 2 ? block_scales_hi[r].y : block_scales_hi[r].x;
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) {
          // One block of 32 columns in unit scale, then its E4M4 scale in fp32: accumulator rows are weight
          // rows (g: d0, d1; g + 8: d2, d3), so each row takes its own block scale, rounded exactly once.
          float blk[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          mma_16816<T>(blk, a0, xv[mb].x, xv[mb].y);
          mma_16816<T>(blk, a1, xv[mb].z, xv[mb].w);
          float (&d)[4] = acc[r * MB + mb];
          d[0] = fmaf(blk[0], s_lo, d[0]);
          d[1] = fmaf(blk[1], s_lo, d[1]);
          d[2] = fmaf(blk[2], s_hi, d[2]);
          d[3] = fmaf(blk[3], s_hi, d[3]);
        }
      }
    }
  }
  if constexpr (Cfg::kBlockColumns) {
    // Lane q's columns are blocks 2q (even: accumulator 0) and 2q + 1 (odd: 1), of rows g (sums 0, 1) and g + 8 (2, 3).
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      const float2 s_lo = e4m4_pair_to_float_sixteenths(q < 2 ? scales_lo[r].x : scales_lo[r].y, 2 * (q & 1));
      const float2 s_hi = e4m4_pair_to_float_sixteenths(q < 2 ? scales_hi[r].x : scales_hi[r].y, 2 * (q & 1));
      const float(&u)[2][4] = block_sums[r];
      float (&d)[4] = acc[r];
      d[0] = fmaf(u[1][1], s_lo.y, fmaf(u[0][0], s_lo.x, d[0]));
      d[2] = fmaf(u[1][3], s_hi.y, fmaf(u[0][2], s_hi.x, d[2]));
    }
  }
}

// Block columns: each lane's row sums (accumulators 0 and 2: token 0 of rows g and g + 8) over its two blocks per
// step, added across the quad's lanes, so that every lane holds the tile's token column as an 8-token tile would.
template <class Cfg>
__device__ __forceinline__ void sum_block_columns(float (&acc)[Cfg::kFrags][4]) {
#pragma unroll
  for (int f = 0; f < Cfg::kFrags; ++f) {
#pragma unroll
    for (int i = 0; i < 4; i += 2) {
      acc[f][i] += __shfl_xor_sync(0xffffffffu, acc[f][i], 1);
      acc[f][i] += __shfl_xor_sync(0xffffffffu, acc[f][i], 2);
    }
  }
}

#if KBIT_WGMMA
// One warp's part of one warpgroup step: per row tile, its 16 weight rows x 256 k, through 16 wgmmas (8 blocks
// x 2 k-steps) of the warpgroup's 64 rows against MB*8 tokens, accumulated into acc (row tile r: fragments
// r * MB .., the D fragments of those tokens). Each block's E4M4 scales multiply the looked-up weights in 16 bits
// before the MMA (the product rounded once, like the dequantized weights cuBLAS would read). One group of two
// wgmmas per (row tile, block); its A fragments are built while the previous group runs: two register sets,
// each rewritten once the group before the previous one is done (8 registers each: next to 2 x 64
// accumulators at 128 tokens, the A fragments or codes of a whole step would spill).
template <class Cfg, typename T>
__device__ __forceinline__ void compute_step_wgmma(const uint8_t* codes_piece, const uint8_t* small_piece, uint32_t sel,
                                                   float (&acc)[Cfg::kFrags][4]) {
  constexpr int BITS = Cfg::kBits, MB = Cfg::kMB, RT = Cfg::kRowTiles;
  // Block t, k-step s: columns 32t + 16s .. + 15, core matrices 4t + 2s and 4t + 2s + 1.
  const uint64_t desc = wgmma_descriptor(shared_address(small_piece + Cfg::kAbsStage), 128, 4096);
  fence_accumulators(acc);
  uint32_t a[2][2][4];  // [group % 2][k-step]
#pragma unroll
  for (int r = 0; r < RT; ++r) {  // row tiles one after the other: one tile's codes in registers at a time
    uint32_t w[4 * BITS];
    uint2 scales_lo, scales_hi;
    load_tile_codes<Cfg>(codes_piece, small_piece, r, w, scales_lo, scales_hi, threadIdx.x);
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const int group = r * 8 + t;
      uint32_t h[2][4];
      block_fragments<Cfg>(w, t, sel, h);
      apply_block_scales<T>(scales_lo, scales_hi, t, h);
      if (group >= 2) wgmma_wait<1>();  // group - 2 is done with a[group % 2]
      uint32_t (&ag)[2][4] = a[group % 2];
      wgmma_a_fragments(h, ag);
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < 2; ++s)
        Wgmma<MB * 8>::template run<T>(reinterpret_cast<float (&)[MB][4]>(acc[r * MB]), ag[s], desc + (4 * t + 2 * s) * 8);
      wgmma_commit();
    }
  }
  wgmma_wait<0>();
  fence_accumulators(acc);
}
#endif

// A finished tile of the grouped GEMM: row m of the pass is row first + m of y, times its expert's scale, then
// (Store) times the row's routing weight, or (SiluGate) silu(gate) * up of the lane's gate row g and up row g + 8
// (kbit/grouped.py: rows interleaved by 8) into column 8 * tile16 + g of y's N / 2 columns, in fp32, rounded once.
template <class Cfg, typename T>
__device__ __forceinline__ void store_tile_grouped(const GemmParams& p, const StepCursor& c,
                                                   const float (&acc)[Cfg::kFrags][4]) {
  constexpr int MB = Cfg::kMB;
  const auto& grouped = static_cast<const GroupedGemmParams&>(p);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const TokenPass pass = token_pass<Cfg>(p, c);
  const float s = p.scale[pass.expert] * Cfg::kAccScale;
  T* y = static_cast<T*>(p.y);
#pragma unroll
  for (int r = 0; r < Cfg::kRowTiles; ++r) {
    const int tile16 = c.ntile * (Cfg::kTileRows / 16) + warp * Cfg::kRowTiles + r;
    const int n = tile16 * 16 + g;  // this lane's rows n and n + 8
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) {
      const float (&d)[4] = acc[r * MB + mb];
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // token 2q + e: d[e] in row n, d[2 + e] in row n + 8
        const int m = mb * 8 + 2 * q + e;
        if (m >= pass.rows) continue;
        const int64_t row = pass.first + m;
        if constexpr (Cfg::kEpilogue == GroupedEpilogue::SiluGate) {
          const float gate = d[e] * s, up = d[2 + e] * s;
          if (n < p.N) y[row * (p.N / 2) + tile16 * 8 + g] = from_float<T>(gate / (1.0f + __expf(-gate)) * up);
        } else {
          const float w = grouped.row_weights != nullptr ? grouped.row_weights[row] : 1.0f;
          if (n < p.N) y[row * p.N + n] = from_float<T>(d[e] * s * w);
          if (n + 8 < p.N) y[row * p.N + n + 8] = from_float<T>(d[2 + e] * s * w);
        }
      }
    }
  }
}

// A finished tile into y. s: the per-tensor scale times kAccScale (loaded before the main loop); with row_scales
// (GemmParams) the scale of the tile's 256-row block (a CTA tile, 16 to 256 rows, lies in one) times the same
// kAccScale: the one product a launch of that block's projection alone makes.
template <class Cfg, typename T>
__device__ __forceinline__ void store_tile(const GemmParams& p, const StepCursor& c, float s,
                                           const float (&acc)[Cfg::kFrags][4]) {
  if constexpr (Cfg::kGrouped) {
    store_tile_grouped<Cfg, T>(p, c, acc);
    return;
  }
  static_assert(kLayoutNAlign % Cfg::kTileRows == 0, "a CTA tile lies in one 256-row block");
  if (p.row_scales) s = p.scale[c.ntile * Cfg::kTileRows / kLayoutNAlign] * Cfg::kAccScale;
  constexpr int MB = Cfg::kMB;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const T* bias = static_cast<const T*>(p.bias);
  T* y = static_cast<T*>(p.y);
#pragma unroll
  for (int r = 0; r < Cfg::kRowTiles; ++r) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int n = c.ntile * Cfg::kTileRows + (warp * Cfg::kRowTiles + r) * 16 + g + 8 * (i >> 1);
      if (n >= p.N) continue;
      const float b = bias ? to_float(bias[n]) : 0.0f;
#pragma unroll
      for (int mb = 0; mb < MB; ++mb) {
        const int m = c.mpass * MB * 8 + mb * 8 + 2 * q + (i & 1);
        if (m < p.M) y[static_cast<int64_t>(m) * p.N + n] = from_float<T>(acc[r * MB + mb][i] * s + b);
      }
    }
  }
}

// The host's cut (GemmParams), on the device; kGroups = false in this file's kernels, whose cut is one group.
template <bool kGroups = true>
__device__ __forceinline__ StepRange steps_of(const GemmParams& p, int b) {
  return steps_of<kGroups>(cut_of(p), b);
}
template <bool kGroups = true>
__device__ __forceinline__ int cta_of_step(const GemmParams& p, int s) {
  return cta_of_step<kGroups>(cut_of(p), s);
}

// Where warp w parks this lane's accumulator fragment f in a stage (gather_k_split, cluster_finish_tile): in the warp's
// own codes of the stage (RT * BITS * 512 bytes, >= the kFrags * 512 it needs), which no other warp reads.
template <class Cfg>
__device__ __forceinline__ float4* parked_fragment(uint8_t* codes_piece, int w, int f) {
  constexpr int kWarpBytes = Cfg::kRowTiles * Cfg::kBits * 512;
  static_assert(Cfg::kFrags * 512 <= kWarpBytes, "a warp's accumulators must fit in its codes");
  return reinterpret_cast<float4*>(codes_piece + w * kWarpBytes) + f * 32 + (threadIdx.x & 31);
}

// KS > 1, the last step of a tile in this CTA's range, after every warp's math: the warps' sums (each of its own
// k-groups) into warp 0's accumulators, added in warp order. Each warp parks its accumulators in its own codes of
// the stage (parked_fragment; the warp read them at the step's start), the warps meet once, warp 0 adds. Every warp
// arrives on the stage's empty barrier after this, warp 0 after its reads, so the stage is not refilled under them.
// Warp 0 then finishes the tile alone (finish_tile), as the only warp of its row tiles.
template <class Cfg>
__device__ __forceinline__ void gather_k_split(uint8_t* codes_piece, float (&acc)[Cfg::kFrags][4]) {
  const int warp = threadIdx.x >> 5;
  auto parked = [&](int w, int f) { return parked_fragment<Cfg>(codes_piece, w, f); };
  __syncwarp();  // every lane of the warp has read its codes
  if (warp != 0) {
#pragma unroll
    for (int f = 0; f < Cfg::kFrags; ++f) *parked(warp, f) = make_float4(acc[f][0], acc[f][1], acc[f][2], acc[f][3]);
#if KBIT_BULK_COPY
    fence_proxy_async_shared();  // ordered before the stage's next bulk copy (the async proxy) writes there
#endif
  }
  __syncthreads();
  if (warp == 0) {
    for (int w = 1; w < Cfg::kWarps; ++w) {
#pragma unroll
      for (int f = 0; f < Cfg::kFrags; ++f) {
        const float4 v = *parked(w, f);
        acc[f][0] += v.x, acc[f][1] += v.y, acc[f][2] += v.z, acc[f][3] += v.w;
      }
    }
  }
}

// The tile of step c ends here for this CTA: store it, or, when other CTAs hold parts of its k range, either
// publish this CTA's partial (it does not hold the tile's first k-group) or reduce the others' into its own.
// A CTA publishes at most one partial: only its first tile can have begun before its range (one slot each).
// No counters and no fences: the workspace holds kPartialEmpty in every word before the launch, a partial's
// words are results of arithmetic (never that NaN), so each word the reducer loads says whether it has landed;
// the reducer puts kPartialEmpty back for the next launch. The reducer reaches its part at the end of its
// range; a contributor whose range starts in the tile published long before, one whose whole range lies in
// the tile publishes at its end too: then the wait is one L2 hand-off (a store landing and a poll). "The last to
// arrive reduces" had cost a store, fence and counter round trip more.
template <class Cfg, typename T>
__device__ __forceinline__ void finish_tile(const GemmParams& p, const StepCursor& c, int first, int last,
                                            float out_scale, float (&acc)[Cfg::kFrags][4]) {
  constexpr int MB = Cfg::kMB;
  constexpr int F = Cfg::kFrags;
  const int tile = c.tile(p);
  const int k_steps = steps_per_tile<Cfg::kKSplit>(p);
  const int tile_first = tile * k_steps, tile_last = tile_first + k_steps - 1;
  const bool holds_first = tile_first >= first, holds_last = tile_last < last;
  if (holds_first && holds_last) {
    store_tile<Cfg, T>(p, c, out_scale, acc);
    return;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  auto partial = [&](int cta) {
    return p.partials + static_cast<int64_t>(cta) * Cfg::kPartialFloats + (warp * F * 32 + lane) * 4;
  };
  // Fragment f (token tile f % MB) of this lane holds tokens 2q, 2q + 1 of its tile: only those below M are
  // ever stored, so only they move (at M = 1, a quarter of the lanes: the reducer's polls are 4x smaller).
  // Not at MB >= 4 (M > 16, mostly full tiles), whose builds spill with the extra predicates.
  const int lane_rows = token_pass<Cfg>(p, c).rows - 2 * (lane & 3);  // the pass's rows from the lane's first token
  auto live = [&](int f) { return MB >= 4 || (f % MB) * 8 < lane_rows; };
  if (!holds_first) {
    float* mine = partial(blockIdx.x);
#pragma unroll
    for (int f = 0; f < F; ++f)
      if (live(f)) st_relaxed_gpu(mine + f * 128, make_float4(acc[f][0], acc[f][1], acc[f][2], acc[f][3]));
    return;
  }
  // CTAs blockIdx.x + 1 ...
  const int others = cta_of_step<false>(stream_k_cut<Cfg>(p), tile_last) - static_cast<int>(blockIdx.x);
  // Contributors in flight at once, up to 8 fragments of each: one L2 round trip per batch, not per partial (a
  // tile of a small GEMM has ~8). At most 16 fragments (64 registers); one partial at a time at 8 or more
  // fragments per warp and on sm_80, and 2 fragments at a time next to 32 accumulator fragments (wgmma, 128
  // tokens), whose builds spill with more. The sums build up in acc itself (a copy would spill there too),
  // each fragment adding its partials in CTA order whatever the batches.
  constexpr int kInFlight = KBIT_BULK_COPY && F < 8 ? 16 / F : 1;
  constexpr int kBatch = F < 8 ? F : F < 32 ? 8 : 2;
  const float empty = __uint_as_float(kPartialEmpty);
  for (int j0 = 1; j0 <= others; j0 += kInFlight) {
#pragma unroll
    for (int f0 = 0; f0 < F; f0 += kBatch) {
      float4 v[kInFlight][kBatch];
      bool landed;
      do {
        landed = true;
#pragma unroll
        for (int i = 0; i < kInFlight; ++i)
#pragma unroll
          for (int f = 0; f < kBatch; ++f)
            if (j0 + i <= others && live(f0 + f)) v[i][f] = ld_relaxed_gpu(partial(blockIdx.x + j0 + i) + (f0 + f) * 128);
#pragma unroll
        for (int i = 0; i < kInFlight; ++i)
#pragma unroll
          for (int f = 0; f < kBatch; ++f) {
            const uint32_t e = kPartialEmpty;
            if (j0 + i <= others && live(f0 + f))
              landed &= __float_as_uint(v[i][f].x) != e && __float_as_uint(v[i][f].y) != e &&
                        __float_as_uint(v[i][f].z) != e && __float_as_uint(v[i][f].w) != e;
          }
        // Not yet: wait a little before asking L2 again; every poll moves the whole batch (up to 64 KB per CTA).
        if (!landed) __nanosleep(128);
      } while (!landed);
#pragma unroll
      for (int i = 0; i < kInFlight; ++i)
        if (j0 + i <= others) {
#pragma unroll
          for (int f = 0; f < kBatch; ++f) {
            if (!live(f0 + f)) continue;
            float (&d)[4] = acc[f0 + f];
            d[0] += v[i][f].x, d[1] += v[i][f].y, d[2] += v[i][f].z, d[3] += v[i][f].w;
            st_relaxed_gpu(partial(blockIdx.x + j0 + i) + (f0 + f) * 128, make_float4(empty, empty, empty, empty));
          }
        }
    }
  }
  store_tile<Cfg, T>(p, c, out_scale, acc);
}

// Clustered (GemmConfig::kClustered): this CTA's range is one part of one tile, and the tile's parts run as one
// thread-block cluster, rank r holding the r-th (rank 0 the tile's first k-steps: the grouped cut of cut.h, a group per
// tile). The parts meet in shared memory instead of L2: every other rank parks its sums in its own stage 0
// (parked_fragment; once its range is done no copy is in flight into its stages), a cluster barrier, rank 0 loads them
// through distributed shared memory and adds them in rank order to its own (deterministic, as finish_tile's CTA order),
// a second barrier keeps every CTA, and so its shared memory, alive until rank 0 has loaded them; rank 0 stores the
// tile meanwhile. No polling, no workspace. Only the warps that hold sums (every warp; warp 0 alone with the k split)
// and only the fragments of the pass's tokens (finish_tile's `live`) move. Every thread takes part in both barriers.
template <class Cfg, typename T>
__device__ __forceinline__ void cluster_finish_tile(const GemmParams& p, const StepCursor& c, uint8_t* stage_codes,
                                                    float out_scale, float (&acc)[Cfg::kFrags][4]) {
#if KBIT_BULK_COPY
  constexpr int MB = Cfg::kMB, F = Cfg::kFrags;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ranks = static_cast<int>(cluster_ctas()), rank = static_cast<int>(cluster_rank());
  const bool holds_sums = Cfg::kKSplit == 1 || warp == 0;
  const int lane_rows = token_pass<Cfg>(p, c).rows - 2 * (lane & 3);  // the pass's rows from the lane's first token
  auto live = [&](int f) { return (f % MB) * 8 < lane_rows; };
  if (rank != 0 && holds_sums) {
#pragma unroll
    for (int f = 0; f < F; ++f)
      if (live(f)) *parked_fragment<Cfg>(stage_codes, warp, f) = make_float4(acc[f][0], acc[f][1], acc[f][2], acc[f][3]);
  }
  __syncwarp();
  cluster_sync();  // every part parked
  if (rank == 0 && holds_sums) {
    // Fragment f of rank r at the address fragment f of this CTA has, in rank r's window (SmemLayout::fits).
    const uint32_t parked = shared_address(parked_fragment<Cfg>(stage_codes, warp, 0));
    // The ranks whose parts are loaded at once: up to 16 fragments in flight (64 registers), one round trip for all
    // seven other parts at two fragments per warp.
    constexpr int kInFlight = 16 / F;
    for (int r0 = 1; r0 < ranks; r0 += kInFlight) {
      float4 v[kInFlight][F];
#pragma unroll
      for (int i = 0; i < kInFlight; ++i)
#pragma unroll
        for (int f = 0; f < F; ++f)
          if (r0 + i < ranks && live(f)) v[i][f] = ld_cluster(parked + f * 512, r0 + i);
#pragma unroll
      for (int i = 0; i < kInFlight; ++i)
#pragma unroll
        for (int f = 0; f < F; ++f)
          if (r0 + i < ranks && live(f)) {
            float (&d)[4] = acc[f];
            d[0] += v[i][f].x, d[1] += v[i][f].y, d[2] += v[i][f].z, d[3] += v[i][f].w;
          }
    }
  }
  __syncwarp();
  cluster_arrive();  // rank 0 has loaded the parts
  if (rank == 0 && holds_sums) store_tile<Cfg, T>(p, c, out_scale, acc);
  __syncwarp();
  cluster_wait();  // no CTA leaves before then
#else
  __trap();  // clusters: sm_90; the host never launches this configuration elsewhere
#endif
}

template <class Cfg, typename T>
__device__ __forceinline__ void gemm_main(const GemmParams& p) {
  constexpr int BITS = Cfg::kBits;
  constexpr int S = Cfg::kStages;
  using Split = KSplit<Cfg::kKSplit>;  // the cursors' steps per tile
  extern __shared__ __align__(16) uint8_t smem[];
  const SmemLayout<Cfg> layout(smem);
  if (threadIdx.x == 0 && !layout.fits()) __trap();  // host and kernel disagree on the layout: a bug
  __shared__ Barriers<Cfg> bars;

  // The grouped kernel's once the passes are known (below); clustered, the host's cut in a group per tile.
  StepRange range = steps_of<Cfg::kClustered>(p, blockIdx.x);
  int first = range.first, last = range.last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  bars.init(warp, lane);
  mbarrier_init_fence();
  // The barriers' shared addresses, once (mbarrier_arrive); opaque, or the compiler re-derives them per use.
  uint32_t full0 = shared_address(bars.full), empty0 = shared_address(bars.empty);
  asm volatile("" : "+r"(full0), "+r"(empty0));
  auto full = [&](int s) { return full0 + 8u * s; };
  auto empty = [&](int s) { return empty0 + 8u * s; };
  // One step's copies into stage s. Its weights: on sm_90 two bulk copies by lane 0 of the issuing warp (the
  // warps take turns step by step), on sm_80 every thread copies its warp's share, into its warp's own region.
  // Its activations: the issuing warp (kActsByIssuer) or every warp. Every thread that copied arrives on full[s]
  // once, after its last copy.
  static_assert((Cfg::kWarps & (Cfg::kWarps - 1)) == 0, "the issuing warp is a step number modulo kWarps");
  auto issues = [&](int step) { return warp == (step & (Cfg::kWarps - 1)); };
  auto copy_weights = [&](int s, const StepCursor& at, bool issuer) {
    if (!KBIT_BULK_COPY || (issuer && lane == 0)) load_weights<Cfg>(p, layout.codes(s), layout.small(s), full(s), at);
    if (!KBIT_BULK_COPY && Cfg::kActsByIssuer && !issuer) mbarrier_arrive_after_cp_async(full(s));  // done copying
  };
  auto copy_activations = [&](int s, const StepCursor& at) {
    load_activations<Cfg, T>(p, layout.small(s), at);
    mbarrier_arrive_after_cp_async(full(s));
  };
  // The codebook times kTableFactor (GemmConfig::kScaleWeights: the scales' 16-bit unit undone in the table).
  auto load_codebook = [&] {
    return threadIdx.x < (1 << BITS) ? p.codebook[threadIdx.x] * Cfg::template kTableFactor<T> : 0.0f;
  };

  // Launched early (programmatic dependent launch), the CTA fetches while the previous kernel drains what that kernel
  // cannot be writing. Settled weights (GemmParams): the codebook, and where the grid leaves SMs idle (GridRoom) the
  // first steps' weights into their stages: those CTAs start while the previous kernel still runs. S - 1 steps below
  // the SM count; every stage (S steps, the loop's first refill included) where the grid takes at most half the SMs,
  // as every CTA then starts early (on grids of more CTAs the S-th copy made k = 5 slower). Where every SM is taken
  // they start in that kernel's tail, and the same copies made the calls slower than prefetches into L2
  // (docs/PERFORMANCE.md, "Measured choices"). Otherwise the weights go into L2 only, which needs no settling. A
  // grouped GEMM's steps are not known before the wait. In a normal launch nothing overlaps, and the prefetches cost
  // only the TMA unit's time.
  const bool early_weights = KBIT_BULK_COPY && p.dependent_launch && p.weights_settled;
  const int copied_early = !early_weights || p.grid_room == GridRoom::kFull || Cfg::kGrouped ? 0
                           : p.grid_room == GridRoom::kHalfOrLess ? S : S - 1;  // steps whose weights go before the wait
  float code_value = 0.0f;
  if (early_weights) code_value = load_codebook();
  {
    StepCursor at(p, first, Split{});
    for (int s = 0; s < copied_early && first + s < last; ++s, at.advance(p, Split{})) copy_weights(s, at, issues(s));
  }
#if KBIT_BULK_COPY
  if (!Cfg::kGrouped && copied_early == 0 && p.dependent_launch && threadIdx.x == 0) {
    StepCursor at(p, first, Split{});
    for (int s = 0; s < S - 1 && first + s < last; ++s, at.advance(p, Split{})) {
      for (int j = 0; j < weight_ranges<Cfg>(p, at); ++j) {
        const int64_t i = warp_piece<Cfg>(p, at, j);
        prefetch_l2(p.b + i * (BITS * 32), WeightRange<Cfg>::kCodes);
        prefetch_l2(p.absmax + i * 128, WeightRange<Cfg>::kScales);
      }
    }
  }
#endif
  // The tables too where the whole grid starts beside the previous one (as gemm_ws.cuh does with settled weights), so
  // that after the wait only the activations remain; on grids of more CTAs, which start in the previous kernel's
  // tail, tables built before the wait made the calls slower (docs/PERFORMANCE.md, "Measured choices").
  const bool tables_early = copied_early == S;
  if (tables_early) build_tables<Cfg, T>(code_value, layout.tables());
  if constexpr (Cfg::kBlockColumns) clear_block_columns<Cfg>(layout);  // seen by every warp after the tables' barrier
  grid_dependency_wait();
  allow_dependent_launch();
  if constexpr (Cfg::kGrouped) {  // the routing kernel has written the passes: the step range is known now
    const StreamKCut cut = stream_k_cut<Cfg>(p);
    range = steps_of<false>(cut, blockIdx.x);
    first = range.first, last = range.last;
    if (first == last) return;
  }
  // Loaded now, not in the epilogue: there it would add a global round trip to the kernel's end.
  const float out_scale = *p.scale * Cfg::kAccScale;

  // The codebook first (see build_tables), then the first step's copies, then the tables while those
  // land, then the rest of the pipeline's copies. With all S - 1 copies issued before the tables, the
  // tables waited for the issuing threads, held back by DRAM (all SMs fill their pipelines at once), and the
  // first step started long after its data had landed.
  if (!early_weights) code_value = load_codebook();
  StepCursor load_at(p, first, Split{});
  for (int s = 0; s < S - 1 && first + s < last; ++s, load_at.advance(p, Split{})) {  // every CTA has a step 0
    if (s >= copied_early) copy_weights(s, load_at, issues(s));
    if (!Cfg::kActsByIssuer || issues(s)) copy_activations(s, load_at);
    if (s == 0 && !tables_early) build_tables<Cfg, T>(code_value, layout.tables());
  }
  const uint32_t sel = lane_select<Cfg>(layout.table, lane);
  // The thread index compute_step reads. With kScaleWeights (fewer live registers) ptxas re-read it and recomputed the
  // lane's shared addresses in every step (8-15 instructions of 570-1260); a shuffle's result it keeps.
  const uint32_t math_tid = Cfg::kScaleWeights ? __shfl_sync(0xffffffffu, threadIdx.x, lane) : threadIdx.x;
  __syncthreads();  // tables complete

  float acc[Cfg::kFrags][4] = {};
  StepCursor c(p, first, Split{});
  int slot = 0;         // stage of this step
  uint32_t phase = 0;   // parity of this step's use of its stage
  for (int step = first; step < last;) {
    // The steps of one tile (its k-groups in this CTA's range), then the tile's end.
    const int tile_end = min(last, step + steps_per_tile<Cfg::kKSplit>(p) - c.kstep);
    const int rows = token_pass<Cfg>(p, c).rows;
    for (; step < tile_end; ++step) {
      // Step + S - 1 goes into the stage of step - 1 once every warp is done with it: its weights now, its
      // activations after this step's math (the issuing warp had waited; every warp waits, mostly no longer by
      // then), or with 2 stages now (after the math they would have no step to land in). The issuing warp copies
      // after arriving on empty[slot]: the next step's issuer waits for that arrival, not for its copies.
      const int refill = slot == 0 ? S - 1 : slot - 1;
      const bool more = step + S - 1 < last, issuer = issues(step);
      auto wait_refill_empty = [&] {
        if (step > first) mbarrier_wait(empty(refill), slot == 0 ? phase ^ 1u : phase);
      };
      if (more) {
        if (issuer) wait_refill_empty();
        if (step + S - 1 >= first + copied_early) copy_weights(refill, load_at, issuer);
        if (!Cfg::kActsByIssuer && S == 2) wait_refill_empty(), copy_activations(refill, load_at);
      }

      mbarrier_wait(full(slot), phase);
#if KBIT_WGMMA
      if constexpr (Cfg::kWgmma) {
        fence_proxy_async_shared();  // the activations landed through cp.async: visible to the tensor cores now
        compute_step_wgmma<Cfg, T>(layout.codes(slot), layout.small(slot), sel, acc);
      } else
#endif
      {
        if (Cfg::kKSplit == 1 || warp_kgroup<Cfg>(c, warp) < p.k_groups)
          compute_step<Cfg, T>(layout.codes(slot), layout.small(slot), sel, rows, acc, math_tid);
        if constexpr (Cfg::kKSplit > 1) {
          if (step + 1 == tile_end) gather_k_split<Cfg>(layout.codes(slot), acc);
        }
      }
      __syncwarp();
      if (lane == 0) mbarrier_arrive(empty(slot));

      if (more && (Cfg::kActsByIssuer ? issuer : S > 2)) {
        if (!Cfg::kActsByIssuer) wait_refill_empty();
        copy_activations(refill, load_at);
      }
      if (more) load_at.advance(p, Split{});
      if (++slot == S) slot = 0, phase ^= 1u;
      // The math cursor's k step gives the warps their k-groups (KS > 1); the tile's end moves it (next_tile).
      if (Cfg::kKSplit > 1 && step + 1 < tile_end) c.kstep++;
    }
    if (Cfg::kKSplit == 1 || warp == 0) {
      if constexpr (Cfg::kBlockColumns) sum_block_columns<Cfg>(acc);
      if constexpr (!Cfg::kClustered) finish_tile<Cfg, T>(p, c, first, last, out_scale, acc);
    }
    if constexpr (Cfg::kClustered) {  // the range's one tile, its parts summed in the cluster
      cluster_finish_tile<Cfg, T>(p, c, layout.codes(0), out_scale, acc);
    } else {
#pragma unroll
      for (int f = 0; f < Cfg::kFrags; ++f) acc[f][0] = acc[f][1] = acc[f][2] = acc[f][3] = 0.0f;
      c.next_tile(p);
    }
  }
}

template <class Cfg, typename T>
__global__ void __launch_bounds__(Cfg::kThreads, 1) gemm_kernel(const typename Cfg::Params p) {
#if defined(__CUDA_ARCH__)
  // What a GPU cannot run is built as a trap, and the host never launches it there: wgmma needs sm_90a, and
  // sm_80-class GPUs get what fits their shared memory (GemmConfig::kOnSm80).
  constexpr bool kBuilt = Cfg::kWgmma ? KBIT_WGMMA == 1 : __CUDA_ARCH__ >= 900 || Cfg::kOnSm80;
  if constexpr (!kBuilt) {
    __trap();
  } else
#endif
  {
    gemm_main<Cfg, T>(p);
  }
}

// Host side: launch one configuration (instantiated per bit width in gemm_k{2,3,4,5}.cu).
// Dynamic shared memory of a launch: up to the aligned table address (which depends on the reserved and
// static shared memory below the dynamic base), the tables, and the pieces above them.
template <class Cfg, typename T>
cudaError_t gemm_dynamic_smem(int& bytes) {
  int base = 0;
  const cudaError_t err = dynamic_smem_base(gemm_kernel<Cfg, T>, base);
  if (err != cudaSuccess) return err;
  const int pad = (Cfg::kTableAlign - base % Cfg::kTableAlign) % Cfg::kTableAlign;
  if (pad < Cfg::kLowBytes) return cudaErrorInvalidConfiguration;
  bytes = pad + Cfg::kTables + Cfg::kHighBytes;
  return cudaFuncSetAttribute(gemm_kernel<Cfg, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

// The launch attribute of 1-D clusters of `ctas` CTAs.
inline cudaLaunchAttribute cluster_attribute(int ctas) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = ctas, attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
  return attribute;
}

// How many clusters of `ctas` CTAs of Kernel's launch `config` the device runs at once: each cluster's CTAs share a
// GPC, one CTA per SM, so the GPCs' sizes decide. The driver is asked once per device and cluster size.
template <auto Kernel>
int clusters_at_once(int ctas, int clusters, cudaLaunchConfig_t config) {
  static std::atomic<int> most[kMaxDevices][kMaxClusterCtas + 1];  // clusters at once + 1; 0: not asked yet
  int device = 0;
  if (ctas < 1 || ctas > kMaxClusterCtas || cudaGetDevice(&device) != cudaSuccess || device < 0 ||
      device >= kMaxDevices)
    return 0;
  int known = most[device][ctas].load(std::memory_order_relaxed);
  if (known == 0) {
    cudaLaunchAttribute attribute = cluster_attribute(ctas);
    config.gridDim = dim3(ctas * clusters);
    config.attrs = &attribute;
    config.numAttrs = 1;
    int at_once = 0;
    if (cudaOccupancyMaxActiveClusters(&at_once, Kernel, &config) != cudaSuccess) {
      (void)cudaGetLastError();  // the query's error is not the launch's
      at_once = 0;
    }
    known = at_once + 1;
    most[device][ctas].store(known, std::memory_order_relaxed);
  }
  return known - 1;
}

// Programmatic dependent launch where the host asked for it (GemmParams::dependent_launch); clustered
// (GemmConfig::kClustered), the tiles' parts as clusters of cut_group CTAs, the two attributes side by side. A cluster's
// CTAs start together, so its barriers need no more; clusters the GPU cannot hold all at once run in waves, and one it
// cannot hold at all is refused.
template <class Cfg, typename T>
cudaError_t launch_gemm(const GemmParams& p, cudaStream_t stream) {
  int smem_bytes = 0;
  const cudaError_t attr = setup_once_per_device<gemm_dynamic_smem<Cfg, T>>(smem_bytes);
  if (attr != cudaSuccess) return attr;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(p.grid);
  config.blockDim = dim3(Cfg::kThreads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attributes[2]{};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  attributes[1] = cluster_attribute(p.cut_group);
  if (Cfg::kClustered && (p.grid % p.cut_group != 0 ||
                          clusters_at_once<gemm_kernel<Cfg, T>>(p.cut_group, p.grid / p.cut_group, config) < 1))
    return cudaErrorInvalidClusterSize;
  config.attrs = p.dependent_launch ? attributes : attributes + 1;
  config.numAttrs = (p.dependent_launch ? 1 : 0) + (Cfg::kClustered ? 1 : 0);
  return cudaLaunchKernelEx(&config, gemm_kernel<Cfg, T>, static_cast<const typename Cfg::Params&>(p));
}

// The configurations built, per bit width and dtype: mma.sync with 8, 16 or 32 tokens per pass, and with 8 or 16
// tokens the warps splitting 32- or 16-row tiles' k-groups; wgmma with 64 tokens and 256-row tiles, or 128 tokens
// and 128- or 256-row tiles (not 256 at BITS = 5: no room). kbit/planner.py picks among them (gemm.cu reports them:
// gemm_configs).
constexpr int gemm_config_key(int mb, int wgmma_tiles, int k_split = 1) {
  return (k_split > 1 ? 1024 : 0) + wgmma_tiles * 32 + mb;
}
// Calls f(GemmConfig<BITS, mb, wgmma_tiles, 0, k_split>{}) if that configuration is built; returns whether it is. The
// one list of configurations, for the launcher and for the host's report (gemm.cu).
template <int BITS, typename F>
bool with_gemm_config(int mb, int wgmma_tiles, int k_split, F&& f) {
  if (k_split != 1 && k_split != kGemmWarps) return false;
  switch (gemm_config_key(mb, wgmma_tiles, k_split)) {
    case gemm_config_key(1, 0): f(GemmConfig<BITS, 1, 0>{}); return true;
    case gemm_config_key(1, 0, kGemmWarps): f(GemmConfig<BITS, 1, 0, 0, kGemmWarps>{}); return true;
    case gemm_config_key(2, 0): f(GemmConfig<BITS, 2, 0>{}); return true;
    case gemm_config_key(2, 0, kGemmWarps): f(GemmConfig<BITS, 2, 0, 0, kGemmWarps>{}); return true;
    case gemm_config_key(4, 0): f(GemmConfig<BITS, 4, 0>{}); return true;
    case gemm_config_key(8, 2): f(GemmConfig<BITS, 8, 2>{}); return true;
    case gemm_config_key(16, 1): f(GemmConfig<BITS, 16, 1>{}); return true;
    case gemm_config_key(16, 2):
      if constexpr (BITS != 5) {
        f(GemmConfig<BITS, 16, 2>{});
        return true;
      }
      return false;
    default: return false;
  }
}
// Up to 16 tokens, with the same plan and shared memory as the configuration the host chose: tiles cut in parts
// (ClusterUse::kRequired, gemm_plan) run clustered (GemmConfig::kClustered), never streamed evict-first, which keeps
// split-K partials in L2 that clusters do not have; without the k split, weights larger than L2 stream evict-first
// (GemmConfig::kWeightsStreamed); one token on 8-token tiles runs with block columns (GemmConfig::kBlockColumns),
// clustered or not. Not block columns at BITS = 5, which they made slower where BITS = 2..4 gained
// (docs/PERFORMANCE.md, "Measured choices").
template <int BITS, typename T>
cudaError_t launch_gemm_mb(const GemmParams& p, cudaStream_t stream) {
  cudaError_t err = cudaErrorInvalidValue;
  with_gemm_config<BITS>(p.mb, p.wgmma_tiles, p.k_split, [&](auto cfg) {
    using Cfg = decltype(cfg);
    if constexpr (!Cfg::kWgmma && Cfg::kMB <= 2) {
      if (p.clusters == ClusterUse::kRequired) {
        using Clustered = GemmConfig<BITS, Cfg::kMB, 0, 0, Cfg::kKSplit, false, false, true>;
        static_assert(Clustered::kSmemTotal == Cfg::kSmemTotal && Clustered::kStages == Cfg::kStages, "one plan");
        if constexpr (Cfg::kMB == 1 && Cfg::kKSplit == 1 && BITS <= 4) {
          if (p.M == 1) {
            err = launch_gemm<GemmConfig<BITS, 1, 0, 0, 1, true, false, true>, T>(p, stream);
            return;
          }
        }
        err = launch_gemm<Clustered, T>(p, stream);
        return;
      }
    }
    if constexpr (!Cfg::kWgmma && Cfg::kKSplit == 1 && Cfg::kMB <= 2) {
      using Streamed = GemmConfig<Cfg::kBits, Cfg::kMB, 0, 0, 1, false, true>;
      static_assert(Streamed::kSmemTotal == Cfg::kSmemTotal && Streamed::kStages == Cfg::kStages, "one plan");
      if constexpr (Cfg::kMB == 1 && BITS <= 4) {
        using OneToken = GemmConfig<Cfg::kBits, 1, 0, 0, 1, true>;
        using OneTokenStreamed = GemmConfig<Cfg::kBits, 1, 0, 0, 1, true, true>;
        static_assert(OneToken::kSmemTotal == Cfg::kSmemTotal && OneToken::kStages == Cfg::kStages, "one plan");
        if (p.M == 1) {
          err = p.weights_stream ? launch_gemm<OneTokenStreamed, T>(p, stream) : launch_gemm<OneToken, T>(p, stream);
          return;
        }
      }
      if (p.weights_stream) {
        err = launch_gemm<Streamed, T>(p, stream);
        return;
      }
    }
    err = launch_gemm<Cfg, T>(p, stream);
  });
  return err;
}

// Explicit list of instantiations, one file per bit width so ninja builds them in parallel.
#define KBIT_INSTANTIATE_GEMM(BITS)                                                                 \
  template <>                                                                                    \
  cudaError_t gemm_for_bits<BITS>(const GemmParams& p, cudaStream_t stream) {                       \
    return p.dtype == DType::BF16 ? launch_gemm_mb<BITS, __nv_bfloat16>(p, stream)                  \
                                  : launch_gemm_mb<BITS, __half>(p, stream);                        \
  }

template <int BITS>
cudaError_t gemm_for_bits(const GemmParams& p, cudaStream_t stream);

int gemm_smem_bytes(int k, int mb, int wgmma_tiles);  // of GemmConfig<k, mb, wgmma_tiles> (no k split)
bool gemm_on_sm80(int k, int mb, int wgmma_tiles);

}  // namespace kbit
