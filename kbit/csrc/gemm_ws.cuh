// The warp-specialized fused dequantize + GEMM (sm_90a): y[M, N] = x[M, K] @ W_hat[N, K]^T for 17+ tokens, from
// the same GEMM layout as gemm.cuh (kbit/layout.py).
//
// Reads top to bottom:
//   WsConfig            compile-time sizes of one configuration (BITS per weight, tokens per tile NT)
//   ws_producer         one thread: per step, TMA copies of the activations and bulk copies of the weights into
//                       the next free stage of the ring
//   ws_store_by_copy    a whole tile's sums into y through shared memory and the tensor copy engine
//   ws_publish          a tile other CTAs hold k-groups of: this CTA's partial sum, published
//   ws_lead_reduce      a tile split few ways: the CTA holding its first k-group adds the others' partials
//   ws_reduce_slice     a tile split many ways: each of its CTAs adds every partial of one slice of it
//   ws_cluster_reduce   a tile cut in parts that run as one cluster: the slices summed in the CTAs' shared memory
//   ws_consumer         a consumer warpgroup's main loop: dequantize block t + 1 while block t's wgmmas run
//                       (block_fragments of gemm.cuh, block scales applied in 16 bits)
//   gemm_ws_kernel      the entry point: roles by warpgroup, registers moved to the consumers
//   launch_gemm_ws      host side: the activations' and the output's tensor maps, the clusters, the launch
//
// Roles. Warpgroup 0 is the producer: one thread issues every copy, the warpgroup gives its registers back
// (setmaxnreg) and does nothing else. The others are consumers, four (two at 256 tokens): each owns 64 weight rows of
// the CTA's tile (an m64 block, one 16-row tile per warp), turns their codes into
// wgmma's register-sourced A operand (swap-AB: weights are A, tokens are wgmma's N), and multiplies them by
// the NT tokens the tensor cores read from shared memory. Nothing but the mbarriers of the stage ring ties the
// consumers to the producer, so copies, dequantization and tensor-core work overlap; the consumer
// warpgroups interleave on the tensor cores. Compared with gemm.cuh's wgmma path (every warp copies and
// dequantizes, 8 warps at 255 registers, activations by per-thread cp.async: issue slots mostly idle at
// M = 64-128), the copies cost the consumers nothing and the activations arrive as whole
// 128-byte rows.
//
// Work: as in gemm.cuh, a step is (token pass, CTA tile of 256 rows, 128 at 256 tokens, 256-column k-group); the
// total step range is cut into `grid` contiguous pieces (stream-K). A tile split between CTAs is summed by the CTA
// holding its first k-group, or, split many ways, in slices by all of them, or, where its parts run as one cluster,
// in slices through the cluster's shared memory (the end of a tile, below).

#pragma once

#include <cuda.h>  // CUtensorMap
#include <cudaTypedefs.h>

#include "gemm.cuh"

