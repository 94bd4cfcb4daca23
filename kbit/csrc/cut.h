// How a GEMM's pipeline steps are cut among its CTAs: the ranges (host and device) and the warp-specialized kernel's
// grid rules (host). A step is (token pass, CTA row tile, k-step), numbered tile * k_steps + k-step; a CTA owns one
// contiguous range of steps, persistent, one CTA per SM at most (a split tile's reducer waits for the others).
//
// The cut counts units of `unit` steps: one step, or a whole tile (k_steps). The CTAs fall in groups of `group`, each
// group owning group * steps_per_cta + extra_steps consecutive units; in a group, CTA j owns steps_per_cta units,
// plus one more when j < extra_steps.
//   One group of all CTAs, in steps: the stream-K cut (every SM streams weights whatever the shape).
//   One group of all CTAs, in tiles: the warp-specialized kernel's CTAs own whole tiles, as many each or one apart
//     (ws_whole_tiles_grid, ws_uneven_whole_tiles).
//   A group per tile, in steps: each tile cut in parts of whole k-steps (ws_tile_parts), no tile across three CTAs.
// tests/test_cut.py checks these functions on the host over many grids.

#pragma once

#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)
#define KBIT_HOST_DEVICE __host__ __device__
#else
#define KBIT_HOST_DEVICE
#endif

