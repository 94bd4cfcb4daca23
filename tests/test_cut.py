"""The cut of a GEMM's steps among its CTAs (kbit/csrc/cut.h), checked on the host: the header's own functions,
compiled by the host C++ compiler, over every launch of the kinds the binding accepts (kbit/planner.py chooses
among them; tests/test_planner.py checks it plans only those). Every CTA's range is contiguous with the next, covers
the steps once, and cta_of_step finds its owner; the stream-K cut's ranges differ by at most a step; cut in tile
parts, every range lies in one tile and every tile has exactly `parts` CTAs; cut in whole tiles, every range is whole
tiles, one apart at most."""

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
  // Every launch the binding accepts (gemm.cu, gemm_plan): the steps in one group on up to one CTA per SM, whole tiles
  // on up to one CTA per tile, each tile in 2 to k_steps parts on tiles x parts <= kMaxGroupedGrid CTAs.
  int cuts = 0, parted = 0, whole = 0;
  for (int tiles = 1; tiles <= 300; ++tiles) {
    for (int k_steps : {1, 2, 3, 5, 8, 16, 17, 31, 32, 43, 56, 112}) {
      const int total = tiles * k_steps;
      for (int grid : {1, 2, 7, 16, 46, 78, 108, 114, 132, 256}) {
        if (grid > total) continue;
        check(total, grid, grid, 0);
        ++cuts;
        if (grid <= tiles) {
          check(total, grid, grid, 0, k_steps);
          ++whole;
        }
      }
      for (int parts = 2; parts <= k_steps && tiles * parts <= kMaxGroupedGrid; ++parts) {
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
    }
  }
  std::printf("%d cuts in steps, %d cut in tile parts, %d in whole tiles, %d failures\n", cuts, parted, whole,
              failures);
  return failures != 0 || parted == 0 || whole == 0;
}
"""


def test_cut_ranges(tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    src, exe = tmp_path / "cut_check.cpp", tmp_path / "cut_check"
    src.write_text(CHECK)
    subprocess.run([cxx, "-std=c++17", "-O1", "-I", str(HEADER.parent), str(src), "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 failures" in run.stdout