namespace kbit {

// Tokens per tile NT: 32, 64, 128 or 256 (the planner picks, kbit/planner.py; past NT tokens, more passes).
// GROUPS: consumer warpgroups of one m64 block each, the CTA tile 64 * GROUPS rows. Four by default: four consumer
// warps per scheduler hide the dequantization's latencies (docs/PERFORMANCE.md, "Measured choices"). At 256 tokens a
// warpgroup's accumulators are 128 registers per thread, so two, at 240: a looked-up weight then serves twice the
// tokens. Two below 256 tokens too (128-row tiles: wgmma_tiles = 1 in the host's key): twice the default's tiles,
// so a tile is split half as many ways (N = 4096: 16 tiles for 132 SMs) and its partial sums are half the bytes.
template <int BITS, int NT, int GROUPS = (NT == 256 ? 2 : 4)>
struct WsConfig {
  static constexpr int kBits = BITS, kTokens = NT;
  static constexpr int kConsumerGroups = GROUPS;
  static_assert(GROUPS == 2 || (GROUPS == 4 && NT < 256), "two or four consumer warpgroups (two at 256 tokens)");
  static constexpr int kConsumerWarps = 4 * kConsumerGroups;
  static constexpr int kThreads = 128 * (1 + kConsumerGroups);  // warpgroup 0: the producer
  static constexpr int kTileRows = 64 * kConsumerGroups;        // weight rows per CTA tile
  static constexpr int kTile16s = kTileRows / 16;               // 16-row tiles of the GEMM layout per CTA tile
  static constexpr bool kGrouped = false;
  static constexpr int kFrags = NT / 8;  // wgmma D fragments (8 tokens each) per consumer warp
  // setmaxnreg: the registers allocated at launch (per thread, a multiple of 8, for kThreads threads in 64K) are
  // shared out again: the producer keeps setmaxnreg's least, 24, the consumers the rest (112).
  static constexpr int kLaunchRegisters = 65536 / kThreads / 8 * 8;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters =
      (kLaunchRegisters + (kLaunchRegisters - kProducerRegisters) / kConsumerGroups) / 8 * 8;
  static_assert(kConsumerRegisters <= 240 && 128 * kProducerRegisters + 128 * kConsumerGroups * kConsumerRegisters <=
                                                 kThreads * kLaunchRegisters, "setmaxnreg shares out the launch's registers");
  // One stage = one step, two pieces: the activations (NT tokens x 256 k, four TMA boxes of 64 k, 128-byte swizzled
  // rows) and the weights (the tile's codes, 512*BITS B per 16-row tile, then its E4M4 block scales, 128 B per tile: two
  // bulk copies). Every piece starts 1024-byte aligned (the swizzle atoms).
  // At 256 tokens (kBoxRing) a step's activations are 128 KB, two stages do not fit: the boxes have a ring of their
  // own (kBoxes slots of one box, each with its barriers), and a stage is the step's weights. So at 128 tokens for
  // k = 5, whose two 107 KB stages left 8 KB, 2 lane copies, for its pair table: 6 boxes of 16 KB beside two weight
  // stages leave it 32 KB, 8 copies (faster at 80-128 tokens; docs/PERFORMANCE.md, "Measured choices").
  static constexpr bool kBoxRing = NT == 256 || (BITS == 5 && NT == 128);
  static constexpr int kXBox = NT * 128;
  static constexpr int kXBytes = kBoxRing ? 0 : 4 * kXBox;  // a stage's activations
  static constexpr int kCodeBytes = BITS * 512;
  static constexpr int kScalesOffset = kTile16s * kCodeBytes;  // in the weights piece
  static constexpr int kWeightBytes = kScalesOffset + kTile16s * 128;
  static constexpr int kStageBytes = kXBytes + kWeightBytes;  // what a stage's full barrier waits for
  static_assert(kXBox % 1024 == 0 && kWeightBytes % 1024 == 0, "stage pieces must stay 1024-byte aligned");
  // The lookup table sits at a constant shared address aligned to its size, as high in the shared window as that
  // allows; a lookup address is then one instruction (block_fragments in gemm.cuh). The pieces fill the space from
  // the dynamic base (after at most kStaticSmemMax of static shared memory) up to the table: every stage's
  // activations, then the weights of as many stages as fit there; the other stages' weights lie above the table, and
  // where that leaves too little room below, the last stages' activations after them (WsRing).
  //   Byte rows (BITS 2..4, 64 KB at 128 KB; build_tables): a table address is one PRMT of a code byte, every lookup one
  //     wavefront. Where two stages fit beside them: at 32 and 64 tokens (faster than the compact table with a stage
  //     more; docs/PERFORMANCE.md, "Measured choices").
  //   Otherwise the compact pair table (kCopies lane copies of each pair's two codebook values, just below the top):
  //     a table address is a shift and a LOP3. As many lane copies (at most 32, one per bank) as leave two stages
  //     beside it: with c copies 32 / c lanes share each copy's banks, and a lookup takes ~1, 2, 3 wavefronts at 32,
  //     16, 8 copies; the lookups' conflicts cost more than a third stage (docs/PERFORMANCE.md, "Measured
  //     choices"). Conflict-free single-code lookups (32 entries x 32 copies, two lookups and a PRMT per pair) take
  //     half again the instructions and were no faster.
  //   On the ring of boxes the compact pair table, below the top, with as many lane copies as leave room for 5 boxes
  //     and two stages of weights beneath it (256 tokens: k = 2, 3 32 copies, 6 and 5 boxes; k = 4 16, k = 5 4, 5
  //     boxes; k = 5 at 128 tokens: 8 copies, 6 boxes).
  static constexpr int kPairs = 1 << (2 * BITS);
  static constexpr int kByteRowBytes = 256 * 256;
  static constexpr int kStagesFrom = (kReservedSmem + kStaticSmemMax + 1023) / 1024 * 1024;  // latest start
  static constexpr int table_address(int bytes) { return (kSharedTop - bytes) / bytes * bytes; }
  // Below a table of `table` bytes: the activations of xs stages, then the weights of weights_below; above it, the
  // other stages' weights, then their activations. x_below: the most xs that leaves the rest room (-1: none does).
  static constexpr int weights_below(int table, int stages, int xs) {
    const int room = (table_address(table) - kStagesFrom - xs * kXBytes) / kWeightBytes;
    return room < stages ? room : stages;
  }
  static constexpr bool fits_with(int table, int stages, int xs) {
    return xs * kXBytes <= table_address(table) - kStagesFrom &&
           (stages - weights_below(table, stages, xs)) * kWeightBytes + (stages - xs) * kXBytes <=
               kSharedTop - table_address(table) - table;
  }
  static constexpr int x_below(int table, int stages) {
    int x = stages;
    while (x >= 0 && !fits_with(table, stages, x)) --x;
    return x;
  }
  static constexpr bool fits(int table, int stages) { return x_below(table, stages) >= 0; }
  static constexpr int stages_with(int table) {  // the most stages that fit beside a table (at most 4)
    return fits(table, 4) ? 4 : fits(table, 3) ? 3 : fits(table, 2) ? 2 : fits(table, 1) ? 1 : 0;
  }
  static constexpr int kRingStages = 2;  // kBoxRing: stages of weights
  static constexpr int boxes_with(int table) {  // kBoxRing: the boxes that fit below a table (at most 8)
    const int room = (table_address(table) - kStagesFrom - kRingStages * kWeightBytes) / kXBox;
    return room < 8 ? room : 8;
  }
  static constexpr bool kByteRows = !kBoxRing && BITS <= 4 && stages_with(kByteRowBytes) >= 2;
  static constexpr int pick_copies(int c) {  // from c down, the most copies that leave two stages
    return c == 1 || stages_with(kPairs * c * 4) >= 2 ? c : pick_copies(c / 2);
  }
  static constexpr int pick_box_copies(int c) {  // kBoxRing: the most copies that leave 5 boxes
    return c == 1 || boxes_with(kPairs * c * 4) >= 5 ? c : pick_box_copies(c / 2);
  }
  // byte rows: a lane's word in a row (lane_select)
  static constexpr int kCopies = kByteRows ? 32 : kBoxRing ? pick_box_copies(32) : pick_copies(32);
  static constexpr int kTables = kByteRows ? kByteRowBytes : kPairs * kCopies * 4;
  static constexpr int kStages = kBoxRing ? kRingStages : stages_with(kTables);
  static constexpr int kTableAddress = table_address(kTables);
  static constexpr int kBoxes = kBoxRing ? boxes_with(kTables) : 4 * kStages;  // box slots (tied to stages below 256)
  static constexpr int kXBelow = kBoxRing ? kStages : x_below(kTables, kStages);  // stages' activations below
  static constexpr int kXBelowBytes = kBoxRing ? kBoxes * kXBox : kXBelow * kXBytes;
  static constexpr int kWeightsBelow = kBoxRing ? kStages : weights_below(kTables, kStages, kXBelow);
  static constexpr int kBelowBytes = kXBelowBytes + kWeightsBelow * kWeightBytes;  // from the ring's base
  static constexpr int kWeightsAboveBytes = (kStages - kWeightsBelow) * kWeightBytes;  // from the table's end
  static constexpr int kAboveBytes = kWeightsAboveBytes + (kStages - kXBelow) * kXBytes;
  static_assert(kStages >= 2 && kBoxes >= 4, "a ring needs two stages and room for a step's four boxes");
  static_assert(kStagesFrom + kBelowBytes <= kTableAddress && kTableAddress + kTables + kAboveBytes <= kSharedTop,
                "the ring's pieces fit below and above the table");
  // Shared memory per CTA, static included, for the largest static part allowed: what the plan checks.
  static constexpr int kSmemTotal = kTableAddress + kTables + kAboveBytes - kReservedSmem;
  // A whole tile's sums leave through shared memory (ws_store_by_copy), each consumer warp's 16 rows in pieces of
  // kStoreTokens tokens, 32 B per token, as many as the tile's last activations hold: its stage's (one piece per
  // warp: NT tokens), or on the ring of boxes its step's last box (256 tokens: two rounds of 128; 128: four of 32).
  static constexpr int kStoreTokensFit = (kBoxRing ? kXBox : kXBytes) / (kConsumerWarps * 32);
  static constexpr int kStoreTokens = kStoreTokensFit < NT ? kStoreTokensFit : NT;
  static_assert(NT % kStoreTokens == 0 && kStoreTokens % 16 == 0 && kStoreTokens <= 256,
                "whole rounds of stmatrix_x4_trans (16 tokens) and tensor-store boxes (at most 256)");
  // Split-K: one partial output tile per slot, two slots per CTA (ws_reduce_slice).
  static constexpr int kTilePartialFloats = kTileRows * NT;
  static constexpr int kPartialFloats = 2 * kTilePartialFloats;
};

// ---------------------------------------------------------------------------- the stage ring
// Where stage s's pieces lie (WsConfig): the activations of the first kXBelow stages (every stage's where they fit)
// from the ring's base, then the weights of the first kWeightsBelow stages;
// from the table's end, kept as a 32-bit offset from the base (a second pointer live in the consumers' loop would take
// registers the 128-token build does not have), the other stages' weights, then the other stages' activations.
template <class Cfg>
struct WsRing {
  uint8_t* base;   // 1024-byte aligned, below the table
  uint32_t above;  // the table's end, from base
  __device__ uint8_t* x(int s) const {  // off the ring of boxes: stage s's boxes
    if constexpr (Cfg::kXBelow == Cfg::kStages) return base + s * Cfg::kXBytes;
    return base + (s < Cfg::kXBelow ? s * Cfg::kXBytes
                                    : above + Cfg::kWeightsAboveBytes + (s - Cfg::kXBelow) * Cfg::kXBytes);
  }
  __device__ uint8_t* box(int b) const { return base + b * Cfg::kXBox; }  // kBoxRing: box slot b
  __device__ uint8_t* weights(int s) const {
    constexpr int kBelowFrom = Cfg::kXBelowBytes;
    if constexpr (Cfg::kWeightsBelow == Cfg::kStages) return base + kBelowFrom + s * Cfg::kWeightBytes;
    return base + (s < Cfg::kWeightsBelow ? kBelowFrom + s * Cfg::kWeightBytes
                                          : above + (s - Cfg::kWeightsBelow) * Cfg::kWeightBytes);
  }
};

// The activations' tensor maps (ws_activation_map): boxes of NT tokens, and for a last pass that NT do not fill, boxes
// of its tokens (ws_copy_box; never read where NT divide M). One parameter: the producer, at 24 registers, holds one
// address for both.
struct WsActivationMaps {
  CUtensorMap whole, tail;
};
constexpr int kZeroRowBytes = 255 * 128;  // the most a box of 256 tokens needs
static __device__ uint4 ws_zero_rows[kZeroRowBytes / 16];  // never written: zeros from the launch of the module

// ---------------------------------------------------------------------------- the producer
#if KBIT_WGMMA
// The activations of a pass whose tokens do not fill it (M % NT of them, the last pass): each box holds only those
// rows of x (WsActivationMaps::tail), and its other rows are copied from ws_zero_rows. A box mostly past x's last
// row, filled with zeros by the tensor copy engine, is much slower than the same box read whole; rows left as the
// slot held them (any activations) cost more than zeros (the tensor cores' power; docs/PERFORMANCE.md, "Measured
// choices").
template <class Cfg>
__device__ __forceinline__ void ws_copy_box(const GemmParams& p, void* box, const WsActivationMaps* x_maps, int k0,
                                            int m0, uint64_t* bar) {
  const int rows = p.M - m0;
  if (rows >= Cfg::kTokens) return tensor_copy_2d_to_shared(box, &x_maps->whole, k0, m0, bar);
  static_assert(Cfg::kXBox - 128 <= kZeroRowBytes, "zero rows for every box");
  tensor_copy_2d_to_shared(box, &x_maps->tail, k0, m0, bar);
  bulk_copy_to_shared(static_cast<uint8_t*>(box) + rows * 128, ws_zero_rows, Cfg::kXBox - rows * 128, bar);
}

// A step's weights into their piece of its stage; the stage's bytes were announced on its full barrier first
// (kStageBytes: the stage completes once its activations have landed too).
// Weights read once and larger than L2 (GemmParams::weights_stream) go evict-first, as in gemm.cuh
// (GemmConfig::kWeightsStreamed), chosen at run time: only the producer thread's code has the branch.
template <class Cfg>
__device__ __forceinline__ void ws_copy_weights(const GemmParams& p, uint8_t* weights, uint64_t* bar,
                                                const StepCursor& c) {
  const int64_t piece = tile_piece<Cfg>(p, c, c.kstep);
  bulk_copy_to_shared(weights, p.b + piece * (Cfg::kBits * 32), Cfg::kTile16s * Cfg::kCodeBytes, bar, p.weights_stream);
  bulk_copy_to_shared(weights + Cfg::kScalesOffset, p.absmax + piece * 128, Cfg::kTile16s * 128, bar, p.weights_stream);
}

// Settled weights (GemmParams) where the grid leaves SMs idle: the first steps' bytes announced on their full
// barriers and their weights copied into their stages by the producer thread before it waits for the previous kernel
// (the 2048-column shapes gained). Issued before the CTA's wait, the same copies made ptxas compile the consumers'
// loop with a tenth more instructions; inside ws_producer, past the registers it gives back, they spilled. Returns how many steps it copied.
template <class Cfg>
__device__ __forceinline__ int ws_copy_first_weights(const GemmParams& p, const WsRing<Cfg>& ring, uint64_t* full,
                                                     int first, int last) {
  const int copied = min(Cfg::kStages, last - first);
  StepCursor c(p, first);
  for (int s = 0; s < copied; ++s, c.advance(p)) {
    mbarrier_arrive_expect_bytes(&full[s], Cfg::kStageBytes);
    ws_copy_weights<Cfg>(p, ring.weights(s), &full[s], c);
  }
  return copied;
}

// The producer thread. Stage s is free again once all 8 consumer warps have arrived on empty[s]; full[s] completes
// when its bytes (kStageBytes; columns of a box past x's arrive as zeros and count, rows: ws_copy_box) have landed.
// The n-th use of a stage waits for the (n-1)-th completion of its empty barrier. A step's bytes are announced first,
// then its activations and its weights are copied; the first `copied` steps' weights are in flight already
// (ws_copy_first_weights). On the ring of boxes (kBoxRing) the step's weights go first, then each box into the next
// free slot of the boxes' ring, announced on that slot's own full barrier; box_empty[b] counts every consumer thread.
template <class Cfg>
__device__ __forceinline__ void ws_producer(const GemmParams& p, const WsActivationMaps* x_maps,
                                            const WsRing<Cfg>& ring, uint64_t* full, uint64_t* empty,
                                            uint64_t* box_full, uint64_t* box_empty, int first, int last, int copied) {
  constexpr int S = Cfg::kStages, B = Cfg::kBoxes;
  StepCursor c(p, first);
  int slot = 0, box_slot = 0;
  uint32_t phase = 0, box_phase = 0;
  for (int step = first; step < last; ++step, c.advance(p)) {
    if (step - first >= S) mbarrier_wait(&empty[slot], phase ^ 1u);
    uint64_t* bar = &full[slot];
    const bool weights_copied = step - first < copied;
    if (!weights_copied) mbarrier_arrive_expect_bytes(bar, Cfg::kStageBytes);
    const int k0 = c.kstep * kKGroup, m0 = c.mpass * Cfg::kTokens;
    if constexpr (Cfg::kBoxRing) {
      if (!weights_copied) ws_copy_weights<Cfg>(p, ring.weights(slot), bar, c);
#pragma unroll 1
      for (int box = 0; box < 4; ++box) {
        if (4 * (step - first) + box >= B) mbarrier_wait(&box_empty[box_slot], box_phase ^ 1u);
        mbarrier_arrive_expect_bytes(&box_full[box_slot], Cfg::kXBox);
        ws_copy_box<Cfg>(p, ring.box(box_slot), x_maps, k0 + 64 * box, m0, &box_full[box_slot]);
        if (++box_slot == B) box_slot = 0, box_phase ^= 1u;
      }
    } else {
      uint8_t* x = ring.x(slot);
#pragma unroll 1  // unrolled, the four boxes' copies spilled the producer's 24 registers
      for (int box = 0; box < 4; ++box)
        ws_copy_box<Cfg>(p, x + box * Cfg::kXBox, x_maps, k0 + 64 * box, m0, bar);
      if (!weights_copied) ws_copy_weights<Cfg>(p, ring.weights(slot), bar, c);
    }
    if (++slot == S) slot = 0, phase ^= 1u;
  }
}

#endif  // KBIT_WGMMA

// ---------------------------------------------------------------------------- the end of a tile
// The bias of output row n: 0 without a bias (nullptr) and past N.
template <typename T>
__device__ __forceinline__ float ws_row_bias(const T* bias, int N, int n) {
  return bias && n < N ? to_float(bias[n]) : 0.0f;
}

// The output scale of row tile ntile: the per-tensor one (s), or with row_scales (GemmParams) that of the 256-row block
// it lies in (fused projections: kbit/fusion.py).
template <class Cfg>
__device__ __forceinline__ float ws_tile_scale(const GemmParams& p, float s, int ntile) {
  static_assert(kLayoutNAlign % Cfg::kTileRows == 0, "a CTA tile lies in one 256-row block");
  return p.row_scales ? p.scale[ntile * Cfg::kTileRows / kLayoutNAlign] : s;
}

// One D fragment's four sums (rows n[0], n[1] = g, g + 8 of a 16-row tile, tokens m, m + 1: common.cuh) into y,
// scaled and biased, where they lie inside it.
template <typename T>
__device__ __forceinline__ void ws_store_fragment(const GemmParams& p, const int (&n)[2], const float (&bn)[2], int m,
                                                  float s, const float (&v)[4]) {
  T* y = static_cast<T*>(p.y);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if (m + e >= p.M) continue;
    T* row = y + static_cast<int64_t>(m + e) * p.N;
#pragma unroll
    for (int half = 0; half < 2; ++half)
      if (n[half] < p.N) row[n[half]] = from_float<T>(v[2 * half + e] * s + bn[half]);
  }
}

