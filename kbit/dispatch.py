"""The GEMM dispatch planner: which path and configuration compute ``x @ W_hat.T`` on a CUDA device.

``plan(device, configs, out_features, in_features, tokens, bits)`` returns one of four paths and, for the fused
ones, the configuration the binding runs:

- ``mma_sync``: gemm.cuh's kernel with mma.sync, 8, 16 or 32 tokens per pass (every GPU);
- ``k_split``: the same with up to 16 tokens, the CTA's 8 warps splitting the k-groups of 32-row tiles (16-row at 9-16
  tokens; sm_90 on):
  small shapes without split-K across CTAs;
- ``wgmma``: gemm.cuh's kernel with wgmma, 64 or 128 tokens per pass, 128- or 256-row tiles (sm_90a);
- ``warp_specialized``: gemm_ws.cuh's kernel, 32, 64, 128 or 256 tokens per tile (sm_90a);
- ``dequantize_cublas``: the weight dequantized to x's dtype, then ``F.linear`` (cuBLAS).

It decides from three kinds of facts, each with one owner:

- the configurations built, their shared memory and the compute capabilities their code is built for: the CUDA
  extension reports them from its compile-time lists (``gemm_configs`` in gemm.cu), so a configuration that is
  not built, or that needs more shared memory than the GPU allows per block, is never picked;
- ``CROSSOVERS``: where one path overtakes another, as measured, with where and when;
- crossovers measured on this GPU by ``python -m kbit tune`` for given shapes (``kbit.tune_cache``), used for
  those shapes when present.

The binding executes the configuration it is given (it sizes only the grid and the split-K workspace) and refuses
one that is not built for the GPU or does not fit it. ``KBIT_GEMM_PATH`` (``ws``, ``classic``, ``mma_sync``,
``wgmma``, ``k_split``) forces the fused kernel, read at every call so a benchmark can switch it in-process; a forced path
the GPU cannot run is ignored.
"""

from __future__ import annotations

import enum
import math
import os
from typing import Iterable, Mapping, NamedTuple, Optional

import torch

from ._build import cuda_ext
from .formats import padded_in_features
from .gemm_facts import FUSED_PATHS, Device, GemmConfig, Path, parse_configs

PATH_ENV = "KBIT_GEMM_PATH"
# KBIT_GEMM_PATH values: the fused paths allowed ("classic" = gemm.cuh's kernel, mma.sync or wgmma by the table).
FORCED_PATHS = {
    "ws": frozenset({Path.WARP_SPECIALIZED}),
    "classic": frozenset({Path.MMA_SYNC, Path.K_SPLIT, Path.WGMMA}),
    "mma_sync": frozenset({Path.MMA_SYNC}),
    "k_split": frozenset({Path.K_SPLIT}),
    "wgmma": frozenset({Path.WGMMA}),
}


class Plan(NamedTuple):
    """What runs: a path and, for the fused ones, the configuration the binding receives."""

    path: Path
    mb: int = 0
    wgmma_tiles: int = 0
    ws_tokens: int = 0
    k_split: int = 1

    @classmethod
    def of(cls, config: GemmConfig) -> "Plan":
        return cls(config.path, config.mb, config.wgmma_tiles, config.ws_tokens, config.k_split)


DEQUANTIZE_CUBLAS = Plan(Path.DEQUANTIZE_CUBLAS)


class NoFusedConfig(RuntimeError):
    """No fused GEMM configuration of this bit width runs on this GPU."""


# ---------------------------------------------------------------------------------------------- measured crossovers
# Each crossover names where it was measured. Files under benchmarks/results/ that the tree no longer holds (the ws_*
# A/B records) and the one-experiment scripts (bench_ws_tiles.py, bench_gemm_paths.py) are in git history:
# `git show 3ea9876:<path>`. The numbers per rule: docs/PERFORMANCE.md, "Planner crossovers".
class Measured(NamedTuple):
    gpu: str
    commit: str  # the code measured
    date: str
    source: str  # where the numbers are


H100_MMA_SYNC = Measured("H100 80GB HBM3", "faa39cf", "2026-11-21",
                         "benchmarks/results/gemm_NVIDIA_H100_80GB_HBM3_m128_256.md and _m160_224.md, as of a0567f5")