namespace kbit {

struct StreamKCut {
  int steps_per_cta, extra_steps, group;  // in units; GemmParams: steps_per_cta, extra_steps, cut_group
  int group_reciprocal;  // GemmParams::cut_group_reciprocal: ceil(2^16 / group), 0 with one group (make_cut)
  int unit;              // steps per unit, GemmParams::cut_unit: 1, or k_steps (whole tiles)
};

struct StepRange {
  int first, last;  // [first, last)
};

// `units` units of `unit` steps over grid CTAs in groups of `group`: grid (one group), or a divisor of grid from 2 to
// grid / 2 where grid <= kMaxGroupedGrid (the groups divide the units). CTA b's group is (b * group_reciprocal) >> 16,
// exact while b * group < 2^16 (b <= grid, group <= grid / 2); the reciprocal fits 16 bits (GemmParams).
constexpr int kMaxGroupedGrid = 256;
KBIT_HOST_DEVICE inline StreamKCut make_cut(int units, int grid, int group, int unit = 1) {
  const int group_units = units / (grid / group);
  const int reciprocal = group < grid ? ((1 << 16) + group - 1) / group : 0;
  return {group_units / group, group_units % group, group, reciprocal, unit};
}

// CTA b's steps, b <= grid. kGroups = false: the cut is one group in steps (gemm.cuh's kernels), nothing computed for
// groups or units.
// No division, and last not derived from first: so the range stays in uniform registers on the device, which the
// copies issued by the warp-specialized kernel's producer take directly. Either put the producer's loop in vector
// registers, moved to uniform ones before every copy, and spilled it at 24 registers (1.03-1.10x the time of most
// shapes at 32-512 tokens, H200).
template <bool kGroups = true>
KBIT_HOST_DEVICE inline StepRange steps_of(const StreamKCut& cut, int b) {
  int group = 0, j = b;  // b's group, and b's place in it
  if constexpr (kGroups) {
    group = static_cast<int>((static_cast<uint32_t>(b) * cut.group_reciprocal) >> 16);
    j = b - group * cut.group;
  }
  const int q = cut.steps_per_cta, extra = cut.extra_steps, base = group * extra, unit = kGroups ? cut.unit : 1;
  return {unit * (b * q + base + (j < extra ? j : extra)),
          unit * ((b + 1) * q + base + (j + 1 < extra ? j + 1 : extra))};
}

// The CTA owning step `step`. With groups and units in unsigned arithmetic, three 32-bit divisions (a 64-bit one per
// CTA cost ~1% of a small GEMM; signed ones take more instructions); without, signed as gemm.cuh's kernels were
// measured.
template <bool kGroups = true>
KBIT_HOST_DEVICE inline int cta_of_step(const StreamKCut& cut, int step) {
  using I = std::conditional_t<kGroups, uint32_t, int>;
  I s = step, group_first = 0;  // s: the step's unit; group_first: the first CTA of its group
  if constexpr (kGroups) {
    s /= static_cast<I>(cut.unit);
    const I group_units = cut.group * cut.steps_per_cta + cut.extra_steps, group = s / group_units;
    group_first = group * cut.group;
    s -= group * group_units;
  }
  const I q = cut.steps_per_cta, extra = cut.extra_steps, long_units = extra * (q + 1);  // the longer CTAs' units
  return static_cast<int>(group_first + (s < long_units ? s / (q + 1) : extra + (s - long_units) / q));
}

// The warp-specialized kernel's grid of whole tiles: the largest grid of at least 95% of the SMs that divides the
// tiles into `per_cta` or more per CTA (two; one at 256 tokens per tile), 0 where none does. A CTA per SM cuts tiles
// between CTAs (stream-K) and sets each CTA at its own place in k; with a grid that divides the tiles, every CTA owns
// whole tiles and all of them sweep k in step, so the CTAs of one token pass read the same activations at the same
// time (H200, k = 4, 256-token tiles at 4096 tokens, 128 of 132 SMs: 14336->4096 1028 -> 749 us, 28672->8192 3827 ->
// 2978, 8192->28672 3527 -> 3222). One 128-token tile per CTA was slower (28672->8192 at 512 tokens: 1.10-1.16x the
// time at k = 2..4), one 256-token tile faster (14336->4096 at 1024 tokens, 128 tiles on 128 of 132 SMs: 198 -> 178
// us). Below 95% of the SMs: ws_uneven_whole_tiles.
inline int ws_whole_tiles_grid(int tiles, int num_sms, int per_cta) {
  for (int grid = num_sms; 20 * grid >= 19 * num_sms; --grid)
    if (tiles % grid == 0 && tiles / grid >= per_cta) return grid;
  return 0;
}

// 256-token tiles that no such grid divides: whole tiles still, on ceil(tiles / most) CTAs, each owning the most
// (ceil(tiles / SMs)) or one less (the cut in tiles), where the busiest CTA's steps past the mean (tiles / SMs) are few
// (at most 6% of the mean, or at most 5 steps with the most at most 1.25x the mean), or where the SMs span two token
// passes or more (row tiles per pass at most half the SMs) and the most is at most 1.3x the mean (1.2x below 32
// k-steps); else 0 (the stream-K cut).
// The stream-K cut splits tiles and sets the CTAs at different places in k (H200, forced grids, 1024 tokens, k = 4: a
// step 1.2-1.4x a whole tile's); whole tiles cost the busiest CTA's excess, and their CTAs sweep k in step, so those of
// several passes read each weight tile, and those of one pass its activations, at once. Through the planner (H200,
// k = 2..5, docs/PERFORMANCE.md): 4096->14336 at 256 and 512 tokens (2.4 and 4.8 steps past the mean) 0.81-0.86x and
// 0.90-0.97x the time, 4096->11008 at 4096 (5.5% past) 0.95-0.97x, 2048->10240 at 640-1024 (1.5-4.6 steps) 0.92-1.02x;
// 9.7-29 steps past lost (8192->28672 at 512-1536 tokens 1.02-1.11x, 4096->11008 at 2048 1.04-1.06x). The N = 4096 and
// 8192 shapes (32 and 64 row tiles, several passes at once), the most 1.10-1.27x the mean: 0.70-0.98x on 14336->4096,
// 11008->4096 and 28672->8192 (43-112 k-steps; 14336->4096 at 3840 tokens 969 -> 704 us), on 4096->4096 (16) 0.90-0.96x
// at 1.10x, 0.94-1.05x at 1.18x, 0.96-1.11x at 1.27x; at 1.375x 0.89-1.23x, at 1.65x 1.12-1.27x. On ceil(tiles / most)
// CTAs rather than min(tiles, SMs): within the runs' +-4%.
inline int ws_uneven_whole_tiles(int tiles, int row_tiles, int k_steps, int num_sms) {
  const int most = (tiles + num_sms - 1) / num_sms;
  const int excess = most * num_sms - tiles;  // the busiest CTA's tiles past the mean, x SMs
  const bool few_past = 50 * excess <= 3 * tiles || (4 * excess <= tiles && excess * k_steps <= 5 * num_sms);
  const bool spans_passes = 2 * row_tiles <= num_sms;
  const int bound_tenths = k_steps >= 32 ? 13 : 12;  // the most over the mean, in tenths
  return few_past || (spans_passes && 10 * most * num_sms <= bound_tenths * tiles) ? (tiles + most - 1) / most : 0;
}

// Where the tiles are at most half the SMs: each tile cut in `parts` parts of whole k-steps (a group of the cut per
// tile), grid tiles x parts, where that keeps at least 95% of the SMs; 0 where it does not. With one CTA per SM a range
// shorter than a tile can lie wholly inside one, which then spans three CTAs; its lead, whose range ends in the
// tile's first k-groups, waits at its end for that inner CTA, which publishes its partial at its own end (H200,
// k = 4, 512 tokens, 256-token tiles split 2-3 ways: a build whose leads read no partial took 0.84-0.91x the time,
// and reading faster did not help; parts of equal size: 14336->4096 0.80-0.95x the time at 32-512 tokens;
// docs/PERFORMANCE.md).
// Where no such grid exists but the k-groups are few, halves: 2 parts, where they give a CTA at most 2.5 steps more
// than the stream-K cut would (k_steps x (1/2 - tiles / SMs) <= 2.5), the stream-K cut's short ranges spreading
// each tile's sum over three CTAs or more (H200, k = 2..5, halves in clusters of two: 2048->10240 at 17-64 tokens, 40
// tiles of 8 k-groups on 80 CTAs, 0.74-0.88x the time; 4096->14336 at 64, 56 of 16, 0.87-0.90x, at 17-32 0.99-1.01x;
// 4096->4096 at 160-192, 48 of 16, 0.88-0.89x; 48 tiles of 43 and 56 k-groups, 5.9 and 7.6 steps more, were
// 1.04-1.15x: docs/PERFORMANCE.md).
inline int ws_tile_parts(int tiles, int k_steps, int num_sms) {
  if (num_sms > kMaxGroupedGrid) return 0;
  const int parts = num_sms / tiles < k_steps ? num_sms / tiles : k_steps;
  if (parts >= 2 && 20 * tiles * parts >= 19 * num_sms) return parts;
  return k_steps >= 2 && 2 * tiles <= num_sms && k_steps * (num_sms - 2 * tiles) <= 5 * num_sms ? 2 : 0;
}

}  // namespace kbit
