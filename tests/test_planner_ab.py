"""The planner A/B's CPU parts: benchmarks/compare_ab.py, benchmarks/planner_ab.py's tree handling, and
benchmarks/bench_planner_ab.sh end to end in its dry run (the fit, compare and summary on committed files)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo_script import load_script

ROOT = Path(__file__).resolve().parents[1]


compare_ab = load_script("benchmarks/compare_ab.py")
planner_ab = load_script("benchmarks/planner_ab.py")


def _cell(shape, M, K):
    return (("shape", shape), ("dtype", "fp16"), ("M", M), ("K", K))


def test_compare_counts_slow_cells_per_token_count_and_shows_the_plans():
    old = {_cell("4096->4096", 1, 4): (10.0, {"path": "mma_sync", "mb": 1}),
           _cell("4096->4096", 256, 4): (20.0, {"path": "warp_specialized", "ws_tokens": 128}),
           _cell("2048->1536", 256, 4): (8.0, None)}
    new = {_cell("4096->4096", 1, 4): (10.0, {"path": "mma_sync", "mb": 1}),
           _cell("4096->4096", 256, 4): (40.0, {"path": "dequantize_cublas", "mb": 0}),
           _cell("2048->1536", 256, 4): (4.0, None),
           _cell("2048->1536", 512, 4): (4.0, None)}  # on one side only: not compared
    lines = compare_ab.compare(old, new, worst=1)
    assert lines[0] == "3 cells: geomean new/old speed 1.0000x, 1 below 0.95x"
    assert lines[1] == "  per M: 1:1.000 256:1.000"
    assert lines[2].startswith("  0.500x {'shape': '4096->4096'") and "(20.0 -> 40.0 us)" in lines[2]
    assert lines[2].endswith("warp_specialized(128) -> dequantize_cublas")
    assert compare_ab.compare(old, {}, worst=1) == []


def test_compare_reads_the_field_asked_for(tmp_path):
    cublas, ws = {"path": "dequantize_cublas"}, {"path": "warp_specialized", "ws_tokens": 256}
    rows = [{"shape": "4096->4096", "dtype": "fp16", "M": 64, "K": 4, "kbit_us": 10.0, "fused_us": 12.0,
             "plan": cublas, "fused_plan": ws},
            {"shape": "4096->4096", "dtype": "fp16", "M": 128, "K": 4, "kbit_us": None, "fused_us": 12.0}]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"rows": rows}))
    assert compare_ab.cells([path], "kbit_us") == {_cell("4096->4096", 64, 4): (10.0, cublas)}
    fused = compare_ab.cells([path], "fused_us")
    assert len(fused) == 2 and fused[_cell("4096->4096", 64, 4)] == (12.0, ws)  # the plan that ran the fused op


def test_compare_takes_a_cell_at_its_fastest_over_the_rounds(tmp_path):
    row = {"shape": "4096->4096", "dtype": "fp16", "M": 256, "K": 4}
    paths = []
    for n, (us, grid) in enumerate(((30.0, 128), (28.5, 132), (29.0, 128))):
        paths.append(tmp_path / f"round{n}.json")
        paths[-1].write_text(json.dumps({"rows": [dict(row, kbit_us=us, plan={"path": "mma_sync", "grid": grid})]}))
    assert compare_ab.cells(paths, "kbit_us") == {_cell("4096->4096", 256, 4): (28.5, {"path": "mma_sync",
                                                                                       "grid": 132})}


def test_planner_ab_times_the_tree_it_is_given(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    kbit = planner_ab.import_tree(ROOT)
    assert planner_ab.planner_module(kbit).__name__ == "kbit.planner"
    with pytest.raises(SystemExit, match="not from"):
        planner_ab.import_tree(ROOT / "benchmarks")  # this process's kbit is another tree's
    from kbit import planner

    fields = planner_ab.plan_fields(planner.Plan(planner.Path.WGMMA, mb=16, wgmma_tiles=1, grid=132))
    assert fields["path"] == "wgmma" and fields["mb"] == 16 and fields["grid"] == 132


@pytest.mark.slow  # ~20 s: several python processes, the fit of the committed H200 tune file
def test_the_ab_scripts_dry_run_fits_compares_and_summarises(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, AB_DRY_RUN="1", AB_DIR=str(tmp_path / "ab"), OUT=str(out))
    run = subprocess.run(["bash", "benchmarks/bench_planner_ab.sh", str(ROOT)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    assert run.stdout.endswith(summary)  # the summary is printed last
    assert "cells: geomean new/old speed 1.0000x, 0 below 0.95x" in summary  # a file against itself
    assert "(no fused_us in these rows)" in summary  # bench_gemm.py's rows stand in for planner_ab.py's
    assert "on its own data: the planned path within 3% of the fastest in" in summary
    # at most the 8 files the device returns; the A/B files travel in the tar
    assert sorted(p.name for p in out.iterdir()) == ["NVIDIA_H200.json", "planner_ab.tar.gz", "summary.txt",
                                                     "tune_NVIDIA_H200.json"]
    assert summary.count("cells: geomean new/old speed") == 3  # the layer GEMM of shipped and tuned; the MoE
    # the committed tune file is the shipped coefficients' source: the dry run's fit is the shipped file
    fitted = json.loads((out / "NVIDIA_H200.json").read_text())
    shipped = json.loads((ROOT / "kbit" / "gpus" / "NVIDIA_H200.json").read_text())
    assert fitted["tokens"] == shipped["tokens"]
    for path, cost in shipped["paths"].items():
        assert fitted["paths"][path] == pytest.approx(cost, rel=1e-6)