H100_WGMMA = Measured("H100 80GB HBM3", "776473c", "2026-11-21",
                      "benchmarks/results/gemm_NVIDIA_H100_80GB_HBM3_m32_64.md and _m128_256.md, as of 776473c")
H200_WARP_SPECIALIZED = Measured("H200", "3e48a9a", "2026-11-23",
                                 "benchmarks/bench_gemm_paths.py; docs/PERFORMANCE.md, H200, GEMM 32 to 4096 tokens")
H200_K_SPLIT = Measured("H200", "a99b6b6", "2026-11-23",
                        "bench_gemm.py --m 1,4,8 --k 2,3,4,5, eleven shapes, KBIT_GEMM_PATH=mma_sync against k_split; "
                        "docs/PERFORMANCE.md, H200, GEMM up to 16 tokens")
H200_WS_TILES = Measured("H200", "feea81a", "2026-11-26",
                         "benchmarks/bench_ws_tiles.py (benchmarks/results/ws_tiles_NVIDIA_H200.md)")
H200_WS_256 = Measured("H200", "5ee9822", "2026-11-27",
                       "benchmarks/bench_ws_tiles.py --tiles 128,256 and --tiles 64,256, bits 2..5, 192-4096 tokens "
                       "(benchmarks/results/ws_tiles_256_NVIDIA_H200.md)")
H200_WS_256_BY_COPY = Measured("H200", "0df46a1", "2026-11-27",
                               "benchmarks/bench_ws_tiles.py --tiles 128,256 --bits 2,3,4, 448-896 tokens, tiles "
                               "stored by copy (benchmarks/results/ws_tiles_256_by_copy_NVIDIA_H200.md)")
H200_WS_256_IN_PARTS = Measured("H200", "06143c2", "2026-11-27",
                                "bench_gemm.py --k 2,3,4 --m 449,512, nine seed shapes (H100: the six whose plan "
                                "changed), 256-token tiles from 449 through 512 everywhere against 06143c2's planner "
                                "in one call, one build; docs/PERFORMANCE.md, predictions")
H200_WS_256_FULL_PASSES = Measured("H200", "637cc9c", "2026-11-27",
                                   "benchmarks/bench_ws_tiles.py --tiles 128,256 --bits 2,3,4, 385-1023 tokens, six "
                                   "to eight shapes, min of two; H100 400-432 and 656-1023 (benchmarks/results/"
                                   "ws_tiles_256_full_passes_NVIDIA_H200.md and _H100_80GB_HBM3.md)")
H200_WS_256_TAILS = Measured("H200", "d51f1d5", "2026-11-27",
                              "benchmarks/bench_ws_tiles.py --tiles 128,256, 160-864 tokens, k = 4 on seven shapes, "
                              "k = 2, 3, 5 on four, the tail passes' boxes (benchmarks/results/"
                              "ws_tiles_256_tails_NVIDIA_H200.md)")
H200_PATHS = Measured("H200", "637cc9c", "2026-11-27",
                      "python -m kbit tune --bits 2,3,4,5, 17-4096 tokens (16 to 20 counts per bit width), the nine "
                      "seed shapes and 2048->1408, 2048->768 (benchmarks/results/tune_NVIDIA_H200.json); H100 k = 4, "
                      "six shapes (tune_NVIDIA_H100_80GB_HBM3.json)")
H100_K3_BYTE_PAIRS = Measured("H100 80GB HBM3", "e805931", "2026-11-26",
                              "bench_gemm.py --m 1,4,8,16 --k 3,4, 4096->4096 2048->1536 2048->10240 4096->14336, "
                              "KBIT_GEMM_PATH=mma_sync against k_split; docs/PERFORMANCE.md, k = 3 byte-aligned pairs")


