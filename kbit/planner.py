"""The GEMM launch planner: how ``x @ W_hat.T`` runs on a CUDA device. The one place where that is decided.

``plan(device, configs, coefficients, out_features, in_features, tokens, bits)`` returns a ``Plan``: the path
(``mma_sync``, ``k_split``, ``wgmma``, ``warp_specialized`` or ``dequantize_cublas``) and, for the fused ones, the
built configuration and its launch (grid, and how the steps are cut among the CTAs: in one group, in whole tiles, or
each tile in parts; cut.h; on gemm.cuh's kernels the parts of a tile are one thread-block cluster). The binding runs
exactly that and refuses what is not built or does not fit.
``rows_per_pass`` plans the MoE grouped GEMM's token rows per pass from the same model.

It picks the candidate of least predicted time among the configurations the fit holds for at these tokens
(``_fitted_for``), each on its launches (``launches``: the warp-specialized kernel's cut by its measured rules; and
``cluster_launches`` where the coefficients price a cluster's hand-off). The cost model, per path (``PathCost``),
for a launch whose busiest CTA runs ``E`` steps (a step: one CTA tile's k-group of 256 columns, or 8 of them where
the warps split k):

    time = fixed + max(E x bytes per step / load rate, E x (weights per step / lookup rate + MACs per step / MMA
           rate)) + tiles started x tile cost + the partial sums a split tile hands over / hand-off rate
           + the partial tiles a cluster's lead CTA sums from the others' shared memory x cluster cost
           + the call's distinct bytes / bandwidth

``E`` counts the waves over the SMs: the busiest CTA's steps, less ``whole_tiles_gain`` of them where the CTAs own
whole tiles and so sweep k in step. A tile cut in parts hands over what gemm_ws.cuh moves (``handed_partials``): the
lead reads the other parts' sums, or, split 5 ways or more, each part two tiles' worth in slices; the stream-K cut is
counted one partial tile, whatever its ranges (so the time never falls as the steps grow). Dequantize + cuBLAS: a
fixed cost, the bytes of its one dequantize pass over bandwidth (the codes read, the 16-bit weight written; a weight
that holds only its GEMM layout, as kbit's layers do, dequantizes straight from it), and the larger of cuBLAS's loads
and its multiply-adds (tokens in tiles of 128) per SM. Times measured with an unrepack before the dequantize (tune
files timed so: ``unrepacked_first``) are fitted with that pass's bytes too (``cublas_features``).

The coefficients are per GPU (``Coefficients``): ``python -m kbit tune`` fits them on this GPU into the tuned cache
(``kbit.tune_cache``); else the shipped defaults of ``kbit/gpus/<GPU>.json`` (fitted the same way from
``benchmarks/results/tune_<GPU>.json``; the decode step's, where it has its own, from
``tune_in_step_<GPU>.json``), else those of ``DEFAULT_GPU``. ``KBIT_GEMM_PATH`` (``ws``, ``classic``,
``mma_sync``, ``wgmma``, ``k_split``) restricts the fused kernels of a fused-only plan, read at every call.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path as FilePath
from typing import Iterable, NamedTuple, Optional

import torch

from . import tune_cache
from ._build import cuda_ext
from .formats import padded_in_features
from .gemm_facts import FUSED_PATHS, Device, GemmConfig, Path, parse_configs

PATH_ENV = "KBIT_GEMM_PATH"
# KBIT_GEMM_PATH values: the fused paths allowed ("classic" = gemm.cuh's kernel).
FORCED_PATHS = {
    "ws": frozenset({Path.WARP_SPECIALIZED, Path.WS_128_ROWS}),
    "classic": frozenset({Path.MMA_SYNC, Path.K_SPLIT, Path.WGMMA}),
    "mma_sync": frozenset({Path.MMA_SYNC}),
    "k_split": frozenset({Path.K_SPLIT}),
    "wgmma": frozenset({Path.WGMMA}),
}
K_GROUP = 256  # columns per k-group of the GEMM layout (kbit.h kKGroup)
MAX_TILE_PARTS_GRID = 256  # cut.h kMaxGroupedGrid: CTAs of a launch that cuts tiles in parts
WS_128_ROWS_K_STEPS = 8  # the most k-steps per tile the warp-specialized kernel's 128-row tiles are planned for
WS_SLICED_FROM = 5  # gemm_ws.cuh kSlicedFrom: a tile split this many ways or more is summed in slices by all its CTAs
MAX_CLUSTER_CTAS = 8  # gemm.cuh kMaxClusterCtas: the most parts of one tile summed in a thread-block cluster
CUBLAS_TILE = 128  # tokens per cuBLAS output tile, as the model counts its multiply-adds
GPU_DIR = FilePath(__file__).parent / "gpus"
DEFAULT_GPU = "NVIDIA H100 80GB HBM3"  # the defaults of a GPU with no file of its own
MIB = float(1 << 20)
DECODE_TOKENS = 16  # the most tokens a call plans from a decode step's coefficients (``Coefficients.decode``)


class Launch(NamedTuple):
    """The grid and the cut of the steps among its CTAs (cut.h): in one group, in whole tiles, or each tile in
    ``tile_parts`` parts on tiles x parts CTAs."""

    grid: int
    tile_parts: int = 0
    whole_tiles: bool = False


class Plan(NamedTuple):
    """What runs: a path and, for the fused ones, the configuration and launch the binding receives."""

    path: Path
    mb: int = 0
    wgmma_tiles: int = 0
    ws_tokens: int = 0
    k_split: int = 1
    grid: int = 0
    tile_parts: int = 0
    whole_tiles: bool = False

    @classmethod
    def of(cls, config: GemmConfig, launch: Launch) -> "Plan":
        return cls(config.path, config.mb, config.wgmma_tiles, config.ws_tokens, config.k_split, *launch)

    @property
    def key(self) -> tuple:
        return self.mb, self.wgmma_tiles, self.ws_tokens, self.k_split


DEQUANTIZE_CUBLAS = Plan(Path.DEQUANTIZE_CUBLAS)


class NoFusedConfig(RuntimeError):
    """No fused GEMM configuration of this bit width runs on this GPU."""


# ---------------------------------------------------------------------------------------------- the cost model
class PathCost(NamedTuple):
    """One path's coefficients, microseconds per unit (``FEATURES`` says what each multiplies)."""

    fixed_us: float
    load_us: float  # per MiB the busiest CTA loads
    lookup_us: float  # per Mi weights the busiest CTA dequantizes
    mma_us: float  # per Gi multiply-adds of the busiest CTA
    tile_us: float  # per tile the busiest CTA starts (its pipeline filled from memory, its output written)
    handoff_us: float  # per MiB of a partial tile handed to another CTA where tiles are split (split-K)
    memory_us: float  # per MiB the call moves to or from memory (weights once, x, y)
    # per partial tile the lead CTA of a thread-block cluster sums from the others' shared memory (gemm.cuh's tile
    # parts), its barriers included; None: never fitted (no clustered launch was timed), so none is planned
    cluster_us: Optional[float] = None
    # per launch of gemm.cuh's mma.sync kernels with a CTA on every SM where fewer CTAs would have the same busiest
    # steps (``slack_launch``); None: never fitted (no such pair timed), so the two price alike and the full grid,
    # weighed first, is planned
    full_grid_us: Optional[float] = None