// acc[j] is the D fragment of this warp's 16-row tile `tile16`, tokens 8j ..: rows g and g + 8, tokens 2q and 2q + 1.
// Token rows outermost: one row address live at a time (all 2F of them at once, 64-bit each, spilled at 128
// tokens next to the accumulators).
template <class Cfg, typename T>
__device__ __forceinline__ void ws_store(const GemmParams& p, const StepCursor& c, int tile16, float s,
                                         const float (&acc)[Cfg::kFrags][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const T* bias = static_cast<const T*>(p.bias);
  s = ws_tile_scale<Cfg>(p, s, c.ntile);
  int n[2];  // rows g, g + 8
  float bn[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    n[half] = c.ntile * Cfg::kTileRows + tile16 * 16 + g + 8 * half;
    bn[half] = ws_row_bias(bias, p.N, n[half]);
  }
#pragma unroll
  for (int j = 0; j < Cfg::kFrags; ++j) ws_store_fragment<T>(p, n, bn, c.mpass * Cfg::kTokens + 8 * j + 2 * q, s, acc[j]);
}

#if KBIT_WGMMA
// A whole tile's sums into y through shared memory and the tensor copy engine (where N % 8 == 0: y_map, the host's
// ws_output_map), in place of ws_store's 2-byte stores: 128 per thread at 256 tokens, each with its own address and
// bounds, took microseconds per tile with both consumer warpgroups off the tensor cores.
// The warp's fragments, scaled, biased and rounded, go token-major into its `piece` of shared memory
// (stmatrix_x4_trans: [token][its 16 rows], 32 B per token), kStoreTokens at a time, and one lane copies each round
// to y (rows past N and tokens past M are not written). Nothing may read the piece any more (in the main loop every
// consumer warp has drained its wgmmas and met the others). A piece of kStoreTokens x 32 B is reused from round to
// round once the copy before has read it; one of NT x 32 B (kWholePiece) takes every round. The piece is free again
// once lane 0's bulk_wait_read is past, which the caller places as late as it can.
template <class Cfg, typename T, bool kWholePiece>
__device__ __forceinline__ void ws_store_by_copy(const GemmParams& p, const void* y_map, const StepCursor& c, int tile16,
                                                 float s, const float (&acc)[Cfg::kFrags][4], uint8_t* piece) {
  constexpr int kPieceFrags = Cfg::kStoreTokens / 8;
  const int lane = threadIdx.x & 31, g = lane >> 2;
  const T* bias = static_cast<const T*>(p.bias);
  s = ws_tile_scale<Cfg>(p, s, c.ntile);
  const int n0 = c.ntile * Cfg::kTileRows + tile16 * 16;
  const float bn[2] = {ws_row_bias(bias, p.N, n0 + g), ws_row_bias(bias, p.N, n0 + g + 8)};  // rows g, g + 8
  // Lane l: row l % 8 of stored matrix l / 8 = token l % 8 of fragment j + l / 16, rows 8 (l / 8 % 2) .. + 7.
  const uint32_t address = shared_address(piece) + ((lane >> 4) * 8 + (lane & 7)) * 32 + (lane >> 3 & 1) * 16;
#pragma unroll
  for (int r = 0; r < Cfg::kFrags / kPieceFrags; ++r) {
    const int round_bytes = kWholePiece ? r * Cfg::kStoreTokens * 32 : 0;
    if (!kWholePiece && r > 0) {  // the piece again: once the copy before has read it
      if (lane == 0) bulk_wait_read();
      __syncwarp();
    }
#pragma unroll
    for (int j = 0; j < kPieceFrags; j += 2) {
      const float(&d0)[4] = acc[r * kPieceFrags + j];
      const float(&d1)[4] = acc[r * kPieceFrags + j + 1];
      stmatrix_x4_trans(address + round_bytes + j * 8 * 32, pack_pair<T>(d0[0] * s + bn[0], d0[1] * s + bn[0]),
                        pack_pair<T>(d0[2] * s + bn[1], d0[3] * s + bn[1]), pack_pair<T>(d1[0] * s + bn[0], d1[1] * s + bn[0]),
                        pack_pair<T>(d1[2] * s + bn[1], d1[3] * s + bn[1]));
    }
    fence_proxy_async_shared();  // the stores above, before the copy engine reads them
    __syncwarp();
    if (lane == 0) {
      tensor_store_2d_from_shared(y_map, n0, c.mpass * Cfg::kTokens + r * Cfg::kStoreTokens, piece + round_bytes);
      bulk_commit_group();
    }
  }
}
#endif  // KBIT_WGMMA

// A tile whose k-groups several CTAs hold (stream-K). The CTAs not holding its first k-group publish their partial
// sums (ws_publish). Then either the lead, the CTA holding that k-group, adds them to its own accumulators
// (ws_lead_reduce), or, where the tile is split kSlicedFrom ways or more, the lead publishes too and each of the
// CTAs adds one contiguous slice of every partial after its main loop (ws_reduce_slice). The lead alone reads
// (n - 1) partials through one SM; in slices each CTA publishes one and reads two tiles' worth whatever n, so slices
// win from some n on (kSlicedFrom; docs/PERFORMANCE.md, "Measured choices").
// Two partial slots per CTA: slot 1 for the tile whose first k-group it holds (only the last tile of a range can
// be split and begin in it), slot 0 for the other (the first tile of its range). Layout per slot: [consumer warp]
// [fragment][lane] float4, an "item" being one float4. Only the items of real tokens move (at M = 17 on a 32-token
// tile, about half the lanes).
// No counters and no fences, as in finish_tile (gemm.cuh): the workspace holds kPartialEmpty in every word before
// the launch, a partial's words are results of arithmetic (never that NaN), so each word the reader loads says
// whether it has landed; the reader puts kPartialEmpty back for the next launch. Every CTA publishes all its
// partials inside its main loop, before it waits for any, and all CTAs are resident at once (one per SM, at most as
// many as SMs: the host's grid), so the waits end. (One flag per contributor warp, written after a __threadfence,
// so that the reader loads the words unchecked, measured slower: the fence waits for the SM's copies in flight;
// docs/PERFORMANCE.md#instructive-failures.)
constexpr int kSlicedFrom = 5;

template <class Cfg>
__device__ __forceinline__ float* ws_partial(const GemmParams& p, int cta, bool lead) {
  return p.partials + (2 * static_cast<int64_t>(cta) + (lead ? 1 : 0)) * Cfg::kTilePartialFloats;
}

// The CTAs holding k-groups of tile `tile`: lead .. lead + n - 1.
struct TileCtas {
  int lead, n;
  __device__ TileCtas(const GemmParams& p, int tile)
      : lead(cta_of_step(p, tile * p.k_groups)), n(cta_of_step(p, tile * p.k_groups + p.k_groups - 1) - lead + 1) {}
};

template <class Cfg>
__device__ __forceinline__ void ws_publish(const GemmParams& p, const StepCursor& c, bool lead,
                                           const float (&acc)[Cfg::kFrags][4]) {
  constexpr int F = Cfg::kFrags;
  const int cwarp = (threadIdx.x >> 5) - 4, lane = threadIdx.x & 31;
  const int lane_tokens = p.M - c.mpass * Cfg::kTokens - 2 * (lane & 3);  // tokens from the lane's first
  float* mine = ws_partial<Cfg>(p, blockIdx.x, lead) + cwarp * F * 128 + lane * 4;
#pragma unroll
  for (int j = 0; j < F; ++j)
    if (8 * j < lane_tokens) st_relaxed_gpu(mine + j * 128, make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
}

// The consumer warps meet (named barrier 1; __syncthreads is barrier 0, and the producer warpgroup is not there).
template <class Cfg>
__device__ __forceinline__ void consumer_barrier() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(Cfg::kThreads - 128) : "memory");
}