class Rule(str, enum.Enum):
    FUSED_THROUGH = "the fused kernel beats dequantize + cuBLAS through m tokens"
    WARP_SPECIALIZED_FROM = "gemm_ws.cuh's kernel beats gemm.cuh's from m tokens"
    WGMMA_FROM = "gemm.cuh's wgmma beats its mma.sync from m tokens"
    WIDE_TILES_FROM = "256-row wgmma tiles beat 128-row ones from m tokens"
    K_SPLIT_FROM = "the warps splitting 32- or 16-row tiles' k-groups beat 256-row tiles from m tokens (built up to 16)"
    WS_64_TOKEN_TILES_FROM = "gemm_ws.cuh's 64-token tiles beat its 128-token ones from m tokens (steps counted in 128)"
    WS_256_TOKEN_TILES_FROM = "gemm_ws.cuh's 256-token tiles beat its 128- and 64-token ones from m tokens"


class Gpus(str, enum.Enum):
    WGMMA = "GPUs that run the wgmma configurations (compute capability 9.x)"
    MMA_SYNC_ONLY = "every other GPU"


ALL_BITS = (2, 3, 4, 5)


class Crossover(NamedTuple):
    """``rule`` at ``m`` tokens, for weights of at least ``min_weights`` elements (out_features x in_features padded
    to 32) and ``min_out_features`` to ``max_out_features`` rows, where each SM has at least ``min_steps_per_sm``
    and fewer than ``max_steps_per_sm`` steps (token passes x 256-row tiles x 256-column k-groups) in the
    configuration the rule would pick, up to ``through`` tokens."""

    gpus: Gpus
    rule: Rule
    m: float  # tokens; math.inf: at every token count
    measured: Measured
    bits: tuple = ALL_BITS
    min_weights: int = 0
    min_out_features: int = 0
    max_out_features: float = math.inf
    min_steps_per_sm: int = 0
    max_steps_per_sm: float = math.inf
    through: float = math.inf


