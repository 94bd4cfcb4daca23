"""The cut of a GEMM's steps among its CTAs (kbit/csrc/cut.h), checked on the host: the header's own functions,
compiled by the host C++ compiler, over many grids. Every CTA's range is contiguous with the next, covers the steps
once, and cta_of_step finds its owner; the stream-K cut's ranges differ by at most a step; where the warp-specialized
kernel cuts tiles in parts (ws_tile_parts), every range lies in one tile and every tile has exactly `parts` CTAs;
where it cuts in whole tiles (ws_uneven_whole_tiles), every range is whole tiles, one apart at most, and no
CTA owns more than ceil(tiles / SMs)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

HEADER = Path(__file__).resolve().parent.parent / "kbit" / "csrc" / "cut.h"

CHECK = r"""
#include <cstdio>
#include <initializer_list>
#include "cut.h"
using namespace kbit;

static int failures = 0;
static void fail(const char* what, int total, int grid, int group, int b) {
  if (failures++ < 10) std::printf("FAIL %s: total=%d grid=%d group=%d cta=%d\n", what, total, grid, group, b);
}

// The cut of total steps over grid CTAs in groups of `group`, in units of `unit` steps; tile_steps > 0: every range
// must lie in one tile.
static void check(int total, int grid, int group, int tile_steps, int unit = 1) {
  const StreamKCut cut = make_cut(total / unit, grid, group, unit);
  if (cut.group_reciprocal > 0xFFFF) fail("group_reciprocal past 16 bits", total, grid, group, -1);
  if (steps_of(cut, 0).first != 0) fail("first range does not start at 0", total, grid, group, 0);
  int shortest = total, longest = 0;
  for (int b = 0; b < grid; ++b) {
    const StepRange r = steps_of(cut, b);
    if (r.last <= r.first) fail("empty range", total, grid, group, b);
    if (steps_of(cut, b + 1).first != r.last) fail("ranges not contiguous", total, grid, group, b);
    for (int s = r.first; s < r.last; ++s)
      if (cta_of_step(cut, s) != b) { fail("cta_of_step", total, grid, group, b); break; }
    if (r.first % unit != 0 || r.last % unit != 0) fail("range not in whole units", total, grid, group, b);
    if (group == grid && unit == 1) {  // one group in steps: the group-free forms (gemm.cuh's kernels) agree
      const StepRange one = steps_of<false>(cut, b);
      if (one.first != r.first || one.last != r.last) fail("steps_of<false>", total, grid, group, b);
      if (cta_of_step<false>(cut, r.first) != b || cta_of_step<false>(cut, r.last - 1) != b)
        fail("cta_of_step<false>", total, grid, group, b);
    }
    if (tile_steps > 0 && r.first / tile_steps != (r.last - 1) / tile_steps)
      fail("range across tiles", total, grid, group, b);
    shortest = r.last - r.first < shortest ? r.last - r.first : shortest;
    longest = r.last - r.first > longest ? r.last - r.first : longest;
  }
  if (steps_of(cut, grid - 1).last != total) fail("steps not covered", total, grid, group, grid - 1);
  if (longest - shortest > unit) fail("ranges differ by more than a unit", total, grid, group, -1);
}

int main() {
  int cuts = 0, parted = 0, uneven = 0;
  for (int sms : {256, 132, 114, 108, 78, 46, 16}) {
    for (int tiles = 1; tiles <= 300; ++tiles) {
      for (int k_steps : {1, 2, 3, 5, 8, 16, 17, 31, 32, 43, 56, 112}) {
        const int total = tiles * k_steps;
        const int grid = total < sms ? total : sms;  // one CTA per SM: the stream-K cut, one group
        check(total, grid, grid, 0);
        ++cuts;
        const int parts = ws_tile_parts(tiles, k_steps, sms);
        if (ws_tile_parts(tiles, k_steps, kMaxGroupedGrid + 1) != 0)
          fail("tile parts past kMaxGroupedGrid SMs", total, -1, -1, -1);
        if (parts > 0) {
          const bool halves = parts == 2 && k_steps * (sms - 2 * tiles) <= 5 * sms;  // few k-groups
          if (tiles * parts > sms || (20 * tiles * parts < 19 * sms && !halves) || parts > k_steps)
            fail("ws_tile_parts: grid past the SMs, or below 95% of them with many k-groups", total, tiles * parts,
                 parts, -1);
          check(total, tiles * parts, parts, k_steps);
          const StreamKCut cut = make_cut(total, tiles * parts, parts);
          for (int t = 0; t < tiles; ++t)  // the tile's CTAs: parts of them, t * parts onwards
            if (cta_of_step(cut, t * k_steps) != t * parts ||
                cta_of_step(cut, t * k_steps + k_steps - 1) != t * parts + parts - 1) {
              fail("tile's CTAs", total, tiles * parts, parts, t);
              break;
            }
          ++parted;
        }
        // Whole tiles on ceil(tiles / most) CTAs, where the busiest CTA's excess over the mean is at most 6% of it, or
        // 5 steps with the busiest at most 1.25x the mean, or the SMs span two passes and the most is at most 1.3x
        // the mean (1.2x below 32 k-steps): the rule restated in floating point, both ways, one pass wide and on
        // either side of spanning two.
        const int most = (tiles + sms - 1) / sms;
        const double mean = static_cast<double>(tiles) / sms, past = most - mean, eps = 1e-9;
        const bool few_past = past <= 0.06 * mean + eps || (most <= 1.25 * mean + eps && past * k_steps <= 5 + eps);
        for (int row_tiles : {tiles, sms / 2, sms / 2 + 1}) {
          const bool wanted = few_past || (2 * row_tiles <= sms && most <= (k_steps >= 32 ? 1.3 : 1.2) * mean + eps);
          const int grid = ws_uneven_whole_tiles(tiles, row_tiles, k_steps, sms);
          if ((grid > 0) != wanted) fail("ws_uneven_whole_tiles: not the stated rule", total, grid, most, row_tiles);
          if (grid > 0 && (grid != (tiles + most - 1) / most || (tiles + grid - 1) / grid != most))
            fail("ws_uneven_whole_tiles: not the fewest CTAs for the most tiles each", total, grid, most, row_tiles);
          if (grid > 0) {
            check(total, grid, grid, 0, k_steps);
            ++uneven;
          }
        }
        for (int per_cta : {1, 2}) {  // the largest grid of >= 95% of the SMs giving each CTA per_cta whole tiles
          int largest = 0;
          for (int g = 1; g <= sms; ++g)
            if (tiles % g == 0 && tiles / g >= per_cta && 20 * g >= 19 * sms) largest = g;
          const int whole = ws_whole_tiles_grid(tiles, sms, per_cta);
          if (whole != largest)
            fail("ws_whole_tiles_grid: not the largest grid of whole tiles", total, whole, per_cta, -1);
        }
      }
    }
  }
  std::printf("%d cuts, %d cut in tile parts, %d in uneven whole tiles, %d failures\n", cuts, parted, uneven, failures);
  return failures != 0 || parted == 0 || uneven == 0;
}
"""


def test_cut_ranges_and_grid_rules(tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    src, exe = tmp_path / "cut_check.cpp", tmp_path / "cut_check"
    src.write_text(CHECK)
    subprocess.run([cxx, "-std=c++17", "-O1", "-I", str(HEADER.parent), str(src), "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 failures" in run.stdout