// The lead's tile is the last of its range, so this runs after the main loop, and once all consumer warpgroups are
// past it no stage is read or filled again: each warp parks its accumulators below the table (ws_park, before the
// slices of the range's first tile, which need the registers), and the registers they free hold kInFlight partial
// fragments per L2 round trip, whichever contributors they come from, taken contributor by contributor, so each sum
// adds its partials in CTA order. 8 fragments per round trip at 128 and 256 tokens (16 spilled at 128 tokens, at 112
// registers), 12 at 32 and 64 (at 32 all of a tile split 4 ways; 16 spilled there, and at 64 beside the sums' store
// by copy).
template <class Cfg>
__device__ __forceinline__ float4* ws_parked(uint8_t* stages) {  // [warp][fragment][lane]: this lane's first
  return reinterpret_cast<float4*>(stages) + ((threadIdx.x >> 5) - 4) * Cfg::kFrags * 32 + (threadIdx.x & 31);
}
template <class Cfg>
__device__ __forceinline__ void ws_park(const float (&acc)[Cfg::kFrags][4], uint8_t* stages) {
  static_assert(Cfg::kConsumerWarps * Cfg::kFrags * 32 * 16 <= Cfg::kBelowBytes, "parked sums fit the stages");
  consumer_barrier<Cfg>();
  float4* parked = ws_parked<Cfg>(stages);
#pragma unroll
  for (int j = 0; j < Cfg::kFrags; ++j) parked[j * 32] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
}