# Of several rows that hold, FUSED_THROUGH takes the largest m, the *_FROM rules the smallest.
CROSSOVERS = (
    # mma.sync reads the weights once per 32 tokens, dequantize + cuBLAS about twice whatever M.
    Crossover(Gpus.MMA_SYNC_ONLY, Rule.FUSED_THROUGH, 159, H100_MMA_SYNC, bits=(2, 3)),
    Crossover(Gpus.MMA_SYNC_ONLY, Rule.FUSED_THROUGH, 191, H100_MMA_SYNC, bits=(4,)),
    Crossover(Gpus.MMA_SYNC_ONLY, Rule.FUSED_THROUGH, 127, H100_MMA_SYNC, bits=(5,)),
    # The fused kernel against dequantize + cuBLAS: from 16M weights the warp-specialized kernel wins at every count
    # measured; below, its tiles are too few past 128 tokens (64 at K = 5).
    Crossover(Gpus.WGMMA, Rule.FUSED_THROUGH, 64, H100_WGMMA),
    Crossover(Gpus.WGMMA, Rule.FUSED_THROUGH, 128, H200_PATHS, bits=(2, 3, 4), min_weights=1 << 21),
    Crossover(Gpus.WGMMA, Rule.FUSED_THROUGH, math.inf, H200_PATHS, min_weights=1 << 24),
    # The warp-specialized kernel (steps counted in its 256-row tiles of 32, 64 or 128 tokens) beats gemm.cuh's on
    # large weights, past 512 tokens everywhere, and where its tiles leave each SM few steps (split in slices).
    Crossover(Gpus.WGMMA, Rule.WARP_SPECIALIZED_FROM, 513, H200_WARP_SPECIALIZED),
    Crossover(Gpus.WGMMA, Rule.WARP_SPECIALIZED_FROM, 17, H200_PATHS, min_weights=1 << 24),
    Crossover(Gpus.WGMMA, Rule.WARP_SPECIALIZED_FROM, 17, H200_PATHS, bits=(2, 3, 4), max_steps_per_sm=2,
              through=128),
    Crossover(Gpus.WGMMA, Rule.WARP_SPECIALIZED_FROM, 17, H200_PATHS, bits=(5,), max_steps_per_sm=2, through=64),
    # gemm.cuh's wgmma where every SM has many steps (and the warp-specialized kernel is not taken): below that
    # mma.sync's 32-token passes are faster. 256-row tiles halve the activations' traffic from L2 there; elsewhere the
    # extra split-K costs more.
    Crossover(Gpus.WGMMA, Rule.WGMMA_FROM, 33, H100_WGMMA, min_steps_per_sm=16),
    Crossover(Gpus.WGMMA, Rule.WIDE_TILES_FROM, 1, H100_WGMMA, min_steps_per_sm=16),
    # Up to 16 tokens, the warps splitting k (32-row tiles; 16-row at 9-16) where 256-row tiles leave each SM fewer
    # than 2 steps: there each 256-row tile is split over several CTAs, and their hand-off is a large part of the call.
    Crossover(Gpus.WGMMA, Rule.K_SPLIT_FROM, 1, H200_K_SPLIT, bits=(2, 4, 5), max_steps_per_sm=2),
    Crossover(Gpus.WGMMA, Rule.K_SPLIT_FROM, 1, H100_K3_BYTE_PAIRS, bits=(3,), max_steps_per_sm=2),
    # The warp-specialized kernel's 64-token tiles (byte-row tables) past 64 tokens where 128-token tiles leave each SM
    # few steps, and at 129-192 tokens, three 64-token passes against two of 128 that waste a quarter of their tokens.
    Crossover(Gpus.WGMMA, Rule.WS_64_TOKEN_TILES_FROM, 65, H200_WS_TILES, bits=(2, 3, 4), max_steps_per_sm=12,
              through=512),
    Crossover(Gpus.WGMMA, Rule.WS_64_TOKEN_TILES_FROM, 129, H200_WS_TILES, bits=(2, 3, 4), through=192),
    # 256-token tiles: each looked-up weight serves twice the tokens. K = 2..4 from 1024 tokens, and at 193-256 on
    # >= 14336 rows, whose 128-row tiles give nearly every SM one; K = 5 wherever its tiles are not mostly padding.
    Crossover(Gpus.WGMMA, Rule.WS_256_TOKEN_TILES_FROM, 1024, H200_WS_256, bits=(2, 3, 4)),
    # With tiles stored by copy, from two 256-token passes where they give each SM >= 32 steps (the 235M shapes).
    Crossover(Gpus.WGMMA, Rule.WS_256_TOKEN_TILES_FROM, 449, H200_WS_256_BY_COPY, bits=(2, 3, 4), min_steps_per_sm=32),
    # With tiles cut in parts (no tile across three CTAs), two 256-token passes through 512 tokens; from 512 only on
    # the shapes whose second pass at 449 tokens is three quarters full.
    Crossover(Gpus.WGMMA, Rule.WS_256_TOKEN_TILES_FROM, 449, H200_WS_256_IN_PARTS, bits=(2, 3, 4),
              max_out_features=10240, through=512),
    Crossover(Gpus.WGMMA, Rule.WS_256_TOKEN_TILES_FROM, 512, H200_WS_256_IN_PARTS, bits=(2, 3, 4), through=512),
    # Where 256-token passes pad as many tokens as 128-token ones (673-768, 897-1023; 385-448 on 4096 rows, where
    # they are few enough to be cut in parts, and from 417 where each SM has >= 32 steps).
    Crossover(Gpus.WGMMA, Rule.WS_256_TOKEN_TILES_FROM, 385, H200_WS_256_FULL_PASSES, bits=(2, 3, 4),
              max_out_features=4096, through=448),
    Crossover(Gpus.WGMMA, Rule.WS_256_TOKEN_TILES_FROM, 417, H200_WS_256_FULL_PASSES, bits=(2, 3, 4),
              min_steps_per_sm=32, through=448),
    Crossover(Gpus.WGMMA, Rule.WS_256_TOKEN_TILES_FROM, 673, H200_WS_256_FULL_PASSES, bits=(2, 3, 4), through=768),
    Crossover(Gpus.WGMMA, Rule.WS_256_TOKEN_TILES_FROM, 897, H200_WS_256_FULL_PASSES, bits=(2, 3, 4), through=1023),
    Crossover(Gpus.WGMMA, Rule.WS_256_TOKEN_TILES_FROM, 193, H200_WS_256, bits=(2, 3, 4), min_out_features=14336,
              through=256),
    Crossover(Gpus.WGMMA, Rule.WS_256_TOKEN_TILES_FROM, 129, H200_WS_256, bits=(5,), through=256),
    Crossover(Gpus.WGMMA, Rule.WS_256_TOKEN_TILES_FROM, 385, H200_WS_256, bits=(5,)),
    # K = 5 at 257-384 on 4096 rows, since a last pass its tokens do not fill reads only those (ws_copy_box).
    Crossover(Gpus.WGMMA, Rule.WS_256_TOKEN_TILES_FROM, 257, H200_WS_256_TAILS, bits=(5,), max_out_features=4096,
              through=384),
)

