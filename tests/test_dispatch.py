"""The GEMM dispatch planner (kbit/dispatch.py) and its tuned cache (kbit/tune_cache.py), on CPU.

The built configurations come from tests/gemm_configs.json, the CUDA extension's report (``gemm_configs``) pinned
here; tests/test_dispatch_cuda.py checks on a GPU that the extension still reports exactly that.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path as FilePath

import pytest
import torch

from kbit import dispatch, tune_cache
from kbit.dispatch import Device, Path, Plan

CONFIGS = dispatch.parse_configs((FilePath(__file__).parent / "gemm_configs.json").read_text())

H100 = Device("NVIDIA H100 80GB HBM3", (9, 0), 132, 232448)
H100_PCIE = Device("NVIDIA H100 PCIe", (9, 0), 114, 232448)
H200 = Device("NVIDIA H200", (9, 0), 132, 232448)
B200 = Device("NVIDIA B200", (10, 0), 148, 232448)
A100_40 = Device("NVIDIA A100-SXM4-40GB", (8, 0), 108, 166912)
A100_80 = Device("NVIDIA A100-SXM4-80GB", (8, 0), 108, 166912)
SM86 = Device("NVIDIA A10", (8, 6), 72, 101376)
SM89 = Device("NVIDIA L40S", (8, 9), 142, 101376)
DEVICES = (H100, H100_PCIE, H200, B200, A100_40, A100_80, SM86, SM89)

SHAPES = ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (4096, 11008), (11008, 4096), (28672, 8192),
          (8192, 28672), (10240, 2048), (1536, 2048), (6144, 4096), (4096, 6144), (12288, 4096), (4096, 12288),
          (40, 256), (4104, 130), (4128, 1000), (128256, 4096), (2048, 2048), (5120, 5120))  # (out, in)
TOKENS = (0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 100, 127, 128, 129, 159, 160, 191, 192, 193, 200,
          255, 256, 257, 300, 384, 385, 416, 417, 448, 449, 511, 512, 513, 640, 672, 673, 700, 768, 769, 896, 897,
          1023, 1024, 1025, 2048, 4096, 8192)
BITS = (2, 3, 4, 5)
CUBLAS = dispatch.DEQUANTIZE_CUBLAS


def config_of(chosen: Plan, bits: int):
    return next(c for c in CONFIGS if c.bits == bits and c.key ==
                (chosen.mb, chosen.wgmma_tiles, chosen.ws_tokens, chosen.k_split))


# ----------------------------------------------------------------------------- the table's decisions, longhand
def hopper_rules(M, N, K, bits, sms, path="auto"):
    """The crossover table's decisions for compute capability 9.x written out as plain conditions (weights counted
    with K padded to 32)."""
    K = -(-K // 32) * 32
    W = N * K
    if path == "auto":
        if W >= 1 << 24:
            through = math.inf
        elif W >= 1 << 21 and bits != 5:
            through = 128
        else:
            through = 64
        if M > through:
            return CUBLAS
    kg = -(-K // 256)

    def steps(mb):
        return -(-M // (mb * 8)) * -(-N // 256) * kg

    tokens = 32 if M <= 32 else 64 if M <= 64 else 128
    faster = M > 512 or (M > 16 and W >= 1 << 24) or (16 < M <= (64 if bits == 5 else 128)
                                                       and steps(tokens // 8) < 2 * sms)
    if path == "ws" or (path != "classic" and faster):
        few_steps = steps(16) < 12 * sms
        if tokens == 128 and ((bits != 5 and (M >= 897 or 673 <= M <= 768 or (193 <= M <= 256 and N >= 14336)
                                               or (385 <= M <= 448 and N <= 4096)
                                               or (M >= 417 and steps(32) >= 32 * sms)
                                               or (449 <= M <= 512 and (N <= 10240 or M == 512))))
                              or (bits == 5 and (129 <= M <= 256 or M >= 385 or (M >= 257 and N <= 4096)))):
            tokens = 256  # 256-token tiles
        elif tokens == 128 and bits != 5 and ((M <= 512 and few_steps) or 129 <= M <= 192):
            tokens = 64  # 64-token tiles past 64 tokens
        return Plan(Path.WARP_SPECIALIZED, tokens // 8, 0, tokens)

    if path != "ws" and 1 <= M <= 16 and steps(1) < 2 * sms:
        return Plan(Path.K_SPLIT, 1 if M <= 8 else 2, 0, 0, 8)

    wgmma = M > 32 and steps(8) >= 16 * sms
    mb = 1 if M <= 8 else 2 if M <= 16 else 4 if not wgmma else 8 if M <= 64 else 16
    tiles = 0 if not wgmma else 2 if mb == 8 or (bits != 5 and steps(16) >= 16 * sms) else 1
    return Plan(Path.WGMMA if tiles else Path.MMA_SYNC, mb, tiles, 0)


def other_gpu_rules(M, bits):
    """The same for every other GPU whose shared memory holds every mma.sync configuration."""
    if M >= {2: 160, 3: 160, 4: 192, 5: 128}[bits]:
        return CUBLAS
    mb = 1 if M <= 8 else 2 if M <= 16 else 4
    return Plan(Path.MMA_SYNC, mb, 0, 0)


@pytest.mark.parametrize("device", (H100, H100_PCIE, H200), ids=lambda d: d.name)
@pytest.mark.parametrize("bits", BITS)
def test_hopper_decisions_unchanged(device, bits):
    for N, K in SHAPES:
        for M in TOKENS:
            want = hopper_rules(M, N, K, bits, device.sms)
            got = dispatch.plan(device, CONFIGS, N, K, M, bits)
            assert got == want, f"N={N} K={K} M={M} bits={bits}"
            if got.path is not Path.DEQUANTIZE_CUBLAS:
                assert dispatch.plan(device, CONFIGS, N, K, M, bits, fused_only=True) == got


@pytest.mark.parametrize("bits", BITS)
def test_hopper_fused_only_and_forced_paths_unchanged(bits):
    for N, K in SHAPES:
        for M in TOKENS:
            where = f"N={N} K={K} M={M} bits={bits}"
            fused = dispatch.plan(H100, CONFIGS, N, K, M, bits, fused_only=True)
            assert fused == hopper_rules(M, N, K, bits, H100.sms, path="fused"), where
            for env, path in (("ws", "ws"), ("classic", "classic")):
                forced = dispatch.plan(H100, CONFIGS, N, K, M, bits, fused_only=True, force=dispatch.FORCED_PATHS[env])
                assert forced == hopper_rules(M, N, K, bits, H100.sms, path=path), f"{where} {env}"
            split = dispatch.plan(H100, CONFIGS, N, K, M, bits, fused_only=True, force=dispatch.FORCED_PATHS["k_split"])
            want = Plan(Path.K_SPLIT, 1 if M <= 8 else 2, 0, 0, 8) if M <= 16 else fused
            assert split == want, f"{where} k_split"


@pytest.mark.parametrize("bits", BITS)
def test_other_gpus_with_room_unchanged(bits):
    for N, K in SHAPES:
        for M in TOKENS:
            assert dispatch.plan(B200, CONFIGS, N, K, M, bits) == other_gpu_rules(M, bits), f"N={N} K={K} M={M}"


# ----------------------------------------------------------------------------- never a configuration that cannot run
@pytest.mark.parametrize("device", DEVICES, ids=lambda d: d.name)
@pytest.mark.parametrize("bits", BITS)
def test_every_fused_plan_runs_on_its_gpu(device, bits):
    for N, K in SHAPES:
        for M in TOKENS:
            for fused_only in (False, True):
                try:
                    chosen = dispatch.plan(device, CONFIGS, N, K, M, bits, fused_only=fused_only)
                except dispatch.NoFusedConfig:
                    assert fused_only and not any(c.bits == bits and c.runs_on(device) for c in CONFIGS)
                    continue
                if chosen.path is not Path.DEQUANTIZE_CUBLAS:
                    config = config_of(chosen, bits)
                    assert config.smem_bytes <= device.smem_per_block and config.runs_on(device), (N, K, M, chosen)


def mma(mb):
    return Plan(Path.MMA_SYNC, mb, 0, 0)


@pytest.mark.parametrize("device", (A100_40, A100_80), ids=lambda d: d.name)
def test_a100(device):
    """163 KB per block: K = 4 has no mma.sync configuration that fits (223 KB), K = 2 only 8-token passes, K = 3
    and K = 5 16. Smaller passes read the weights more often: dequantize + cuBLAS takes over that much sooner."""
    N, K = 14336, 4096
    expect = {
        2: {1: mma(1), 8: mma(1), 9: mma(1), 16: mma(1), 17: mma(1), 39: mma(1), 40: CUBLAS, 159: CUBLAS},
        3: {1: mma(2), 9: mma(2), 16: mma(2), 17: mma(2), 79: mma(2), 80: CUBLAS, 159: CUBLAS},
        4: {0: CUBLAS, 1: CUBLAS, 16: CUBLAS, 64: CUBLAS, 191: CUBLAS},
        5: {1: mma(2), 16: mma(2), 17: mma(2), 63: mma(2), 64: CUBLAS, 127: CUBLAS},
    }
    for bits, by_m in expect.items():
        for M, want in by_m.items():
            assert dispatch.plan(device, CONFIGS, N, K, M, bits) == want, f"bits={bits} M={M}"
    assert dispatch.plan(device, CONFIGS, N, K, 100, 2, fused_only=True) == mma(1)
    with pytest.raises(dispatch.NoFusedConfig, match="no fused GEMM configuration at 4 bits"):
        dispatch.plan(device, CONFIGS, N, K, 1, 4, fused_only=True)


@pytest.mark.parametrize("device", (SM86, SM89), ids=lambda d: d.name)
def test_99_kb_gpus_take_dequantize_cublas(device):
    for bits in BITS:
        for M in (1, 16, 64, 1024):
            assert dispatch.plan(device, CONFIGS, 4096, 4096, M, bits) == CUBLAS
        with pytest.raises(dispatch.NoFusedConfig, match="99 KB"):
            dispatch.plan(device, CONFIGS, 4096, 4096, 1, bits, fused_only=True)


def test_forced_path_that_cannot_run_is_ignored():
    ws = dispatch.FORCED_PATHS["ws"]
    assert dispatch.plan(A100_80, CONFIGS, 4096, 4096, 1, 3, fused_only=True, force=ws) == mma(2)
    forced = dispatch.plan(H100, CONFIGS, 4096, 4096, 1, 3, fused_only=True, force=ws)
    assert forced == Plan(Path.WARP_SPECIALIZED, 4, 0, 32)
    wgmma = dispatch.plan(H100, CONFIGS, 4096, 4096, 1, 5, fused_only=True, force=dispatch.FORCED_PATHS["wgmma"])
    assert wgmma == Plan(Path.WGMMA, 8, 2, 0)
    assert dispatch.plan(H100, CONFIGS, 4096, 4096, 200, 5, fused_only=True,
                         force=dispatch.FORCED_PATHS["mma_sync"]) == mma(4)


# ----------------------------------------------------------------------------- the table and the configurations
def test_configurations_report():
    assert {c.bits for c in CONFIGS} == set(BITS)
    for c in CONFIGS:
        assert c.path is (Path.WARP_SPECIALIZED if c.ws_tokens else Path.WGMMA if c.wgmma_tiles else
                          Path.K_SPLIT if c.k_split > 1 else Path.MMA_SYNC)
        assert c.ws_tokens in (0, c.mb * 8) and c.k_split in (1, 8)
        if c.k_split > 1:
            assert c.mb in (1, 2) and (c.wgmma_tiles, c.ws_tokens, c.cc_major_min) == (0, 0, 9)
        if c.path in (Path.WGMMA, Path.WARP_SPECIALIZED):
            assert (c.cc_major_min, c.cc_major_max) == (9, 9)  # sm_90a code
        assert c.smem_bytes <= H100.smem_per_block
    for bits in BITS:  # every bit width has each pass size the planner names
        built = {c.key for c in CONFIGS if c.bits == bits}
        assert {(1, 0, 0, 1), (2, 0, 0, 1), (4, 0, 0, 1), (8, 2, 0, 1), (16, 1, 0, 1), (4, 0, 32, 1), (8, 0, 64, 1),
                (16, 0, 128, 1), (1, 0, 0, 8), (2, 0, 0, 8)} <= built
    text = json.dumps([c._asdict() for c in CONFIGS])
    assert dispatch.parse_configs(text) == CONFIGS


def test_crossover_table_says_where_and_when():
    for row in dispatch.CROSSOVERS:
        assert row.measured.gpu and row.measured.date and row.measured.commit and row.measured.source
        assert set(row.bits) <= set(BITS) and row.m >= 1
    for gpus in dispatch.Gpus:  # every bit width has a crossover to dequantize + cuBLAS for all weights
        for bits in BITS:
            assert any(r.gpus is gpus and r.rule is dispatch.Rule.FUSED_THROUGH and bits in r.bits and
                       r.min_weights == r.min_out_features == r.min_steps_per_sm == 0 for r in dispatch.CROSSOVERS)


# ----------------------------------------------------------------------------- the tuned cache
@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KBIT_CACHE_DIR", str(tmp_path))
    dispatch.forget()
    yield tmp_path
    dispatch.forget()


def entry(bits, out_features, in_features, tokens, **us):
    return {"bits": bits, "out_features": out_features, "in_features": in_features, "tokens": list(tokens), "us": us}


# 4096x4096 at 4 bits on an H100, times made up so that each count's fastest path is not the table's (the
# warp-specialized kernel at all three): wgmma at 32 tokens, cuBLAS at 128 and 512
TUNED = entry(4, 4096, 4096, (32, 128, 512),
              mma_sync=[30.0, 90.0, 400.0], wgmma=[25.0, 80.0, 300.0], warp_specialized=[40.0, 100.0, None],
              dequantize_cublas=[50.0, 70.0, 250.0])


def test_cache_round_trip(cache_dir):
    path = tune_cache.save(H100, [TUNED])
    assert path.parent == cache_dir / "tuned" and "H100" in path.name and "kbit-" in path.name
    assert tune_cache.cache_file(H100.name) == path and tune_cache.cache_file(H200.name) != path
    tuned = tune_cache.load(H100)
    shape = tuned[(4, 4096, 4096)]
    assert shape.tokens == (32, 128, 512)
    assert shape.us[Path.WARP_SPECIALIZED] == (40.0, 100.0, None)
    assert tune_cache.load(H200) is None  # another GPU: another file, none here


def test_cache_file_is_fsynced_before_it_replaces_the_old(cache_dir, monkeypatch):
    """Replaced by rename: without an fsync of the file first, a power loss can leave an empty file in its place."""
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = tune_cache.save(H100, [TUNED])
    assert len(synced) == 2 and synced[0].startswith(str(path.parent / f".{path.name}."))  # the file, under its
    assert synced[1] == str(path.parent)  # temporary name; then the folder, after the rename


def test_planner_honours_the_cache(cache_dir):
    tune_cache.save(H100, [TUNED])
    tuned = tune_cache.load(H100)

    def chosen(M, N=4096, K=4096, **kw):
        return dispatch.plan(H100, CONFIGS, N, K, M, 4, tuned=tuned, **kw)

    ws32 = Plan(Path.WARP_SPECIALIZED, 4, 0, 32)
    assert dispatch.plan(H100, CONFIGS, 4096, 4096, 32, 4) == ws32  # the table
    assert chosen(32) == chosen(17) == Plan(Path.WGMMA, 8, 2, 0)  # measured faster at 32: from 17 to 32 tokens
    assert chosen(100) == CUBLAS  # the first tuned count >= 100 is 128, where cuBLAS was fastest
    assert chosen(100, fused_only=True) == Plan(Path.WGMMA, 16, 1, 0)
    assert chosen(5000) == CUBLAS  # past the last tuned count: its measurements
    assert chosen(32, force=dispatch.FORCED_PATHS["ws"], fused_only=True).path is Path.WARP_SPECIALIZED
    assert dispatch.plan(H100, CONFIGS, 1024, 4096, 32, 4, tuned=tuned) == ws32  # an untuned shape: the table
    assert dispatch.plan(H100, CONFIGS, 4096, 4096, 32, 3, tuned=tuned) == ws32  # an untuned bit width too


def test_tuned_path_that_cannot_run_falls_back(cache_dir):
    tuned = {(4, 14336, 4096): tune_cache.TunedShape((64,), {Path.WGMMA: (1.0,), Path.MMA_SYNC: (2.0,)})}
    assert dispatch.plan(A100_80, CONFIGS, 14336, 4096, 64, 4, tuned=tuned) == CUBLAS  # nothing fits at 4 bits
    tuned = {(3, 14336, 4096): tune_cache.TunedShape((64,), {Path.WGMMA: (1.0,), Path.MMA_SYNC: (2.0,)})}
    assert dispatch.plan(A100_80, CONFIGS, 14336, 4096, 16, 3, tuned=tuned) == mma(2)


@pytest.mark.parametrize("corrupt", [
    "{not json",
    json.dumps([1, 2]),
    json.dumps({"format": 2}),
    "WRONG_DEVICE",
    "OLD_VERSION",
    json.dumps({"format": 1, "shapes": []}),
    "BAD:" + json.dumps(entry(4, 64, 64, (1, 2), mma_sync=[1.0, -1.0])),
    "BAD:" + json.dumps(entry(4, 64, 64, (2, 1), mma_sync=[1.0, 1.0])),
    "BAD:" + json.dumps(entry(4, 64, 64, (1, 2), mma_sync=[1.0])),
    "BAD:" + json.dumps(entry(4, 64, 64, (1,), cutlass=[1.0])),
    "BAD:" + json.dumps(entry(6, 64, 64, (1,), mma_sync=[1.0])),
    "BAD:" + json.dumps(entry(4, 0, 64, (1,), mma_sync=[1.0])),
    "BAD:" + json.dumps(entry(4, 64, 64, (1,), mma_sync=["fast"])),
    "BAD:" + json.dumps(entry(4, 64, 64, (1,), mma_sync=[math.inf])).replace("Infinity", "1e999"),
    "BAD:" + json.dumps(entry(True, 64, 64, (1,), mma_sync=[1.0])),
], ids=lambda s: s[:20])
def test_unusable_cache_is_ignored_with_a_warning(cache_dir, corrupt):
    path = tune_cache.save(H100, [TUNED])
    data = json.loads(path.read_text())
    if corrupt == "WRONG_DEVICE":
        data["device"] = "NVIDIA H200"
        text = json.dumps(data)
    elif corrupt == "OLD_VERSION":
        data["kbit"] = "0.0.1"
        text = json.dumps(data)
    elif corrupt.startswith("BAD:"):
        data["shapes"] = [json.loads(corrupt[4:])]
        text = json.dumps(data)
    else:
        text = corrupt
    path.write_text(text)
    with pytest.warns(UserWarning, match="ignoring the tuned dispatch cache"):
        assert tune_cache.load(H100) is None


def test_save_refuses_what_load_would_ignore(cache_dir):
    with pytest.raises(ValueError):
        tune_cache.save(H100, [entry(4, 64, 64, (1,), mma_sync=[-1.0])])
    assert not (cache_dir / "tuned").exists() or not any((cache_dir / "tuned").iterdir())


# ----------------------------------------------------------------------------- on a (stand-in) CUDA device
@pytest.fixture
def h100_here(cache_dir):
    """The planner's facts for cuda:0 as an H100 with the tuned cache above, without a GPU."""
    tune_cache.save(H100, [TUNED])
    dispatch._FACTS[0] = dispatch.DeviceFacts(H100, CONFIGS, tune_cache.load(H100))
    yield torch.device("cuda", 0)