FEATURES = PathCost._fields
MEMORY = FEATURES.index("memory_us")
# absent from coefficient files fitted before clustered launches, or launches leaving SMs free, were timed
OPTIONAL_FEATURES = ("cluster_us", "full_grid_us")


class CutCost(NamedTuple):
    """How owning whole tiles changes the busiest CTA's steps."""

    whole_tiles_gain: dict  # tokens per tile -> the share of steps saved where CTAs own whole tiles (k in step)


# From where the grid rules measured on the H100 and H200 turned (docs/PERFORMANCE.md, "Measured choices"): whole
# 256-token tiles won with the busiest CTA up to 6% past the mean.
DEFAULT_CUT = CutCost({256: 0.06})


class Coefficients(NamedTuple):
    device: str
    paths: dict  # Path -> PathCost
    tokens: dict  # (bits,) + GemmConfig.key -> (fewest, most) tokens it was measured at: where the fit holds for it
    cut: CutCost
    source: str  # what they were fitted from
    # The decode step's own (paths and tokens alike), fitted to calls timed in step at up to DECODE_TOKENS tokens
    # (``kbit tune --fit ... --decode``): there each call follows a few small kernels (a norm, the rotary embedding,
    # attention) instead of another GEMM's tail, and the launch that wins is another (the slack launch, the k split:
    # docs/PERFORMANCE.md, Planner). None: ``paths`` plan every call.
    decode: Optional["Coefficients"] = None

    def at(self, tokens: int) -> "Coefficients":
        """The coefficients that plan a call of ``tokens`` tokens."""
        return self.decode if self.decode is not None and tokens <= DECODE_TOKENS else self


class Shape(NamedTuple):
    out_features: int
    in_features: int  # padded to 32
    tokens: int
    bits: int

    @property
    def weight_bytes(self) -> float:
        return self.out_features * self.in_features * (self.bits / 8 + 1 / 32)  # codes and E4M4 block scales

    @property
    def memory_mib(self) -> float:
        """Bytes the fused call moves to or from memory: the weight once, x, y (16-bit)."""
        return (self.weight_bytes + 2 * self.tokens * (self.in_features + self.out_features)) / MIB


