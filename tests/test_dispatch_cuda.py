"""The GEMM planner on a GPU (skipped without CUDA): the extension's configuration list is the one the CPU tests
pin, every plan runs, the binding refuses configurations the GPU cannot run, and ``kbit tune`` writes a cache the
planner reads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path as FilePath

import pytest
import torch

import kbit
from kbit import planner, tune, tune_cache
from kbit._build import cuda_ext

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tests need a CUDA device"),
]


def test_extension_reports_the_pinned_configurations():
    """tests/gemm_configs.json is what the CPU tests plan from; after changing the C++ lists, write the report below
    into it."""
    reported = cuda_ext().gemm_configs()
    pinned = json.loads((FilePath(__file__).parent / "gemm_configs.json").read_text())
    assert json.loads(reported) == pinned, f"the extension reports:\n{json.dumps(json.loads(reported), indent=1)}"


def test_device_facts():
    facts = planner.device_facts(torch.device("cuda"))
    props = torch.cuda.get_device_properties(0)
    assert facts.device.capability == (props.major, props.minor) and facts.device.sms == props.multi_processor_count
    optin = getattr(props, "shared_memory_per_block_optin", None)
    assert optin is None or facts.device.smem_per_block == optin


@pytest.mark.parametrize("bits", (2, 3, 4, 5))
def test_every_plan_runs(bits):
    """kbit.matmul over token counts, as planned and forced onto the fused path, within tolerance of the dequantized
    reference: no plan picks what the binding refuses."""
    facts = planner.device_facts(torch.device("cuda"))
    fused_runs = any(c.bits == bits and c.runs_on(facts.device) for c in facts.configs)
    for N, K in ((4096, 4096), (14336, 4096), (1000, 4128)):
        qw = kbit.quantize(torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02, bits)
        w = kbit.dequantize(qw, torch.float32)
        for M in (1, 9, 17, 33, 40, 64, 65, 80, 129, 160, 257, 513):
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            want = x.float() @ w.T
            outputs = {"planned": kbit.matmul(x, qw)}
            if fused_runs:
                outputs["fused"] = kbit.matmul(x, qw, grid_override=1000)
            else:
                with pytest.raises(planner.NoFusedConfig):
                    kbit.matmul(x, qw, grid_override=1000)
            for how, y in outputs.items():
                err = float((y.float() - want).norm() / want.norm())
                assert err < 1e-2, f"N={N} K={K} M={M} bits={bits} {how}: relative error {err:.3g}"


def test_binding_refuses_configurations_it_cannot_run():
    qw = kbit.quantize(torch.randn(256, 256, device="cuda", dtype=torch.float16), 4)
    b, a = qw.gemm_layout()
    x = torch.randn(4, 256, device="cuda", dtype=torch.float16)

    def run(mb, wgmma_tiles, ws_tokens, k_split=1, bits=4):
        return cuda_ext().gemm(x, b, a, qw.codebook, qw.scale, None, bits, 256, 256, 1, 0, False, mb, wgmma_tiles,
                               k_split, ws_tokens, False)

    for bogus in ((3, 0, 0), (16, 2, 16), (0, 0, 0), (4, 0, 64), (8, 1, 0), (4, 0, 0, 8), (1, 0, 0, 4), (1, 1, 0, 8),
                  (4, 0, 32, 8)):
        with pytest.raises(RuntimeError, match="has no configuration"):
            run(*bogus)
    facts = planner.device_facts(x.device)
    cannot = [c for c in facts.configs if c.bits == 4 and not c.runs_on(facts.device)]
    for c in cannot:
        with pytest.raises(RuntimeError, match="not built for compute capability|shared memory per block"):
            run(c.mb, c.wgmma_tiles, c.ws_tokens, c.k_split)


def test_binding_refuses_launches_that_do_not_fit():
    qw = kbit.quantize(torch.randn(256, 4096, device="cuda", dtype=torch.float16), 4)
    b, a = qw.gemm_layout()
    x = torch.randn(64, 4096, device="cuda", dtype=torch.float16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def run(grid, parts, whole, config=(16, 0, 1, 128), rows=64):
        return cuda_ext().gemm(x[:rows], b, a, qw.codebook, qw.scale, None, 4, 256, 4096, grid, parts, whole, *config,
                               False)

    # 64 tokens in one 128-token pass, 256 rows: one tile of 16 steps.
    assert run(1, 0, True).shape == (64, 256) and run(4, 4, False).shape == (64, 256)
    assert run(1, 0, False, rows=0).shape == (0, 256)  # no rows: no steps, nothing launched
    for bad in ((0, 0, False), (sms + 1, 0, False), (17, 0, False), (2, 0, True), (3, 4, False), (2, 1, False),
                (17, 17, False), (2, 2, True)):
        with pytest.raises(RuntimeError, match="the launch"):
            run(*bad)
    with pytest.raises(RuntimeError, match="only the warp-specialized kernel"):
        run(1, 0, True, (4, 0, 1, 0))


def test_tune_writes_a_cache_the_planner_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("KBIT_CACHE_DIR", str(tmp_path))
    planner.forget()
    try:
        parser = argparse.ArgumentParser()
        tune.add_arguments(parser)
        args = parser.parse_args(["--bits", "4", "--shapes", "1024->2048", "--tokens", "1,64,512", "--repeats", "2"])
        assert tune.main(args) == 0
        device = planner.device_facts(torch.device("cuda")).device
        cached = tune_cache.load(device.name)
        assert cached is not None and cached["source"] == "python -m kbit tune"
        assert planner.device_facts(torch.device("cuda")).coefficients == planner.coefficients_from_json(cached, "")
        measured = tune_cache.parse(json.loads(tune_cache.cache_file(device.name).read_text()))
        shape = measured[(4, 2048, 1024)]
        assert shape.configs  # what ran is recorded
        assert set(shape.us) == set(planner.Path)
        assert not shape.unrepacked_first  # dequantize + cuBLAS timed as a layer runs it: one pass from the layout
        # Each fused time with the launch that ran: the plan on that path from the coefficients the tune started
        # from (the shipped ones: the cache was empty), then the other launches tune adds (launches_to_time).
        shipped = planner.shipped_coefficients(device.name)
        configs = planner.device_facts(torch.device("cuda")).configs
        clustered = 0
        for path, launched in shape.launches.items():
            for M, timed, us in zip(shape.tokens, launched, shape.us[path]):
                if us is None:
                    assert timed is None, (path, M)
                    continue
                chosen = planner.plan(device, configs, shipped, 2048, 1024, M, 4, fused_only=True,
                                      force=frozenset({path}))
                planned = planner.Launch(chosen.grid, chosen.tile_parts, chosen.whole_tiles)
                assert timed[0] == (tuple(planned), us), (path, M, timed)
                config = next(c for c in configs if c.bits == 4 and c.key == chosen.key)
                added = tune.launches_to_time(config, planner.Shape(2048, 1024, M, 4), device, shipped, planned)
                assert [launch for launch, _ in timed[1:]] == [tuple(launch) for launch in added], (path, M, timed)
                clustered += sum(1 for launch in added if launch.tile_parts and not config.ws_tokens)
        if torch.cuda.get_device_capability()[0] == 9:
            assert any(shape.launches.get(planner.Path.WARP_SPECIALIZED) or ())
            assert clustered  # M = 1: mma.sync and the k split on tiles in clusters too
    finally:
        planner.forget()


def test_the_planner_knows_the_clusters_the_gpu_runs_at_once():
    """Device.clusters from the extension's gemm_clusters_at_once: on sm_90 fewer clusters as they grow, at most one
    CTA per SM; below, none (no clustered launch is planned there)."""
    planner.forget()
    device = planner.device_facts(torch.device("cuda")).device
    if torch.cuda.get_device_capability()[0] < 9:
        assert device.clusters == () and device.clusters_at_once(2) == 0
        return
    assert len(device.clusters) == planner.MAX_CLUSTER_CTAS
    assert all(c * n <= device.sms for c, n in enumerate(device.clusters, 1)), device.clusters
    assert device.clusters[0] >= device.clusters[1] >= device.clusters[3] >= device.clusters[7] >= 1, device.clusters
    with pytest.raises(RuntimeError, match="ctas must be 1..8"):
        cuda_ext().gemm_clusters_at_once(0, 9)


def test_matmul_plans_a_weight_alike_whatever_it_holds(monkeypatch):
    """A weight holding its storage format and one holding only its GEMM layout both dequantize in one pass
    (``dense_stored``, ``dequantize_layout``): kbit.matmul asks the planner the same of each."""
    seen = []
    real = planner.gemm_plan

    def gemm_plan(*args, **kwargs):
        if not kwargs.get("fused_only"):  # kbit.matmul's plan, not the fused op's
            seen.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "gemm_plan", gemm_plan)
    qw = kbit.quantize(torch.randn(256, 512, device="cuda", dtype=torch.float16), 4)
    x = torch.randn(3, 512, device="cuda", dtype=torch.float16)
    kbit.matmul(x, qw)
    kbit.matmul(x, qw.gemm_resident())
    assert len(seen) == 2 and seen[0] == seen[1], seen


def test_tune_times_only_the_paths_asked():
    """tune_shape's paths: the entry holds those paths' times alone, dequantize + cuBLAS still the reference the
    fused outputs are checked against; no flag (dequantize + cuBLAS in one pass)."""
    facts = planner.device_facts(torch.device("cuda"))
    for paths in ((planner.Path.MMA_SYNC,), (planner.Path.DEQUANTIZE_CUBLAS,), tuple(planner.Path)):
        entry = tune.tune_shape(facts, 4, 1024, 2048, [1, 16], torch.float16, 2, lambda line: None, paths=paths)
        names = {path.value for path in paths}
        assert set(entry["us"]) == names and "unrepacked_first" not in entry
        assert set(entry["configs"]) == set(entry["launches"]) == names - {"dequantize_cublas"}
        for name in names & {"mma_sync", "dequantize_cublas"}:
            assert all(us is not None for us in entry["us"][name]), entry["us"]