// Nothing live across the slices but the parked sums and the output scale: the tile (the range's last) and the
// warp's rows are found again here. The sums leave as a stored tile does; by copy, through the warp's parked slice
// once it is read back (64 B per token, the copy needs 32).
template <class Cfg, typename T>
__device__ __forceinline__ void ws_lead_reduce(const GemmParams& p, float out_scale, uint8_t* stages, const void* y_map,
                                               bool y_by_copy) {
  constexpr int F = Cfg::kFrags, kInFlight = F >= 16 ? 8 : 12;
  const StepCursor c(p, steps_of(p, blockIdx.x).last - 1);
  const int cwarp = (threadIdx.x >> 5) - 4, lane = threadIdx.x & 31;
  const int lane_tokens = p.M - c.mpass * Cfg::kTokens - 2 * (lane & 3);
  float4* parked = ws_parked<Cfg>(stages);
  const float empty = __uint_as_float(kPartialEmpty);
  const int items = (TileCtas(p, c.tile(p)).n - 1) * F;  // (contributor, fragment)
  for (int i0 = 0; i0 < items; i0 += kInFlight) {
    float4 v[kInFlight];
    // Item i0 + i: fragment (i0 + i) % F of CTA blockIdx.x + 1 + (i0 + i) / F.
    auto wanted = [&](int i) { return i0 + i < items && 8 * ((i0 + i) % F) < lane_tokens; };
    auto word = [&](int i) {
      return ws_partial<Cfg>(p, blockIdx.x + 1 + (i0 + i) / F, false) + (cwarp * F + (i0 + i) % F) * 128 + lane * 4;
    };
    ld_landed_gpu(v, wanted, word);
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      if (!wanted(i)) continue;
      float4& d = parked[((i0 + i) % F) * 32];
      d.x += v[i].x, d.y += v[i].y, d.z += v[i].z, d.w += v[i].w;
      st_relaxed_gpu(word(i), make_float4(empty, empty, empty, empty));
    }
  }
  float acc[F][4];
#pragma unroll
  for (int j = 0; j < F; ++j) {
    const float4 d = parked[j * 32];
    acc[j][0] = d.x, acc[j][1] = d.y, acc[j][2] = d.z, acc[j][3] = d.w;
  }
#if KBIT_WGMMA
  if (y_by_copy) {
    static_assert(Cfg::kFrags * 32 * 16 >= Cfg::kTokens * 32, "a warp's parked slice holds its rows' output");
    __syncwarp();  // every lane's parked sums read before stmatrix overwrites them
    ws_store_by_copy<Cfg, T, true>(p, y_map, c, cwarp, out_scale, acc, reinterpret_cast<uint8_t*>(parked - lane));
    if (lane == 0) bulk_wait_read();  // before the CTA ends
    return;
  }
#endif
  ws_store<Cfg, T>(p, c, cwarp, out_scale, acc);
}

// Item `item` of a tile's partial layout ([consumer warp][fragment][lane], ws_publish): its first token in the pass
// (fragment (item / 32) % F, lane item % 32). Items whose first token is past M move nowhere.
template <class Cfg>
__device__ __forceinline__ int ws_item_token(uint32_t item) {
  return static_cast<int>(8 * ((item >> 5) % Cfg::kFrags) + 2 * (item & 3));
}

// Item `item`'s four sums `v` into y, scaled and biased, for the tile of token pass mpass and row tile ntile.
template <class Cfg, typename T>
__device__ __forceinline__ void ws_store_item(const GemmParams& p, uint32_t item, int mpass, int ntile, float out_scale,
                                              const float (&v)[4]) {
  constexpr int F = Cfg::kFrags;
  const uint32_t lane = item & 31, tile16 = (item >> 5) / F;
  const T* bias = static_cast<const T*>(p.bias);
  int rows[2];
  float bn[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    rows[half] = ntile * Cfg::kTileRows + tile16 * 16 + (lane >> 2) + 8 * half;
    bn[half] = ws_row_bias(bias, p.N, rows[half]);
  }
  ws_store_fragment<T>(p, rows, bn, mpass * Cfg::kTokens + ws_item_token<Cfg>(item),
                       ws_tile_scale<Cfg>(p, out_scale, ntile), v);
}

// This CTA's slice of split tile `tile`: items [kItems * i / n, kItems * (i + 1) / n) for the i-th of its n CTAs,
// every kConsumers-th one per consumer thread. A thread's (item, contributor) pairs in order, contributors
// fastest, kAtOnce per L2 round trip whatever n (at 128 tokens two round trips per thread); each item's sum adds
// its partials in CTA order, as the lead's accumulators would.
template <class Cfg, typename T>
__device__ __forceinline__ void ws_reduce_slice(const GemmParams& p, int tile, float out_scale) {
  constexpr int kItems = Cfg::kTilePartialFloats / 4, kConsumers = 128 * Cfg::kConsumerGroups;
  constexpr int kAtOnce = 8;
  const TileCtas ctas(p, tile);
  const int lead = ctas.lead, n = ctas.n, i = static_cast<int>(blockIdx.x) - lead;
  const int end = kItems * (i + 1) / n, first_item = kItems * i / n + static_cast<int>(threadIdx.x) - 128;
  const int pairs = first_item < end ? (end - first_item + kConsumers - 1) / kConsumers * n : 0;
  const int mpass = tile / p.n_tiles, ntile = tile - mpass * p.n_tiles;
  const int pass_tokens = p.M - mpass * Cfg::kTokens;
  const float empty = __uint_as_float(kPartialEmpty);
  // Item `item` of contributor lead + c (c = 0, the lead, in slot 1), in floats from the lead's slot 0. The slots are
  // a power of two floats, so the offset gives the item back.
  constexpr int kSlot = Cfg::kTilePartialFloats;
  static_assert((kSlot & (kSlot - 1)) == 0, "the item is an offset's low bits");
  float* const base = p.partials + 2 * static_cast<int64_t>(lead) * kSlot;
  float sum[4];
  for (int q0 = 0; q0 < pairs; q0 += kAtOnce) {
    // This round trip's pairs: their offsets, and bit masks of those to load, of first and of last contributors.
    int offset[kAtOnce];
    uint32_t wanted = 0, firsts = 0, lasts = 0;
    {
      int u = q0 / n, c = q0 - u * n;
#pragma unroll
      for (int a = 0; a < kAtOnce; ++a) {
        const uint32_t item = first_item + u * kConsumers;  // >= 0: first_item < end here
        offset[a] = (2 * c + (c == 0 ? 1 : 0)) * kSlot + static_cast<int>(item) * 4;
        const bool live = ws_item_token<Cfg>(item) < pass_tokens;
        wanted |= (q0 + a < pairs && live ? 1u : 0u) << a;
        firsts |= (c == 0 ? 1u : 0u) << a;
        lasts |= (c == n - 1 ? 1u : 0u) << a;
        if (++c == n) c = 0, ++u;
      }
    }
    float4 v[kAtOnce];
    ld_landed_gpu(v, [&](int a) { return (wanted >> a & 1u) != 0; }, [&](int a) { return base + offset[a]; });
#pragma unroll
    for (int a = 0; a < kAtOnce; ++a) {
      if (!(wanted >> a & 1u)) continue;
      if (firsts >> a & 1u)
        sum[0] = v[a].x, sum[1] = v[a].y, sum[2] = v[a].z, sum[3] = v[a].w;
      else
        sum[0] += v[a].x, sum[1] += v[a].y, sum[2] += v[a].z, sum[3] += v[a].w;
      st_relaxed_gpu(base + offset[a], make_float4(empty, empty, empty, empty));
      if (lasts >> a & 1u)  // the item's last partial: its sums to y
        ws_store_item<Cfg, T>(p, (offset[a] & (kSlot - 1)) >> 2, mpass, ntile, out_scale, sum);
    }
  }
}

// After the main loop: this CTA's slices of the tiles of its range split kSlicedFrom ways or more, its last tile
// first (the other CTAs of that one published their partials as their ranges began; the first tile's lead
// publishes at its range's end).
template <class Cfg, typename T>
__device__ __forceinline__ void ws_reduce_slices(const GemmParams& p, float out_scale) {
  // A tile reaches kSlicedFrom CTAs only across kSlicedFrom - 2 whole ranges and parts of two more.
  if (p.k_groups < (kSlicedFrom - 2) * p.steps_per_cta * p.cut_unit + 2) return;
  const StepRange range = steps_of(p, blockIdx.x);
  const int first = range.first, last = range.last;
  const int head = first / p.k_groups, tail = (last - 1) / p.k_groups;  // the tiles between are whole
#pragma unroll 1
  for (int tile = tail; tile >= head; tile = tile > head ? head : head - 1)  // one copy of the code (two spilled)
    if (TileCtas(p, tile).n >= kSlicedFrom) ws_reduce_slice<Cfg, T>(p, tile, out_scale);
}

