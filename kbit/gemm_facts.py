"""What the GEMM planner plans from: the paths, the GPU, and the fused configurations the CUDA extension built.

The extension owns the configurations (the compile-time lists in gemm.cuh / gemm_ws.cuh): ``gemm_configs()`` reports
each one's pass, tile, shared memory and the compute capabilities its code is built for, and
``parse_configs`` reads that report. ``tests/gemm_configs.json`` pins it for the CPU tests.
"""

from __future__ import annotations

import enum
import json
from typing import NamedTuple


class Path(str, enum.Enum):
    MMA_SYNC = "mma_sync"
    K_SPLIT = "k_split"
    WGMMA = "wgmma"
    WARP_SPECIALIZED = "warp_specialized"
    # The warp-specialized kernel's 128-row tiles below 256 tokens (two consumer warpgroups): a path of its own, so
    # that a fit prices its steps apart (fewer warps per SM hide less of each step's latency).
    WS_128_ROWS = "warp_specialized_128_rows"
    DEQUANTIZE_CUBLAS = "dequantize_cublas"


FUSED_PATHS = (Path.MMA_SYNC, Path.K_SPLIT, Path.WGMMA, Path.WARP_SPECIALIZED, Path.WS_128_ROWS)


class Device(NamedTuple):
    name: str
    capability: tuple  # (major, minor)
    sms: int  # multiprocessors
    smem_per_block: int  # opt-in maximum shared memory per block, bytes
    clusters: tuple = ()  # clusters of 1, 2, .. 8 CTAs of gemm.cuh's clustered kernels it runs at once; (): not known

    def clusters_at_once(self, ctas: int) -> int:
        """Thread-block clusters of ``ctas`` CTAs this GPU runs at once (the extension's ``gemm_clusters_at_once``);
        0 below compute capability 9.0 (no clusters) or where not known."""
        if self.capability[0] < 9 or not 1 <= ctas <= len(self.clusters):
            return 0
        return self.clusters[ctas - 1]


class GemmConfig(NamedTuple):
    """One built configuration of the fused GEMM, as the extension reports it (``GemmConfigInfo`` in kbit.h)."""

    bits: int
    mb: int  # 8-token MMA tiles per pass
    wgmma_tiles: int  # 0: mma.sync; 1 or 2: wgmma with that many 16-row tiles per warp; ws_tokens: 1 128-row tiles
    ws_tokens: int  # > 0: the warp-specialized kernel with that many tokens per tile
    k_split: int  # 1, or 8: the warps split the k-groups of one tile
    tile_rows: int  # weight rows per CTA tile
    smem_bytes: int  # per CTA, static included
    cc_major_min: int  # the compute capabilities (major) its code is built for
    cc_major_max: int

    @property
    def path(self) -> Path:
        if self.ws_tokens:
            return Path.WS_128_ROWS if self.wgmma_tiles else Path.WARP_SPECIALIZED
        return Path.WGMMA if self.wgmma_tiles else Path.K_SPLIT if self.k_split > 1 else Path.MMA_SYNC

    @property
    def key(self) -> tuple:
        return self.mb, self.wgmma_tiles, self.ws_tokens, self.k_split

    @property
    def tile_parts_in_clusters(self) -> bool:
        """Whether a launch may cut this configuration's tiles in 2 to 8 parts, each tile's parts one thread-block
        cluster summing them in shared memory (``tile_parts``, tiles x parts CTAs; compute capability 9.0 on):
        gemm.cuh's mma.sync configurations up to 16 tokens (the binding's ``gemm_plan`` refuses the others)."""
        return not self.ws_tokens and not self.wgmma_tiles and self.mb <= 2

    @property
    def tokens(self) -> int:
        """Tokens per pass: the kernel reads the weights once per pass."""
        return self.mb * 8

    def runs_on(self, device: Device) -> bool:
        return (self.cc_major_min <= device.capability[0] <= self.cc_major_max
                and self.smem_bytes <= device.smem_per_block)


def parse_configs(text: str) -> tuple:
    """The extension's report (``kbit_cuda.gemm_configs()``, JSON) as GemmConfigs."""
    return tuple(GemmConfig(**{field: int(row[field]) for field in GemmConfig._fields}) for row in json.loads(text))