class Steps(NamedTuple):
    """A configuration's work on a shape: its tiles (token passes x row tiles) of k_steps steps."""

    passes: int
    row_tiles: int
    k_steps: int

    @property
    def tiles(self) -> int:
        return self.passes * self.row_tiles

    @property
    def total(self) -> int:
        return self.tiles * self.k_steps


def steps_of(config: GemmConfig, shape: Shape) -> Steps:
    k_groups = -(-shape.in_features // K_GROUP)
    return Steps(-(-shape.tokens // config.tokens), -(-shape.out_features // config.tile_rows),
                 -(-k_groups // config.k_split))


def launches(config: GemmConfig, steps: Steps, sms: int) -> list:
    """The launches the binding accepts that are worth comparing: the steps in one group on one CTA per SM, then on
    the fewest CTAs as busy (``slack_launch``), or a CTA per tile where the warps split k; for the warp-specialized
    kernel, the one its measured cut rules give (``ws_launch``), or for its 128-row tiles those the model ranks
    (``ws_128_rows_launches``)."""
    if config.path is Path.WS_128_ROWS:
        return ws_128_rows_launches(steps, sms)
    if config.ws_tokens:
        return [ws_launch(config, steps, sms)]
    found = [Launch(min(sms, steps.total))]
    if config.k_split > 1 and steps.tiles <= sms:
        found.append(Launch(steps.tiles))
    slack = slack_launch(config, steps, sms)
    return found + ([slack] if slack is not None else [])


def slack_launch(config: GemmConfig, steps: Steps, sms: int) -> Optional[Launch]:
    """mma.sync's steps (k not split: that weighs a CTA per tile) in one group on the fewest CTAs whose busiest CTA
    has as many steps as on one CTA per SM, where that leaves SMs free; else None. Measured beside the full grid
    (H200, k = 4, in a decoder step, ``bench_cluster_split.py --in-step``): 4096->28672 and 14336->4096 at one token
    on 128 CTAs 22.2 and 15.3 us against 23.7 and 17.0 on 132, as busy; back to back 20.2 / 13.7 against 20.9 / 14.4;
    at 16 tokens mixed. Priced by ``PathCost.full_grid_us`` once a tune has timed both."""
    if config.ws_tokens or config.wgmma_tiles or config.k_split > 1 or steps.total <= sms:
        return None
    grid = -(-steps.total // -(-steps.total // sms))
    return Launch(grid) if grid < sms else None


# The warp-specialized kernel's cut, by the rules measured on the H100 and H200 (docs/PERFORMANCE.md, "Measured
# choices"): the cost model does not rank these cuts as they measure (on the H200 A/B, the faster of two launches of
# one configuration in 17 of 49 cells, even fitted to those times), so the launch is the rules' and the model prices it.
def ws_launch(config: GemmConfig, steps: Steps, sms: int) -> Launch:
    """Each tile in parts where the tiles are at most half the SMs (``_ws_tile_parts``); else whole tiles per CTA where
    a grid of 95% of the SMs or more divides them (at least 2 each below 256-token tiles), or for 256-token tiles
    unevenly where the busiest CTA's excess is small (``_ws_uneven_whole_tiles``); else the steps in one group."""
    parts = _ws_tile_parts(steps.tiles, steps.k_steps, sms)
    if parts:
        return Launch(steps.tiles * parts, parts)
    grid = next((g for g in range(sms, 0, -1) if 20 * g >= 19 * sms and steps.tiles % g == 0
                 and steps.tiles // g >= (1 if config.ws_tokens == 256 else 2)), 0)
    if not grid and config.ws_tokens == 256:
        grid = _ws_uneven_whole_tiles(steps, sms)
    return Launch(grid, 0, True) if grid else Launch(min(sms, steps.total))


def ws_128_rows_launches(steps: Steps, sms: int) -> list:
    """The warp-specialized kernel's 128-row tiles, up to WS_128_ROWS_K_STEPS k-steps a tile (none past: there the
    default tiles were faster in 236 of 343 H200 cells at 17-512 tokens, up to 1.36x, and with both paths planned the
    fitted model put 608 of 693 cells within 3% of the fastest path against 651 with the limit, at the same planned
    time: a long k loop pays for the split that halves avoid, and two consumer warpgroups hide less of a step): the
    steps in one group; each tile in as many parts as the SMs hold (at most one per k-step); a tile per CTA where the
    tiles fit the SMs. Each was the fastest somewhere in the A/B that added these tiles (docs/PERFORMANCE.md, "Measured
    choices"), so the fitted model ranks them, as it does mma.sync's launches."""
    if steps.k_steps > WS_128_ROWS_K_STEPS:
        return []
    found = [Launch(min(sms, steps.total))]
    parts = min(sms // steps.tiles, steps.k_steps)
    if parts >= 2 and steps.tiles * parts <= MAX_TILE_PARTS_GRID:
        found.append(Launch(steps.tiles * parts, parts))
    if steps.k_steps > 1 and steps.tiles <= sms:
        found.append(Launch(steps.tiles, 0, True))
    return found


def cluster_launches(config: GemmConfig, steps: Steps, device: Device) -> list:
    """Each tile's k-steps in C = 2..8 parts on tiles x C CTAs, a tile's parts one thread-block cluster that sums them
    in shared memory (gemm.cuh), for the configurations that may (``GemmConfig.tile_parts_in_clusters``): at most a
    part per k-step, one CTA per SM, and every cluster running at once (``Device.clusters_at_once``: a second wave of
    clusters doubles the time)."""
    if not config.tile_parts_in_clusters:
        return []
    return [Launch(steps.tiles * c, c) for c in range(2, MAX_CLUSTER_CTAS + 1)
            if c <= steps.k_steps and steps.tiles * c <= device.sms and steps.tiles <= device.clusters_at_once(c)]


def _ws_tile_parts(tiles: int, k_steps: int, sms: int) -> int:
    """Parts of whole k-steps per tile on tiles x parts CTAs where that keeps 95% of the SMs; else halves where the
    k-steps are few (a CTA at most 2.5 steps more than the one-group cut); else 0."""
    if sms > MAX_TILE_PARTS_GRID:
        return 0
    parts = min(sms // tiles, k_steps)
    if parts >= 2 and 20 * tiles * parts >= 19 * sms:
        return parts
    return 2 if k_steps >= 2 and 2 * tiles <= sms and k_steps * (sms - 2 * tiles) <= 5 * sms else 0


def _ws_uneven_whole_tiles(steps: Steps, sms: int) -> int:
    """256-token tiles no grid divides: whole tiles on ceil(tiles / most) CTAs, where the busiest CTA's tiles past the
    mean are few, or the SMs span two token passes or more and the most is within 1.3x the mean (1.2x below 32
    k-steps); else 0."""
    tiles = steps.tiles
    most = -(-tiles // sms)
    excess = most * sms - tiles
    few_past = 50 * excess <= 3 * tiles or (4 * excess <= tiles and excess * steps.k_steps <= 5 * sms)
    spans_passes = 2 * steps.row_tiles <= sms
    bound_tenths = 13 if steps.k_steps >= 32 else 12
    return -(-tiles // most) if few_past or (spans_passes and 10 * most * sms <= bound_tenths * tiles) else 0


def best_launch(config: GemmConfig, shape: Shape, cut: CutCost, sms: int, cost: Optional[PathCost] = None) -> Launch:
    """The launch of ``config`` of least predicted time with ``cost``; without, of the fewest busiest steps (then
    tiles, then unsplit)."""
    steps = steps_of(config, shape)

    def rank(launch: Launch):
        if cost is not None:
            return predict(cost, fused_features(config, shape, launch, cut, steps, sms))
        return busiest(config, steps, launch, cut)

    return _least((rank(launch), launch) for launch in launches(config, steps, sms))


def _least(pairs: Iterable[tuple]):
    """The item of the (key, item) pair of least key, the first of equals. A loop: torch.compile traces the
    planner (``kbit.matmul`` plans while traced), and not min(..., key=...)."""
    best = None
    for pair in pairs:
        if best is None or pair[0] < best[0]:
            best = pair
    return best[1]


def busiest(config: GemmConfig, steps: Steps, launch: Launch, cut: CutCost) -> tuple:
    """(E, tiles, sharers): the busiest CTA's steps, whole tiles' gain taken off; the tiles it works on; how many
    CTAs' partial sums meet in one of its tiles at most (1: none split)."""
    if launch.whole_tiles:
        most = -(-steps.tiles // launch.grid)
        return most * steps.k_steps * (1 - cut.whole_tiles_gain.get(config.ws_tokens, 0.0)), most, 1
    if launch.tile_parts:
        return -(-steps.k_steps // launch.tile_parts), 1, launch.tile_parts
    per_cta = -(-steps.total // launch.grid)
    tiles = -(-per_cta // steps.k_steps)
    if (config.k_split > 1 and launch.grid == steps.tiles) or steps.k_steps == 1:
        return per_cta, tiles, 1  # the k split's CTA per tile, or one-step tiles: none split
    # Counted as split in two wherever the stream-K cut may split a tile, so the time never falls as the steps grow.
    return per_cta, tiles + 1, 2


def handed_partials(config: GemmConfig, sharers: int) -> int:
    """Partial tiles a tile split among ``sharers`` CTAs moves through one SM: in gemm_ws.cuh the lead reads the
    others' (n - 1) below ``WS_SLICED_FROM`` ways, from there each CTA two tiles' worth (ws_reduce_slice); gemm.cuh's
    kernels are counted one (through L2; in a cluster, ``in_cluster``, the cluster's own term counts them)."""
    if sharers <= 1:
        return 0
    if not config.ws_tokens:
        return 1
    return sharers - 1 if sharers < WS_SLICED_FROM else 2


def in_cluster(config: GemmConfig, launch: Launch) -> bool:
    """Whether the launch sums each tile's parts in a thread-block cluster: tile parts on gemm.cuh's kernels."""
    return bool(launch.tile_parts) and not config.ws_tokens


def fused_features(config: GemmConfig, shape: Shape, launch: Launch, cut: CutCost,
                   steps: Optional[Steps] = None, sms: int = 0) -> tuple:
    """The cost model's features (``FEATURES``) of a fused launch (``steps``: the shape's, unless given) on a GPU of
    ``sms`` SMs (0: not known, no full-grid term)."""
    steps = steps or steps_of(config, shape)
    e, tiles, sharers = busiest(config, steps, launch, cut)
    step_weights = config.tile_rows * K_GROUP * config.k_split
    step_bytes = step_weights * (shape.bits / 8 + 1 / 32) + config.tokens * K_GROUP * config.k_split * 2
    # A partial tile in fp32; the warp-specialized kernel moves only its real tokens' sums. In a cluster the lead
    # sums the other parts' tiles (counted: a barrier and a round trip each, whatever their bytes).
    tokens = min(shape.tokens, config.tokens) if config.ws_tokens else config.tokens
    clustered = in_cluster(config, launch)
    partials = 0 if clustered else handed_partials(config, sharers) * config.tile_rows * tokens * 4
    # (a conditional, not float() of the comparison: torch.compile traces this with the token count symbolic)
    full_grid = 1.0 if sms and launch.grid >= sms and slack_launch(config, steps, sms) is not None else 0.0
    return (1.0, e * step_bytes / MIB, e * step_weights / MIB, e * step_weights * config.tokens / 2**30, tiles,
            partials / MIB, shape.memory_mib, float(sharers - 1) if clustered else 0.0, full_grid)


def cublas_features(shape: Shape, sms: int, unrepacked_first: bool = False) -> tuple:
    """Dequantize + cuBLAS: the bytes of its dequantize pass over bandwidth (the codes read, the 16-bit weight
    written), and cuBLAS's loads (the 16-bit weight, x, y) and multiply-adds per SM, tokens in tiles of 128.
    ``unrepacked_first``: an unrepack ran before that pass (the layout read, the storage format written: as many
    bytes each), as tune files timed that path before a weight dequantized straight from its layout; only a fit to
    such times counts it."""
    weights = shape.out_features * shape.in_features
    unrepack_bytes = 2 * shape.weight_bytes if unrepacked_first else 0.0
    dequantize_mib = (unrepack_bytes + shape.weight_bytes + 2 * weights) / MIB
    gemm_mib = (2 * weights + 2 * shape.tokens * (shape.in_features + shape.out_features)) / MIB
    macs = -(-shape.tokens // CUBLAS_TILE) * CUBLAS_TILE * weights / 2**30  # its tiles hold 128 tokens
    return 1.0, gemm_mib / sms, 0.0, macs / sms, 0.0, 0.0, dequantize_mib, 0.0, 0.0


def terms(cost: PathCost, features: tuple) -> tuple:
    """(loading, computing, the rest) of the predicted time: loads overlap the lookups and the MMAs. A feature of 0
    costs nothing, and so does one whose coefficient was never fitted (None)."""
    t = [c * f if f and c is not None else 0.0 for c, f in zip(cost, features)]
    return t[1], t[2] + t[3], t[0] + sum(t[4:])


def predict(cost: PathCost, features: tuple) -> float:
    loading, computing, rest = terms(cost, features)
    return rest + max(loading, computing)


# ---------------------------------------------------------------------------------------------- the decision
def _mma(config: GemmConfig) -> str:
    """The kernel's kind of MMA: the k split is mma.sync's kernel with the warps splitting k."""
    return config.path.value if config.ws_tokens else "wgmma" if config.wgmma_tiles else "mma.sync"


def _fitted_for(config: GemmConfig, tokens: int, coefficients: Coefficients, runnable: list) -> bool:
    """Whether the fit holds for ``config`` at ``tokens``: within the token counts it was measured at (from just past
    the next smaller pass of its kind of MMA where that one was measured through its pass), or past them where it is
    the largest pass of its kind; never measured, where one pass holds them or it is that largest."""
    kind = [c for c in runnable if _mma(c) == _mma(config)]
    smaller = [c for c in kind if c.tokens < config.tokens]
    largest = not any(c.tokens > config.tokens for c in kind)
    measured = coefficients.tokens.get((config.bits,) + config.key)
    if measured is None:
        return tokens <= config.tokens or largest
    fewest, most = measured
    if smaller and fewest <= config.tokens:
        below = _least((-c.tokens, c) for c in smaller)
        reach = coefficients.tokens.get((below.bits,) + below.key, (0, 0))[1]
        if reach >= below.tokens:  # the smaller pass was measured through its size: no gap between the two
            fewest = min(fewest, below.tokens + 1)
    return fewest <= tokens <= most or (tokens > most and largest)


def _fused_candidates(device: Device, configs: Iterable[GemmConfig], coefficients: Coefficients, shape: Shape,
                      paths, forced: bool = False) -> list:
    """(predicted us, Plan) of every launch of every configuration of ``paths`` that runs here, of the paths with
    coefficients of their own (a GPU whose fit never timed the 128-row tiles runs its default ones, also for
    KBIT_GEMM_PATH=ws), of those the fit holds for (``_fitted_for``) where there are any; ``forced``, where none of
    ``paths`` has coefficients: priced as mma.sync (gemm.cuh's kernel too)."""
    priced = frozenset(path for path in paths if path in coefficients.paths)
    if priced:
        paths = priced
    elif not forced:
        return []
    runnable = [c for c in configs if c.bits == shape.bits and c.runs_on(device)]
    fitted = [c for c in runnable if c.path in paths and _fitted_for(c, shape.tokens, coefficients, runnable)]
    found = []
    for config in fitted or [c for c in runnable if c.path in paths]:
        cost = coefficients.paths.get(config.path) or coefficients.paths.get(Path.MMA_SYNC)  # (forced: none priced)
        if cost is None:
            continue
        steps = steps_of(config, shape)
        clustered = cluster_launches(config, steps, device) if cost.cluster_us is not None else []
        for launch in launches(config, steps, device.sms) + clustered:
            us = predict(cost, fused_features(config, shape, launch, coefficients.cut, steps, device.sms))
            found.append((us, Plan.of(config, launch)))
    return found


def plan(device: Device, configs: Iterable[GemmConfig], coefficients: Coefficients, out_features: int,
         in_features: int, tokens: int, bits: int, *, fused_only: bool = False, force: Optional[frozenset] = None,
         grid_override: int = 0) -> Plan:
    """The path, configuration and launch for ``tokens`` x in_features activations times an
    [out_features, in_features] weight of ``bits`` bits on ``device``: the least predicted time.

    ``fused_only`` leaves dequantize + cuBLAS out (``kbit::gemm``); raises NoFusedConfig when no fused configuration
    of ``bits`` runs on the device. ``force``: the fused paths allowed (``FORCED_PATHS``), ignored when none of them
    runs here. ``grid_override`` > 0: that many CTAs (at most one per SM and one per step), the steps in one group;
    fused only (tests force split-K with it). Dequantize + cuBLAS is priced as one dequantize pass, whether the
    weight holds its storage format or only its GEMM layout (``ops.dequantize_layout``).
    """
    shape = Shape(out_features, padded_in_features(in_features), max(tokens, 1), bits)
    coefficients = coefficients.at(shape.tokens)
    fused_only = fused_only or grid_override > 0
    configs = tuple(configs)
    candidates = []
    if force:
        candidates = _fused_candidates(device, configs, coefficients, shape, force, forced=True)
    if not candidates:
        candidates = _fused_candidates(device, configs, coefficients, shape, FUSED_PATHS)
    if not fused_only and Path.DEQUANTIZE_CUBLAS in coefficients.paths:
        us = predict(coefficients.paths[Path.DEQUANTIZE_CUBLAS], cublas_features(shape, device.sms))
        candidates.append((us, DEQUANTIZE_CUBLAS))
    if not candidates:
        if not fused_only:
            return DEQUANTIZE_CUBLAS
        raise NoFusedConfig(
            f"kbit: no fused GEMM configuration at {bits} bits runs on this GPU ({device.name}, compute capability "
            f"{device.capability[0]}.{device.capability[1]}, {device.smem_per_block // 1024} KB of shared memory per "
            f"block): use dequantize + matmul")
    chosen = _least(candidates)
    if grid_override > 0:
        config = next(c for c in configs if c.bits == bits and c.key == chosen.key)
        total = steps_of(config, shape).total
        chosen = chosen._replace(grid=min(grid_override, device.sms, total), tile_parts=0, whole_tiles=False)
    return chosen


def rows_per_pass(device: Device, configs: Iterable[GemmConfig], coefficients: Coefficients, slots: int,
                  num_experts: int, shapes: Iterable[tuple], bits: int, supported: Iterable[int]) -> int:
    """Token rows per pass of the MoE grouped GEMM (one of ``supported``) for ``slots`` (token, expert) pairs over
    ``num_experts``, its projections' ``shapes`` (out_features, in_features) run with the same rows: the least
    predicted time for the expected rows per routed expert, each expert's weight read once per pass. Its kernel is
    gemm.cuh's (mma.sync, or wgmma at 128 rows) on one CTA per SM, the steps cut in one group. No slots (an empty
    batch) launches nothing: planned as one, so the model never prices an empty launch."""
    slots = max(slots, 1)
    active = min(num_experts, slots)
    per_expert = -(-slots // active)
    configs = tuple(configs)
    best = None
    for rows in sorted(supported):  # a loop, not min(generator): torch.compile traces this (see _least)
        config = next((c for c in configs if c.bits == bits and c.tokens == rows and c.k_split == 1
                       and not c.ws_tokens and c.runs_on(device)), None)
        cost = coefficients.paths.get(config.path) if config is not None else None
        if cost is None:
            continue
        us = 0.0
        for out_features, in_features in shapes:
            expert = Shape(out_features, padded_in_features(in_features), rows, bits)
            one = steps_of(config, expert)
            steps = Steps(active * -(-per_expert // rows), one.row_tiles, one.k_steps)
            launch = Launch(min(device.sms, steps.total))
            features = fused_features(config, expert, launch, coefficients.cut, steps, device.sms)
            memory = (active * expert.weight_bytes + 2 * slots * (expert.in_features + expert.out_features)) / MIB
            us += predict(cost, features[:MEMORY] + (memory,) + features[MEMORY + 1:])
        if best is None or us < best[0]:
            best = (us, rows)
    return best[1] if best is not None else max(supported)


# ---------------------------------------------------------------------------------------------- coefficients
def coefficients_from_json(data: dict, source: str) -> Coefficients:
    """The coefficient file's contents (``kbit/gpus/*.json``, the tuned cache's ``coefficients``), checked; its
    ``decode`` (paths, tokens and source, the device and cut being the file's) becomes ``Coefficients.decode``."""
    decode = data.get("decode") if isinstance(data, dict) else None
    if decode is not None:
        if not isinstance(decode, dict) or "decode" in decode:
            raise ValueError(f"{source}: decode: paths, tokens and source of the decode step's coefficients")
        decode = coefficients_from_json({**decode, "device": data.get("device"), "cut": data.get("cut")},
                                        f"{source} (decode)")
    try:
        paths = {Path(name): PathCost(**{f: float(v[f]) for f in FEATURES if f in v or f not in OPTIONAL_FEATURES})
                 for name, v in data["paths"].items()}
        tokens = {tuple(int(i) for i in key.split(",")): (int(low), int(high))
                  for key, (low, high) in data["tokens"].items()}
        if any(len(key) != 5 or not 1 <= low <= high for key, (low, high) in tokens.items()):
            raise ValueError("tokens: bits,mb,wgmma_tiles,ws_tokens,k_split -> [fewest, most], 1 <= fewest <= most")
        cut = data["cut"]
        cut_cost = CutCost({int(t): float(g) for t, g in cut["whole_tiles_gain"].items()})
        device = str(data["device"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{source}: not a coefficient set ({type(e).__name__}: {e})") from None
    bad = [f"{path.value}.{f}" for path, cost in paths.items() for f, v in zip(FEATURES, cost)
           if v is not None and (not math.isfinite(v) or v < 0)]
    if bad:
        raise ValueError(f"{source}: coefficients must be finite and >= 0: {', '.join(bad)}")
    return Coefficients(device, paths, tokens, cut_cost, str(data.get("source", source)), decode)


def coefficients_to_json(coefficients: Coefficients) -> dict:
    def fitted(c: Coefficients) -> dict:
        return {"source": c.source,
                "paths": {path.value: {f: v for f, v in zip(FEATURES, cost) if v is not None}
                          for path, cost in c.paths.items()},
                "tokens": {",".join(map(str, key)): list(r) for key, r in sorted(c.tokens.items())}}

    return {"device": coefficients.device, **fitted(coefficients),
            "cut": {"whole_tiles_gain": {str(t): g for t, g in coefficients.cut.whole_tiles_gain.items()}},
            **({"decode": fitted(coefficients.decode)} if coefficients.decode is not None else {})}


def gpu_file(device_name: str) -> FilePath:
    return GPU_DIR / f"{tune_cache.file_tag(device_name)}.json"


def shipped_coefficients(device_name: str) -> Coefficients:
    """The shipped defaults for this GPU, else those of ``DEFAULT_GPU``."""
    path = gpu_file(device_name)
    if not path.exists():
        path = gpu_file(DEFAULT_GPU)
    return coefficients_from_json(json.loads(path.read_text()), str(path))


# ---------------------------------------------------------------------------------------------- on this machine
class DeviceFacts(NamedTuple):
    device: Device
    configs: tuple  # GemmConfig
    coefficients: Coefficients

    def plan(self, out_features: int, in_features: int, tokens: int, bits: int, fused_only: bool,
             grid_override: int) -> Plan:
        """``plan`` on this device, ``KBIT_GEMM_PATH`` read now (it applies to fused-only plans)."""
        return plan(self.device, self.configs, self.coefficients, out_features, in_features, tokens, bits,
                    fused_only=fused_only, force=forced_paths() if fused_only or grid_override else None,
                    grid_override=grid_override)

    def rows_per_pass(self, slots: int, num_experts: int, shapes: Iterable[tuple], bits: int,
                      supported: Iterable[int]) -> int:
        return rows_per_pass(self.device, self.configs, self.coefficients, slots, num_experts, shapes, bits,
                             supported)


_FACTS: dict = {}  # CUDA device index -> DeviceFacts
_PLANS: dict = {}  # (device index, out, in, tokens, bits, fused_only, grid_override, forced) -> Plan
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
    ext = cuda_ext()
    props = torch.cuda.get_device_properties(index)
    clusters = tuple(int(ext.gemm_clusters_at_once(index, c)) for c in range(1, MAX_CLUSTER_CTAS + 1)) \
        if props.major >= 9 else ()
    device = Device(props.name, (props.major, props.minor), props.multi_processor_count,
                    int(ext.shared_memory_per_block_optin(index)), clusters)
    facts = DeviceFacts(device, parse_configs(ext.gemm_configs()), _coefficients(device.name))
    _FACTS[index] = facts
    return facts


def _coefficients(device_name: str) -> Coefficients:
    """The tuned cache's coefficients for this GPU, else the shipped ones."""
    tuned = tune_cache.load(device_name)
    if tuned is not None:
        where = tune_cache.cache_file(device_name)
        try:
            return coefficients_from_json(tuned, str(where))
        except ValueError as e:
            warnings.warn(f"kbit: ignoring the tuned cache {where}: {e}; run `python -m kbit tune` again",
                          stacklevel=3)
    return shipped_coefficients(device_name)


def forget() -> None:
    """Read the devices' facts and coefficients again at the next plan (after ``kbit tune`` wrote them)."""
    _FACTS.clear()
    _PLANS.clear()


def forced_paths() -> Optional[frozenset]:
    """The fused paths ``KBIT_GEMM_PATH`` allows, or None (unset, or a value it does not name)."""
    return FORCED_PATHS.get(os.environ.get(PATH_ENV, ""))


def gemm_plan(device: torch.device, out_features: int, in_features: int, tokens: int, bits: int,
              fused_only: bool = False, grid_override: int = 0) -> Plan:
    """``plan`` on a CUDA device, with its facts and coefficients. ``KBIT_GEMM_PATH`` applies to fused-only plans:
    it chooses among the fused kernels, never whether the fused path is taken."""
    request = (out_features, in_features, tokens, bits, fused_only, grid_override)
    if torch.compiler.is_compiling() and not isinstance(tokens, int):  # a symbolic token count: the model traced
        return device_facts(device).plan(*request)  # (no memo: its contents would become guards)
    return _planned(device_index(device), *request)


def dequantizes_first(device: torch.device, out_features: int, in_features: int, tokens: int, bits: int) -> bool:
    """Whether ``kbit.matmul`` on this CUDA device runs dequantize + cuBLAS for the call (else the fused GEMM): the
    one decision that every caller of ``ops.gemm_direct`` with a GEMM layout of its own takes from ``gemm_plan``."""
    return gemm_plan(device, out_features, in_features, tokens, bits).path is Path.DEQUANTIZE_CUBLAS


@torch.compiler.assume_constant_result
def _planned(index: int, *request) -> Plan:
    """``gemm_plan`` of fixed sizes, memoized. torch.compile takes its result as a constant, made when it traces the
    call: tracing the cost model instead took about 0.35 s a call, minutes for a model's projections."""
    key = (index, *request, forced_paths())
    chosen = _PLANS.get(key)
    if chosen is None:
        chosen = device_facts(torch.device("cuda", index)).plan(*request)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = chosen
    return chosen


def moe_rows_per_pass(device: torch.device, slots: int, num_experts: int, shapes: Iterable[tuple], bits: int,
                      supported: Iterable[int]) -> int:
    """``rows_per_pass`` on a CUDA device, with its facts and coefficients (a constant to torch.compile where the
    slots are, as ``gemm_plan``'s)."""
    request = (slots, num_experts, tuple(map(tuple, shapes)), bits, tuple(supported))
    if torch.compiler.is_compiling() and not isinstance(slots, int):
        return device_facts(device).rows_per_pass(*request)
    return _rows_per_pass_planned(device_index(device), *request)


@torch.compiler.assume_constant_result
def _rows_per_pass_planned(index: int, *request) -> int:
    return device_facts(torch.device("cuda", index)).rows_per_pass(*request)