#if KBIT_WGMMA
// A tile cut in parts whose CTAs run as one thread-block cluster (launch_gemm_ws; rank r holds the tile's r-th part,
// rank 0 its first k-groups): the parts meet in the CTAs' shared memory instead of L2. The tile's items (the partial
// layout, ws_publish) fall in n slices of ceil(items / n), slice r owned by rank r; after every CTA's main loop (a
// cluster barrier: from then on no stage nor the table is read) each consumer thread stores its accumulators' items
// into their owners' shared memory, at [its rank][item's place in the slice], from the stages' base up; after a
// second barrier each CTA adds its slice's n partials in rank order, as the lead would (ws_lead_reduce), and stores
// it: no L2 round trips and no polling, every CTA summing at once. Against the same parts through L2 it gains most
// where a lead would read 2-3 partials, little for halves (docs/PERFORMANCE.md, "Measured choices"); but the H100
// and H200 hold all of a planned grid's clusters only for halves (of 3, 4 or 8 CTAs, one to four short of the tiles
// the planner cuts in so many parts). The producer warpgroup has no part in it: exited
// threads hold no cluster barrier up (and waiting there took the producer's 24 registers past their limit at 256
// tokens: spills).
template <class Cfg, typename T>
__device__ __forceinline__ void ws_cluster_reduce(const GemmParams& p, const float (&acc)[Cfg::kFrags][4],
                                                  uint8_t* stages, float out_scale) {
  constexpr int F = Cfg::kFrags, kItems = Cfg::kTilePartialFloats / 4, kConsumers = 128 * Cfg::kConsumerGroups;
  static_assert(Cfg::kTilePartialFloats * 4 + 16 * kMaxClusterCtas <=
                    Cfg::kTableAddress + Cfg::kTables + Cfg::kAboveBytes - Cfg::kStagesFrom,
                "a tile's partials fit the dynamic shared memory");
  const int n = static_cast<int>(cluster_ctas()), rank = static_cast<int>(cluster_rank());
  const int slice = (kItems + n - 1) / n;
  const int tile = static_cast<int>(blockIdx.x) / n, mpass = tile / p.n_tiles, ntile = tile - mpass * p.n_tiles;
  const int pass_tokens = p.M - mpass * Cfg::kTokens;
  const int cwarp = (threadIdx.x >> 5) - 4, lane = threadIdx.x & 31;
  const uint32_t slots = shared_address(stages);
  // Item (cwarp * F + j) * 32 + lane: the j-th is `at` items into slice `owner` (slices of 32 items or more: at
  // most one step to the next slice from j to j + 1).
  static_assert(kItems / kMaxClusterCtas >= 32, "a slice holds a fragment's 32 items");
  const int first_item = cwarp * F * 32 + lane;
  int owner = first_item / slice, at = first_item - owner * slice;
  cluster_sync();
#pragma unroll
  for (int j = 0; j < F; ++j, at += 32) {
    if (at >= slice) at -= slice, ++owner;
    if (ws_item_token<Cfg>(first_item + 32 * j) >= pass_tokens) continue;  // only the items of real tokens move
    st_cluster(slots + (rank * slice + at) * 16, owner, make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
  }
  cluster_sync();
  const float4* sums = reinterpret_cast<const float4*>(stages);
  for (int i = static_cast<int>(threadIdx.x) - 128; i < slice && rank * slice + i < kItems; i += kConsumers) {
    const int item = rank * slice + i;
    if (ws_item_token<Cfg>(item) >= pass_tokens) continue;
    float4 v = sums[i];
    for (int r = 1; r < n; ++r) {
      const float4 u = sums[r * slice + i];
      v.x += u.x, v.y += u.y, v.z += u.z, v.w += u.w;
    }
    const float sum[4] = {v.x, v.y, v.z, v.w};
    ws_store_item<Cfg, T>(p, item, mpass, ntile, out_scale, sum);
  }
}

// ---------------------------------------------------------------------------- a consumer warpgroup
// Per step: wait for the stage, then this warp's 16-row tile of the warpgroup's m64 block: its codes and scales, and
// per block t of 32 columns one wgmma group: 2 wgmmas (k16 slices) of 64 rows x NT tokens x 16. A group's A fragments
// are built while the previous group runs: two register sets, set t % 2 rewritten once `wgmma_wait<1>` says group
// t - 2 is done (8 registers each). Off the ring of boxes the stage (which holds the activations) goes back to the
// producer once its last group is done: one drain per step and warpgroup, which the other consumer warpgroups' groups
// cover on the tensor cores. (Handing the stage back after the next step's first group instead keeps wgmmas in flight
// across the step loop; ptxas then serializes every wgmma, C7518.) On the ring of boxes (kBoxRing) the stage holds
// weights only, read into registers before the step's last group, so it goes back without a drain, and the groups
// stay in flight from step to step: the consumer warpgroups sweep the boxes in step, so a drain in one was a drain
// in all, the tensor pipe idle while each built its first group. Each box is waited for before its first group and
// handed back once its last group is done: box t / 2 - 1 after `wgmma_wait<1>` at odd t, at t = 1 the step before's
// box 3. Only a tile's last step drains (its accumulators are read).
template <class Cfg, typename T>
__device__ __forceinline__ void ws_consumer(const GemmParams& p, const WsRing<Cfg>& ring, uint64_t* full,
                                            uint64_t* empty, uint64_t* box_full, uint64_t* box_empty, int first,
                                            int last, const void* y_map, bool y_by_copy, uint32_t table_address) {
  constexpr int BITS = Cfg::kBits, NT = Cfg::kTokens, S = Cfg::kStages, F = Cfg::kFrags, B = Cfg::kBoxes;
  const int lane = threadIdx.x & 31, cwarp = (threadIdx.x >> 5) - 4;
  const int tile16 = cwarp;  // warpgroup w's m64 block is 16-row tiles 4w .. 4w + 3, one per warp
  const uint32_t sel = lane_select<Cfg>(table_address, lane);
  const float out_scale = *p.scale;

  float acc[F][4];
#pragma unroll
  for (int j = 0; j < F; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  // Loop state kept small (at 128 tokens the accumulators take 64 of 112 registers): a step count, the cursor, and
  // whether the current tile started in this CTA's range, in place of the step index and the range's ends.
  StepCursor c(p, first);
  int slot = 0, box_slot = 0, released_box = 0;
  uint32_t phase = 0, box_phase = 0;
  auto release_box = [&] {  // every consumer thread arrives: no branch between the wgmmas
    mbarrier_arrive(&box_empty[released_box]);
    if (++released_box == B) released_box = 0;
  };
  bool from_start = c.kstep == 0;
  bool lead_reduces = false;
  bool box_behind = false;  // kBoxRing: the step before left its box 3 to this step's group 1
  for (int remaining = last - first; remaining > 0; --remaining, c.advance(p)) {
    mbarrier_wait(&full[slot], phase);
    const uint8_t* weights = ring.weights(slot);
    // The activation descriptor of the stage (of the box on the ring of boxes); each wgmma's is this plus its slice's
    // offset, added right before it (volatile asm): computed ahead, the 16 descriptors of a step held 32 registers
    // and the 128-token build spilled.
    uint64_t x_desc = Cfg::kBoxRing ? 0 : wgmma_descriptor_sw128(shared_address(ring.x(slot)));
    fence_accumulators(acc);
    uint32_t a[2][2][4];  // [group % 2][k16 slice]
    uint32_t w[4 * BITS];
    const uint4* codes = reinterpret_cast<const uint4*>(weights + tile16 * Cfg::kCodeBytes) + lane;
    const uint8_t* sc = weights + Cfg::kScalesOffset + tile16 * 128 + (lane >> 2) * 8;
    const uint2 scales_lo = *reinterpret_cast<const uint2*>(sc), scales_hi = *reinterpret_cast<const uint2*>(sc + 64);
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      // The lane's code words as block t first needs them (its bits 16Kt .. 16K(t + 1) - 1; 16 bytes per load): all
      // of them live from the step's start, the 128-token kernel ran out of registers and ptxas serialized every
      // wgmma (C7512).
#pragma unroll
      for (int v = 0; v < BITS; ++v) {
        if (8 * v / BITS != t) continue;
        const uint4 u = codes[v * 32];
        w[4 * v] = u.x, w[4 * v + 1] = u.y, w[4 * v + 2] = u.z, w[4 * v + 3] = u.w;
      }
      if (Cfg::kBoxRing || t >= 2) wgmma_wait<1>();  // group t - 2 (of the step before at t < 2) is done with a[t % 2]
      if (Cfg::kBoxRing && t % 2 == 1 && (t >= 3 || box_behind)) {  // and with box t / 2 - 1
        // The step before's box 3 held a stored tile's sums if it ended one: its copies have read them (only
        // lane 0 copies; every consumer thread arrives, so the slot is free once every warp's lane 0 is past this).
        if (t == 1 && lane == 0) bulk_wait_read();
        release_box();
      }
      uint32_t h[2][4];
      block_fragments<Cfg>(w, t, sel, h);
      apply_block_scales<T>(scales_lo, scales_hi, t, h);
      uint32_t (&ag)[2][4] = a[t % 2];
      wgmma_a_fragments(h, ag);
      if (Cfg::kBoxRing && t % 2 == 0) {
        mbarrier_wait(&box_full[box_slot], box_phase);
        x_desc = wgmma_descriptor_sw128(shared_address(ring.box(box_slot)));
        if (++box_slot == B) box_slot = 0, box_phase ^= 1u;
      }
      wgmma_fence();
      // Block t: columns 32t .. 32t + 31 = box t / 2, bytes 64 (t % 2) + 32 s of each 128-byte row.
      const int box_offset = Cfg::kBoxRing ? 0 : (t >> 1) * Cfg::kXBox;
#pragma unroll
      for (int s = 0; s < 2; ++s)
        Wgmma<NT>::template run<T>(acc, ag[s], descriptor_plus(x_desc, (box_offset + (t & 1) * 64 + s * 32) / 16));
      wgmma_commit();
    }
    if constexpr (!Cfg::kBoxRing) {
      wgmma_wait<0>();
      fence_accumulators(acc);
    }
    box_behind = Cfg::kBoxRing;
    const bool holds_last = c.kstep == p.k_groups - 1, stores_tile = holds_last && from_start;
    // Off the ring of boxes a tile stored by copy leaves through its last stage, which goes back once the copy has read
    // it.
    const bool stage_stays = !Cfg::kBoxRing && stores_tile && y_by_copy;
    __syncwarp();
    if (lane == 0 && !stage_stays) mbarrier_arrive(&empty[slot]);
    if (holds_last || remaining == 1) {
      if constexpr (Cfg::kBoxRing) {
        wgmma_wait<0>();
        fence_accumulators(acc);
      }
      if (stores_tile && y_by_copy) {
        consumer_barrier<Cfg>();  // every consumer warpgroup's wgmmas are done
        // The stage's activations, or on the ring of boxes the step's box 3, handed back at the next step.
        uint8_t* staging = Cfg::kBoxRing ? ring.box(box_slot == 0 ? B - 1 : box_slot - 1) : ring.x(slot);
        ws_store_by_copy<Cfg, T, false>(p, y_map, c, tile16, out_scale, acc,
                                        staging + tile16 * (Cfg::kStoreTokens * 32));
        if (lane == 0 && stage_stays) {  // (a box goes back at the next step's group 1)
          bulk_wait_read();
          mbarrier_arrive(&empty[slot]);
        }
      } else if (stores_tile) {
        ws_store<Cfg, T>(p, c, tile16, out_scale, acc);
      } else if (cluster_ctas() > 1) {  // the range's one tile, summed in the cluster: ws_cluster_reduce
        break;
      } else if (from_start && TileCtas(p, c.tile(p)).n < kSlicedFrom) {  // the range's last tile: ws_lead_reduce
        lead_reduces = true;
        break;
      } else {
        ws_publish<Cfg>(p, c, from_start, acc);
      }
#pragma unroll
      for (int j = 0; j < F; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
      from_start = true;  // the next tile starts at its k-group 0
    }
    if (++slot == S) slot = 0, phase ^= 1u;
  }
  if constexpr (Cfg::kBoxRing) wgmma_wait<0>();  // drained at the range's last step already; ptxas cannot see that
  if (lane == 0) bulk_wait_read();  // a stored tile's sums read from shared memory before it is reused (ws_park)
  __syncwarp();
  if (cluster_ctas() > 1) return ws_cluster_reduce<Cfg, T>(p, acc, ring.base, out_scale);
  if (lead_reduces) ws_park<Cfg>(acc, ring.base);
  ws_reduce_slices<Cfg, T>(p, out_scale);
  if (lead_reduces) ws_lead_reduce<Cfg, T>(p, out_scale, ring.base, y_map, y_by_copy);
}
#endif  // KBIT_WGMMA

// ---------------------------------------------------------------------------- the kernel
template <class Cfg, typename T>
__global__ void __launch_bounds__(Cfg::kThreads, 1) gemm_ws_kernel(const __grid_constant__ GemmParams p,
                                                                 const __grid_constant__ WsActivationMaps x_maps,
                                                                 const __grid_constant__ CUtensorMap y_map,
                                                                 bool y_by_copy) {
#if KBIT_WGMMA
  constexpr int BITS = Cfg::kBits, S = Cfg::kStages, kBoxBarriers = Cfg::kBoxRing ? Cfg::kBoxes : 1;
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ uint64_t full[S], empty[S], box_full[kBoxBarriers], box_empty[kBoxBarriers];
  const uint32_t base = shared_address(smem);
  // The layout's addresses are those of a CTA without clusters (or the first of its cluster).
  const uint32_t table_address = Cfg::kTableAddress + cluster_window_offset(base);
  uint8_t* table = smem + (table_address - base);
  uint8_t* const ring_base = smem + (1024 - base % 1024) % 1024;  // the swizzle atoms need 1024-byte alignment
  const WsRing<Cfg> ring{ring_base, table_address + Cfg::kTables - shared_address(ring_base)};
  if (threadIdx.x == 0) {  // host and kernel disagree on the layout: a bug
    uint32_t dynamic_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dynamic_bytes));
    if (shared_address(ring.base) + Cfg::kBelowBytes > table_address ||
        base + dynamic_bytes < table_address + Cfg::kTables + Cfg::kAboveBytes)
      __trap();
  }
  const StepRange range = steps_of(p, blockIdx.x);
  const int first = range.first, last = range.last;
  const int warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbarrier_init(&full[s], 1);                      // the producer's arrive (with the stage's bytes)
      mbarrier_init(&empty[s], Cfg::kConsumerWarps);   // lane 0 of every consumer warp
    }
    if constexpr (Cfg::kBoxRing) {
      for (int b = 0; b < Cfg::kBoxes; ++b) {
        mbarrier_init(&box_full[b], 1);                        // the producer's arrive (with the box's bytes)
        mbarrier_init(&box_empty[b], 128 * Cfg::kConsumerGroups);  // every consumer thread
      }
    }
  }
  mbarrier_init_fence();
  // Launched early (programmatic dependent launch), the CTA warms L2 with its first steps' weights while the previous
  // kernel drains, as gemm.cuh does (settled ones go into their stages instead where it can: ws_copy_first_weights).
  const bool settled = p.dependent_launch && p.weights_settled, copy_first = settled && p.grid_room != GridRoom::kFull;
  if (p.dependent_launch && !copy_first && threadIdx.x == 0) {
    StepCursor at(p, first);
    for (int s = 0; s < S && first + s < last; ++s, at.advance(p)) {
      prefetch_l2(p.b + tile_piece<Cfg>(p, at, at.kstep) * (BITS * 32), Cfg::kTile16s * Cfg::kCodeBytes);
    }
  }
  // With settled weights (GemmParams) the tables are built before the wait, and each role waits by itself: the
  // producer before the activations (ws_producer), the consumers before anything of theirs reaches global memory.
  auto wait_previous_kernel = [] { grid_dependency_wait(), allow_dependent_launch(); };
  if (!settled) wait_previous_kernel();
  build_tables<Cfg, T>(threadIdx.x < (1 << BITS) ? p.codebook[threadIdx.x] : 0.0f, table);
  __syncthreads();  // tables complete; from here on the roles never meet at a CTA-wide barrier
  if (warp < 4) {
    const int copied = copy_first && threadIdx.x == 0 ? ws_copy_first_weights<Cfg>(p, ring, full, first, last) : 0;
    if (settled) wait_previous_kernel();
    warpgroup_registers_dec<Cfg::kProducerRegisters>();
    if (threadIdx.x == 0) ws_producer<Cfg>(p, &x_maps, ring, full, empty, box_full, box_empty, first, last, copied);
  } else {
    warpgroup_registers_inc<Cfg::kConsumerRegisters>();
    if (settled) wait_previous_kernel();
    ws_consumer<Cfg, T>(p, ring, full, empty, box_full, box_empty, first, last, &y_map, y_by_copy, table_address);
  }
