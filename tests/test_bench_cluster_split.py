"""benchmarks/bench_cluster_split.py's choice of launches and of the best one per shape, on the pinned configurations."""

import importlib.util
import types
from pathlib import Path

import pytest

from kbit import gemm_facts

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("kbit_bench_cluster_split",
                                                  ROOT / "benchmarks" / "bench_cluster_split.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cluster_launches_fit_the_k_steps_and_the_sms(bench):
    """4096 -> 1024 at one token on 132 SMs (16 k-groups): 256-row tiles (4) take 2 to 8 parts, the k split's 32- and
    16-row tiles (32 and 64 of 2 k-steps) only halves; no configuration past 16 tokens, no wgmma."""
    configs = gemm_facts.parse_configs((ROOT / "tests" / "gemm_configs.json").read_text())
    facts = types.SimpleNamespace(device=gemm_facts.Device("NVIDIA H200", (9, 0), 132, 232448), configs=configs)
    found = bench.cluster_launches(facts, 4, 1024, 4096, 1, range(2, 9))
    assert {(c.mb, c.k_split, tiles, k_steps, C) for c, tiles, k_steps, C in found} == (
        {(mb, 1, 4, 16, C) for mb in (1, 2) for C in range(2, 9)} | {(1, 8, 32, 2, 2), (2, 8, 64, 2, 2)})
    few_sms = types.SimpleNamespace(device=facts.device._replace(sms=100), configs=configs)
    assert all(tiles * C <= 100 for _, tiles, _, C in bench.cluster_launches(few_sms, 4, 1024, 4096, 1, range(2, 9)))
    assert (2, 8, 64, 2, 2) not in {(c.mb, c.k_split, t, k, C) for c, t, k, C in
                                    bench.cluster_launches(few_sms, 4, 1024, 4096, 1, range(2, 9))}


def test_best_rows_take_the_fastest_timed_launch(bench):
    """A clustered launch by its cluster time; one of the steps in one group (C = 0, ``--grids``) by its L2 time."""
    def row(m, cluster, cluster_us, l2_us):
        return {"shape": "4096->1024", "m": m, "cluster": cluster, "cluster_us": cluster_us, "l2_us": l2_us}

    rows = [row(1, 2, None, None), row(1, 2, 3.1, 2.0), row(1, 4, 2.9, 3.5), row(16, 2, None, None),
            row(16, 0, None, 5.6), row(16, 2, 6.0, 5.0)]
    best = bench.best_rows(rows)
    assert [(r["m"], r["cluster"], r["cluster_us"], r["l2_us"]) for r in best] == [(1, 4, 2.9, 3.5), (16, 0, None, 5.6)]
    assert bench.best_rows([row(1, 2, None, None)])[0]["cluster_us"] is None  # none timed: the row stays, "none"


def test_group_launches_are_the_grids_given_and_the_k_splits_cta_per_tile(bench):
    """4096 -> 1024 at 16 tokens on 132 SMs: the grids given up to a CTA per step, and for the k split (mb 2: 64 tiles
    of 16 rows, 2 k-steps; mb 1: 2 passes of 32 tiles) its CTA per tile; no configuration past 16 tokens."""
    configs = gemm_facts.parse_configs((ROOT / "tests" / "gemm_configs.json").read_text())
    facts = types.SimpleNamespace(device=gemm_facts.Device("NVIDIA H200", (9, 0), 132, 232448), configs=configs)
    found = {(c.mb, c.k_split, grid) for c, _, _, grid in bench.group_launches(facts, 4, 1024, 4096, 16, [96, 132])}
    # 256-row tiles: 4 of 16 k-steps, 64 steps at mb 2 (too few for either grid), 128 in two passes at mb 1; the k
    # split's 128 steps in 64 tiles either way
    assert found == {(1, 1, 96), (1, 8, 96), (1, 8, 64), (2, 8, 96), (2, 8, 64)}


def test_render_lists_every_launch_then_the_best_per_shape(bench):
    planned = {"config": "mb1 ks8", "grid": 64, "tile_parts": 0}
    base = {"shape": "4096->1024", "m": 1, "planned_us": 3.8, "copy_us": 0.9, "planned": planned}
    rows = [dict(base, config="mb2 ks8", cluster=2, grid=128, cluster_us=3.1, l2_us=3.9, speedup=3.8 / 3.1),
            dict(base, config="mb1", cluster=5, grid=20, cluster_us=None, l2_us=None, speedup=None),
            dict(base, shape="4096->28672", config=None, cluster=None, grid=None, cluster_us=None, l2_us=None,
                 speedup=None)]
    text = bench.render(rows, "K=4 fp16, H200.")
    every, best = text.split("Best launch")
    assert every.count("4096->1024") == 2 and "4096->28672" not in every  # shapes without a cluster launch: best only
    assert "mb2 ks8 C=2 / 128" in best and "1.23x" in best and "none fits" in best
    assert text.rstrip().splitlines()[-1].startswith("4096->28672")  # the best table is last


def test_in_step_timing_is_each_call_after_a_write_of_its_input_less_the_writes(bench, monkeypatch):
    """--in-step (``common.time_in_step``): one graph of (write x, call) pairs, one of the writes alone; a call's time
    is the pair's less the write's, and the write is an elementwise kernel leaving x as it was."""
    import torch

    common = bench.common
    x = torch.arange(6, dtype=torch.float32)
    graphs = []

    def fake_time_graph(calls, replays, warmup_calls):  # a write costs 2 us, a call 5 (what it returns)
        costs = []
        for call in calls:
            x.add_(100)  # what a write must undo: it writes x from a copy taken first
            out = call()
            costs.append(out if isinstance(out, float) else 2.0)
        graphs.append(costs)
        return {"us": sum(costs) / len(calls), "min_us": sum(costs) / len(calls)}

    monkeypatch.setattr(common, "time_graph", fake_time_graph)
    calls = [lambda: 5.0] * 3
    r = common.time_in_step(calls, x, replays=3)
    assert graphs == [[2.0, 5.0] * 3, [2.0] * 3]
    assert r["us"] == pytest.approx(5.0) and r["write_us"] == pytest.approx(2.0) and r["calls"] == 3
    assert torch.equal(x, torch.arange(6, dtype=torch.float32))  # each write undid the add before it
    assert bench.parse_args(["--in-step"]).in_step and not bench.parse_args([]).in_step