STEP_TILE = 256  # the rows and the columns of one step, as the crossovers count steps


# ---------------------------------------------------------------------------------------------- the planner
class _Problem(NamedTuple):
    device: Device
    built: dict  # GemmConfig.key -> GemmConfig, this bit width
    out_features: int
    in_features: int  # padded to 32
    tokens: int
    bits: int

    @classmethod
    def of(cls, device, configs, out_features, in_features, tokens, bits) -> "_Problem":
        return cls(device, {c.key: c for c in configs if c.bits == bits},
                   out_features, padded_in_features(in_features), tokens, bits)

    @property
    def weights(self) -> int:
        return self.out_features * self.in_features

    @property
    def gpus(self) -> Gpus:
        wgmma_here = any(c.path in (Path.WGMMA, Path.WARP_SPECIALIZED) and self.runs(c) for c in self.built.values())
        return Gpus.WGMMA if wgmma_here else Gpus.MMA_SYNC_ONLY

    def steps(self, tokens_per_pass: int) -> int:
        return (-(-self.tokens // tokens_per_pass) * -(-self.out_features // STEP_TILE)
                * -(-self.in_features // STEP_TILE))

    def runs(self, config: Optional[GemmConfig]) -> bool:
        return config is not None and config.runs_on(self.device)


def _holding(p: _Problem, rule: Rule, tokens_per_pass: int = 0) -> list:
    """The m of every crossover of ``rule`` whose conditions hold (steps counted in passes of tokens_per_pass)."""
    steps = p.steps(tokens_per_pass) if tokens_per_pass else 0
    gpus = p.gpus
    return [c.m for c in CROSSOVERS
            if c.gpus is gpus and c.rule is rule and p.bits in c.bits and p.weights >= c.min_weights
            and c.min_out_features <= p.out_features <= c.max_out_features
            and c.min_steps_per_sm * p.device.sms <= steps < c.max_steps_per_sm * p.device.sms
            and p.tokens <= c.through]


def _starts(p: _Problem, rule: Rule, tokens_per_pass: int = 0) -> bool:
    """Whether ``rule`` holds at p.tokens: one of its crossovers lies at or below them."""
    return any(p.tokens >= m for m in _holding(p, rule, tokens_per_pass))


def _ws_measured_tokens(M: int) -> int:
    """The warp-specialized kernel's tokens per tile as its path crossovers count steps: the smallest that holds M,
    128 past that."""
    return 32 if M <= 32 else 64 if M <= 64 else 128


def _ws_tokens(p: _Problem) -> int:
    """The warp-specialized kernel's tokens per tile: as measured for its path, or past 64 tokens 256 or 64 where
    those crossovers hold (256 first)."""
    tokens = _ws_measured_tokens(p.tokens)
    if tokens != 128:
        return tokens
    if _starts(p, Rule.WS_256_TOKEN_TILES_FROM, 256):
        return 256
    return 64 if _starts(p, Rule.WS_64_TOKEN_TILES_FROM, 128) else 128


def _config_for(p: _Problem, path: Path) -> Optional[GemmConfig]:
    """The configuration of ``path`` for p.tokens, if built: the smallest pass that holds them (the largest past
    that, in several passes); wgmma's row tiles by the table."""
    M = p.tokens
    if path is Path.MMA_SYNC:
        return p.built.get((1 if M <= 8 else 2 if M <= 16 else 4, 0, 0, 1))
    if path is Path.K_SPLIT:
        return p.built.get((1 if M <= 8 else 2, 0, 0, 8)) if M <= 16 else None
    if path is Path.WARP_SPECIALIZED:
        tokens = _ws_tokens(p)
        return p.built.get((tokens // 8, 0, tokens, 1))
    mb = 8 if M <= 64 else 16
    tiles = (2, 1) if _starts(p, Rule.WIDE_TILES_FROM, mb * 8) else (1, 2)
    return next((p.built[(mb, t, 0, 1)] for t in tiles if (mb, t, 0, 1) in p.built), None)


def _table_config(p: _Problem, paths: frozenset) -> Optional[GemmConfig]:
    """The fused configuration the crossover table picks among ``paths`` (built; it may not run here)."""
    if p.gpus is Gpus.WGMMA:
        if Path.WARP_SPECIALIZED in paths and (
                paths == {Path.WARP_SPECIALIZED}
                or _starts(p, Rule.WARP_SPECIALIZED_FROM, _ws_measured_tokens(p.tokens))):
            return _config_for(p, Path.WARP_SPECIALIZED)
        if Path.WGMMA in paths and (
                Path.MMA_SYNC not in paths or _starts(p, Rule.WGMMA_FROM, 64)):  # steps as 64-token passes
            return _config_for(p, Path.WGMMA)
    if Path.K_SPLIT in paths and (Path.MMA_SYNC not in paths or _starts(p, Rule.K_SPLIT_FROM, 8)):
        split = _config_for(p, Path.K_SPLIT)
        if split is not None:
            return split
    return _config_for(p, Path.MMA_SYNC) if Path.MMA_SYNC in paths else None


def _fallback(p: _Problem) -> Optional[GemmConfig]:
    """The mma.sync configuration that runs here: the smallest pass that holds the tokens, else the largest."""
    runnable = sorted((c for c in p.built.values() if c.path is Path.MMA_SYNC and p.runs(c)), key=lambda c: c.tokens)
    return next((c for c in runnable if c.tokens >= p.tokens), runnable[-1] if runnable else None)


def _from_table(p: _Problem, cublas_allowed: bool) -> Optional[Plan]:
    wanted = _table_config(p, FUSED_PATHS)
    config = wanted if p.runs(wanted) else _fallback(p)
    if config is None:
        return DEQUANTIZE_CUBLAS if cublas_allowed else None
    if cublas_allowed:
        through = max(_holding(p, Rule.FUSED_THROUGH), default=0)
        if wanted is not None and config.tokens < wanted.tokens and through < math.inf:
            # A smaller pass than the one measured (the GPU's shared memory holds no larger one) reads the weights
            # once per pass: the crossover comes that much earlier.
            through = through * config.tokens // wanted.tokens
        if p.tokens > through:
            return DEQUANTIZE_CUBLAS
    return Plan.of(config)


def _from_tuned(p: _Problem, shape, cublas_allowed: bool) -> Optional[Plan]:
    """The fastest path that runs here of those ``kbit tune`` timed (a ``tune_cache.TunedShape``), at the first
    tuned token count >= p.tokens (the last one past them)."""
    tokens = shape.tokens
    i = next((i for i, t in enumerate(tokens) if t >= p.tokens), len(tokens) - 1)
    timed = sorted((us[i], path) for path, us in shape.us.items()
                   if us[i] is not None and (cublas_allowed or path is not Path.DEQUANTIZE_CUBLAS))
    for _, path in timed:
        if path is Path.DEQUANTIZE_CUBLAS:
            return DEQUANTIZE_CUBLAS
        config = _config_for(p, path)
        if p.runs(config):
            return Plan.of(config)
    return None


def plan(device: Device, configs: Iterable[GemmConfig], out_features: int, in_features: int, tokens: int, bits: int,
         *, fused_only: bool = False, force: Optional[frozenset] = None, tuned: Optional[Mapping] = None) -> Plan:
    """The path and configuration for ``tokens`` x in_features activations times an [out_features, in_features]
    weight of ``bits`` bits on ``device``.

    ``fused_only`` leaves dequantize + cuBLAS out (a forced grid, ``kbit::gemm`` called directly); raises
    NoFusedConfig when no fused configuration of ``bits`` runs on the device. ``force``: the fused paths allowed
    (``FORCED_PATHS``), ignored when none of them runs here. ``tuned``: ``kbit.tune_cache.load``'s measurements,
    keyed by (bits, out_features, in_features padded to 32).
    """
    p = _Problem.of(device, configs, out_features, in_features, tokens, bits)
    cublas_allowed = not fused_only
    if force:
        forced = _table_config(p, force)
        if p.runs(forced):
            return Plan.of(forced)
    shape = tuned.get((bits, out_features, p.in_features)) if tuned else None
    choice = (_from_tuned(p, shape, cublas_allowed) if shape else None) or _from_table(p, cublas_allowed)
    if choice is None:
        raise NoFusedConfig(
            f"kbit: no fused GEMM configuration at {bits} bits runs on this GPU ({device.name}, compute capability "
            f"{device.capability[0]}.{device.capability[1]}, {device.smem_per_block // 1024} KB of shared memory per "
            f"block): use dequantize + matmul")
    return choice


def fused_configs(device: Device, configs: Iterable[GemmConfig], out_features: int, in_features: int, tokens: int,
                  bits: int) -> dict:
    """{path: configuration} of each fused path that runs on ``device``, as ``plan`` would run it for these tokens:
    what ``kbit tune`` times."""
    p = _Problem.of(device, configs, out_features, in_features, tokens, bits)
    found = {path: _config_for(p, path) for path in (Path.MMA_SYNC, Path.K_SPLIT, Path.WGMMA, Path.WARP_SPECIALIZED)}
    return {path: config for path, config in found.items() if p.runs(config)}


# ---------------------------------------------------------------------------------------------- on this machine
class DeviceFacts(NamedTuple):
    device: Device
    configs: tuple  # GemmConfig
    tuned: Optional[Mapping]


_FACTS: dict = {}  # CUDA device index -> DeviceFacts
_PLANS: dict = {}  # (device index, out, in, tokens, bits, fused_only, forced) -> Plan
_MAX_PLANS = 1 << 14


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def device_facts(device: torch.device) -> DeviceFacts:
    """What the planner knows of this CUDA device, read once per process (``QuantizedWeight.prepare`` reads it
    before ``torch.compile`` traces ``kbit.matmul``)."""
    index = device_index(device)
    facts = _FACTS.get(index)
    return facts if facts is not None else _read_facts(index)


@torch.compiler.disable
def _read_facts(index: int) -> DeviceFacts:
    from . import tune_cache

    ext = cuda_ext()
    props = torch.cuda.get_device_properties(index)
    device = Device(props.name, (props.major, props.minor), props.multi_processor_count,
                    int(ext.shared_memory_per_block_optin(index)))
    facts = DeviceFacts(device, parse_configs(ext.gemm_configs()), tune_cache.load(device))
    _FACTS[index] = facts
    return facts


def forget() -> None:
    """Read the devices' facts and the tuned crossovers again at the next plan (after ``kbit tune`` wrote them)."""
    _FACTS.clear()
    _PLANS.clear()


def forced_paths() -> Optional[frozenset]:
    """The fused paths ``KBIT_GEMM_PATH`` allows, or None (unset, or a value it does not name)."""
    return FORCED_PATHS.get(os.environ.get(PATH_ENV, ""))


def gemm_plan(device: torch.device, out_features: int, in_features: int, tokens: int, bits: int,
              fused_only: bool = False) -> Plan:
    """``plan`` on a CUDA device, with its facts and tuned crossovers. ``KBIT_GEMM_PATH`` applies to fused_only
    plans: it chooses among the fused kernels, never whether the fused path is taken."""
    facts = device_facts(device)
    force = forced_paths() if fused_only else None
    if torch.compiler.is_compiling():  # traced: no memo (its contents would become guards)
        return plan(facts.device, facts.configs, out_features, in_features, tokens, bits, fused_only=fused_only,
                    force=force, tuned=facts.tuned)
    key = (device_index(device), out_features, in_features, tokens, bits, fused_only, force)
    chosen = _PLANS.get(key)
    if chosen is None:
        chosen = plan(facts.device, facts.configs, out_features, in_features, tokens, bits, fused_only=fused_only,
                      force=force, tuned=facts.tuned)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = chosen
    return chosen