#else
  __trap();  // wgmma, setmaxnreg: sm_90a only; the host picks this kernel only on compute capability 9.x
#endif
}

// ---------------------------------------------------------------------------- host side
// A 2-D tensor map [outer rows, inner columns] of 16-bit elements, rows row_bytes apart, in boxes of box_inner x
// box_outer; the driver's encoder is looked up once. Encoded per call (host only, no device work): x and y change
// from call to call.
inline cudaError_t ws_tensor_map(const void* base, uint64_t inner, uint64_t outer, uint64_t row_bytes, uint32_t box_inner,
                                 uint32_t box_outer, CUtensorMapSwizzle swizzle, CUtensorMapL2promotion promotion,
                                 CUtensorMap& map) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, const_cast<void*>(base), dims, strides, box,
                            element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, promotion,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// The activations [M, K_x]: boxes of 64 columns x `tokens` rows, in the 128-byte swizzle wgmma_descriptor_sw128
// reads; columns past K_x arrive as zeros (and rows past M, which ws_copy_box's boxes do not reach).
inline cudaError_t ws_activation_map(const GemmParams& p, int tokens, CUtensorMap& map) {
  return ws_tensor_map(p.x, p.K_x, p.M, static_cast<uint64_t>(p.lda) * 2, 64, tokens, CU_TENSOR_MAP_SWIZZLE_128B,
                       CU_TENSOR_MAP_L2_PROMOTION_L2_256B, map);
}

