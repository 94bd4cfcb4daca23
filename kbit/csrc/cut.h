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
// copies issued by the warp-specialized kernel's producer take directly. Either would put the producer's loop in
// vector registers and spill it at 24 registers, which was slower (docs/PERFORMANCE.md, "Measured choices").
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
// CTA showed in a small GEMM's time; signed ones take more instructions); without, signed as gemm.cuh's kernels were
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
// between CTAs (stream-K) and sets each CTA at its own place in k; with whole tiles all CTAs sweep k in step, so the
// CTAs of one token pass read the same activations at the same time. One 128-token tile per CTA lost to the stream-K
// cut, one 256-token tile won (docs/PERFORMANCE.md, "Measured choices"). Below 95% of the SMs: ws_uneven_whole_tiles.
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
// Whole tiles cost the busiest CTA's excess; the stream-K cut splits tiles and sets the CTAs at different places in k,
// where whole tiles sweep k in step, so several passes' CTAs read each weight tile at once. The bounds are where the
// measurements turned (docs/PERFORMANCE.md, "Measured choices").
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
// tile's first k-groups, waits at its end for that inner CTA, which publishes its partial at its own end.
// Where no such grid exists but the k-groups are few, halves: 2 parts, where they give a CTA at most 2.5 steps more
// than the stream-K cut would (k_steps x (1/2 - tiles / SMs) <= 2.5), the stream-K cut's short ranges spreading
// each tile's sum over three CTAs or more; past 2.5 steps more, halves lost (docs/PERFORMANCE.md, "Measured choices").
inline int ws_tile_parts(int tiles, int k_steps, int num_sms) {
  if (num_sms > kMaxGroupedGrid) return 0;
  const int parts = num_sms / tiles < k_steps ? num_sms / tiles : k_steps;
  if (parts >= 2 && 20 * tiles * parts >= 19 * num_sms) return parts;
  return k_steps >= 2 && 2 * tiles <= num_sms && k_steps * (num_sms - 2 * tiles) <= 5 * num_sms ? 2 : 0;
}

}  // namespace kbit