def test_gemm_plan_uses_facts_cache_and_path_override(h100_here, monkeypatch):
    monkeypatch.delenv(dispatch.PATH_ENV, raising=False)
    assert dispatch.gemm_plan(h100_here, 4096, 4096, 100, 4) == CUBLAS  # tuned
    split = Plan(Path.K_SPLIT, 1, 0, 0, 8)
    assert dispatch.gemm_plan(h100_here, 1024, 4096, 1, 4) == split  # table
    monkeypatch.setenv(dispatch.PATH_ENV, "ws")  # read at every call
    assert dispatch.gemm_plan(h100_here, 1024, 4096, 1, 4, fused_only=True) == Plan(Path.WARP_SPECIALIZED, 4, 0, 32)
    assert dispatch.gemm_plan(h100_here, 1024, 4096, 1, 4) == split  # never whether the fused path is taken
    assert dispatch.gemm_plan(h100_here, 1024, 4096, 1000, 4) == CUBLAS
    monkeypatch.setenv(dispatch.PATH_ENV, "classic")
    assert dispatch.gemm_plan(h100_here, 8192, 28672, 64, 4, fused_only=True) == Plan(Path.WGMMA, 8, 2, 0)
    monkeypatch.setenv(dispatch.PATH_ENV, "something else")
    assert dispatch.gemm_plan(h100_here, 28672, 8192, 64, 4, fused_only=True) == Plan(Path.WARP_SPECIALIZED, 8, 0, 64)
    dispatch.forget()
    assert not dispatch._FACTS and not dispatch._PLANS


# ----------------------------------------------------------------------------- python -m kbit tune, without a GPU
def test_tune_arguments():
    from kbit import tune

    assert tune._shapes("4096->14336, 8192x28672") == [(4096, 14336), (8192, 28672)]
    assert tune._int_list("1,16, 64", "--tokens") == [1, 16, 64]
    for bad in ("4096", "4096->0", "a->b"):
        with pytest.raises(SystemExit):
            tune._shapes(bad)
    with pytest.raises(SystemExit):
        tune._int_list("1,-2", "--tokens")


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures when a GPU is visible")
def test_tune_without_a_gpu_says_so(capsys):
    import argparse

    from kbit import tune

    parser = argparse.ArgumentParser()
    tune.add_arguments(parser)
    assert tune.main(parser.parse_args(["--bits", "4"])) == 2
    assert "no CUDA device" in capsys.readouterr().err