// The output [M, N] for ws_store_by_copy: boxes of 16 rows x kStoreTokens tokens, unswizzled. The tensor copy engine
// needs 16-byte aligned rows: where N % 8 != 0 (or y is not 16-byte aligned) there is no map, and ws_store stores.
template <class Cfg>
bool ws_output_map(const GemmParams& p, CUtensorMap& map) {
  return p.N % 8 == 0 && reinterpret_cast<uintptr_t>(p.y) % 16 == 0 &&
         ws_tensor_map(p.y, p.N, p.M, static_cast<uint64_t>(p.N) * 2, 16, Cfg::kStoreTokens, CU_TENSOR_MAP_SWIZZLE_NONE,
                       CU_TENSOR_MAP_L2_PROMOTION_NONE, map) == cudaSuccess;
}

// Dynamic shared memory of a launch: from the dynamic base (after the reserved and static shared memory) to the end
// of the weights above the table.
template <class Cfg, typename T>
cudaError_t gemm_ws_dynamic_smem(int& bytes) {
  int base = 0;
  const cudaError_t err = dynamic_smem_base(gemm_ws_kernel<Cfg, T>, base);
  if (err != cudaSuccess) return err;
  if (base > kReservedSmem + kStaticSmemMax) return cudaErrorInvalidConfiguration;
  bytes = Cfg::kTableAddress + Cfg::kTables + Cfg::kAboveBytes - base;
  return cudaFuncSetAttribute(gemm_ws_kernel<Cfg, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <class Cfg, typename T>
cudaError_t launch_gemm_ws(const GemmParams& p, cudaStream_t stream) {
  WsActivationMaps x_maps{};
  alignas(64) CUtensorMap y_map{};
  const int tail_tokens = p.M % Cfg::kTokens;  // the last pass's, where they do not fill it (ws_copy_box)
  cudaError_t err = ws_activation_map(p, Cfg::kTokens, x_maps.whole);
  if (err == cudaSuccess && tail_tokens != 0) err = ws_activation_map(p, tail_tokens, x_maps.tail);
  if (err != cudaSuccess) return err;
  const bool y_by_copy = ws_output_map<Cfg>(p, y_map);
  int smem_bytes = 0;
  const cudaError_t attr = setup_once_per_device<gemm_ws_dynamic_smem<Cfg, T>>(smem_bytes);
  if (attr != cudaSuccess) return attr;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(p.grid);
  config.blockDim = dim3(Cfg::kThreads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  // A tile cut in parts (a group of the cut per tile, cut.h): its parts as one cluster (ws_cluster_reduce) where the
  // GPU holds every tile's cluster at once (a tile's parts waiting for a second wave of clusters would serialize the
  // launch).
  const int parts = p.cut_group < p.grid ? p.cut_group : 1;
  const bool clusters_wanted = parts > 1 && parts <= kMaxClusterCtas && p.clusters != ClusterUse::kL2;
  const bool clustered =
      clusters_wanted && p.grid / parts <= clusters_at_once<gemm_ws_kernel<Cfg, T>>(parts, p.grid / parts, config);
  if (clusters_wanted && !clustered && p.clusters == ClusterUse::kRequired) return cudaErrorInvalidClusterSize;
  cudaLaunchAttribute attributes[2]{};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  attributes[1] = cluster_attribute(parts);
  config.attrs = p.dependent_launch ? attributes : attributes + 1;
  config.numAttrs = (p.dependent_launch ? 1 : 0) + (clustered ? 1 : 0);
  return cudaLaunchKernelEx(&config, gemm_ws_kernel<Cfg, T>, p, x_maps, y_map, y_by_copy);
}

// The configurations built, per bit width and dtype: 32, 64, 128 or 256 tokens per tile in the default tiles
// (tiles128 = 0: 256 rows, 128 at 256 tokens), and 32, 64 or 128 in 128-row tiles (tiles128 = 1). The one list, for
// the launcher and for the host's report (gemm.cu).
template <int BITS, typename F>
bool with_ws_config(int tokens, int tiles128, F&& f) {
  if (tiles128 == 1) {
    switch (tokens) {
      case 32: f(WsConfig<BITS, 32, 2>{}); return true;
      case 64: f(WsConfig<BITS, 64, 2>{}); return true;
      case 128: f(WsConfig<BITS, 128, 2>{}); return true;
      default: return false;
    }
  }
  if (tiles128 != 0) return false;
  switch (tokens) {
    case 32: f(WsConfig<BITS, 32>{}); return true;
    case 64: f(WsConfig<BITS, 64>{}); return true;
    case 128: f(WsConfig<BITS, 128>{}); return true;
    case 256: f(WsConfig<BITS, 256>{}); return true;
    default: return false;
  }
}

// Explicit list of instantiations, one file per bit width (gemm_ws_k{2,3,4,5}.cu).
#define KBIT_INSTANTIATE_GEMM_WS(BITS)                                                                         \
  template <>                                                                                               \
  cudaError_t gemm_ws_for_bits<BITS>(const GemmParams& p, cudaStream_t stream) {                               \
    cudaError_t err = cudaErrorInvalidValue;                                                                \
    with_ws_config<BITS>(p.ws_tokens, p.wgmma_tiles, [&](auto cfg) {                                           \
      err = p.dtype == DType::BF16 ? launch_gemm_ws<decltype(cfg), __nv_bfloat16>(p, stream)                \
                                   : launch_gemm_ws<decltype(cfg), __half>(p, stream);                      \
    });                                                                                                     \
    return err;                                                                                             \
  }

template <int BITS>
cudaError_t gemm_ws_for_bits(const GemmParams& p, cudaStream_t stream);

}  // namespace kbit
