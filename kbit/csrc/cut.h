// How a GEMM's pipeline steps are cut among its CTAs: the ranges, on the host and the device. Which cut and grid a
// GEMM runs is kbit/planner.py's choice; the binding checks it fits (gemm.cu, gemm_plan). A step is (token pass, CTA row tile, k-step), numbered tile * k_steps + k-step; a CTA owns one
// contiguous range of steps, persistent, one CTA per SM at most (a split tile's reducer waits for the others).
//
// The cut counts units of `unit` steps: one step, or a whole tile (k_steps). The CTAs fall in groups of `group`, each
// group owning group * steps_per_cta + extra_steps consecutive units; in a group, CTA j owns steps_per_cta units,
// plus one more when j < extra_steps.
//   One group of all CTAs, in steps: the stream-K cut (every SM streams weights whatever the shape).
//   One group of all CTAs, in tiles: the warp-specialized kernel's CTAs own whole tiles, as many each or one apart.
//   A group per tile, in steps: each tile cut in parts of whole k-steps (the warp-specialized kernel; gemm.cuh's up to
//     16 tokens, each tile's parts one thread-block cluster), no tile across three CTAs.
// tests/test_cut.py checks these functions on the host over every grid of these three kinds the binding accepts.

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

// CTA b's steps, b <= grid. kGroups = false: the cut is one group in steps (gemm.cuh's kernels without tile parts),
// nothing computed for groups or units.
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

}  // namespace kbit
