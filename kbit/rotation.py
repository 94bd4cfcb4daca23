"""Incoherence rotation of a layer's input features: random signs, then a block-diagonal Hadamard transform.

With ``R = diag(signs) @ blockdiag(H_b, ..., H_b)`` (``H_b`` the normalized b x b Sylvester Hadamard matrix,
symmetric and orthogonal), ``x @ W.T == (x @ R) @ (W @ R).T``. Quantizing ``W @ R`` instead of ``W`` spreads
each weight's outliers over ``b`` inputs, so the rotated rows are close to Gaussian (what the normal-float
codebook and the block scales fit best) and no block is dominated by one large weight. The layer then rotates
its activations (``rotate``) before the unchanged k-bit matmul, and un-rotates the dequantized weight
(``unrotate``) wherever the weight itself is read.

``b`` is a power of two dividing ``in_features`` (``choose_block``); the signs are saved with the layer.
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import NamedTuple, Optional

import torch
from torch import Tensor

__all__ = ["MAX_BLOCK", "Rotation", "choose_block", "random_signs", "hadamard", "rotate", "unrotate", "check_rotation"]

# Largest Hadamard block: wider blocks mix more inputs (more incoherence) but cost b multiply-adds per input
# element; 512 is under 15% of the GEMM's own work for layers of 4096 outputs or more.
MAX_BLOCK = 512


def choose_block(in_features: int) -> int:
    """The largest power of two that divides ``in_features``, at most ``MAX_BLOCK`` (1: nothing to rotate)."""
    return min(in_features & -in_features, MAX_BLOCK)


def random_signs(in_features: int, seed: int) -> Tensor:
    """int8 [in_features] of +-1, drawn from ``seed`` (on the CPU, so the same on every machine)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (in_features,), generator=g, dtype=torch.int8) * 2 - 1


@functools.lru_cache(maxsize=None)
def _hadamard_cpu(block: int) -> Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(block)


_DEVICE_CACHE: dict = {}


def hadamard(block: int, dtype: torch.dtype, device) -> Tensor:
    """The normalized [block, block] Sylvester Hadamard matrix (cached per block, dtype and device)."""
    key = (block, dtype, torch.device(device))
    h = _DEVICE_CACHE.get(key)
    if h is None:
        h = _DEVICE_CACHE[key] = _hadamard_cpu(block).to(device=device, dtype=dtype)
    return h


def _check(n: int, signs: Tensor, block: int) -> None:
    if signs.shape != (n,) or block < 1 or block & (block - 1) or n % block:
        raise ValueError(f"a rotation of {n} features needs {n} signs and a power-of-two block dividing {n}, "
                         f"got {tuple(signs.shape)} signs and block {block}")


def rotate(x: Tensor, signs: Tensor, block: int) -> Tensor:
    """``x @ R`` over the last dimension, in ``x``'s dtype (float32 math for the CPU's half types)."""
    n = x.shape[-1]
    _check(n, signs, block)
    dtype = x.dtype if x.device.type == "cuda" or x.dtype == torch.float64 else torch.float32
    xs = x.to(dtype) * signs.to(device=x.device, dtype=dtype)
    y = (xs.reshape(*x.shape[:-1], n // block, block) @ hadamard(block, dtype, x.device)).reshape(x.shape)
    return y.to(x.dtype)


def unrotate(y: Tensor, signs: Tensor, block: int) -> Tensor:
    """``y @ R.T`` over the last dimension (the inverse of ``rotate``): ``H_b`` is symmetric."""
    n = y.shape[-1]
    _check(n, signs, block)
    dtype = y.dtype if y.device.type == "cuda" or y.dtype == torch.float64 else torch.float32
    h = hadamard(block, dtype, y.device)
    z = (y.to(dtype).reshape(*y.shape[:-1], n // block, block) @ h).reshape(y.shape)
    return (z * signs.to(device=y.device, dtype=dtype)).to(y.dtype)


class Rotation(NamedTuple):
    """One layer's rotation: int8 ``signs`` [in_features] and the Hadamard ``block``."""

    signs: Tensor
    block: int

    @classmethod
    def random(cls, in_features: int, seed: int) -> Optional["Rotation"]:
        """Random signs from ``seed`` and ``choose_block``'s block; None where no block of 2 or more divides."""
        block = choose_block(in_features)
        return cls(random_signs(in_features, seed), block) if block > 1 else None

    @classmethod
    def for_layer(cls, name: str, in_features: int) -> Optional["Rotation"]:
        """``random`` seeded by the layer's name: the same signs whichever way the model is quantized."""
        return cls.random(in_features, zlib.crc32(name.encode()))

    def rotate(self, x: Tensor) -> Tensor:
        return rotate(x, self.signs, self.block)

    def unrotate(self, y: Tensor) -> Tensor:
        return unrotate(y, self.signs, self.block)

    def hessian(self, H: Tensor) -> Tensor:
        """``R.T @ H @ R``: the input Hessian of the rotated inputs ``x @ R``."""
        return self.rotate(self.rotate(H).T.contiguous())


def check_rotation(signs, block, in_features: int, prefix: str = "") -> int:
    """A saved rotation (untrusted): int8 ``signs`` [in_features] of +-1 and a power-of-two ``block`` of at least 2
    dividing ``in_features`` (an int or an integer 0-dim tensor). Returns the block as an int."""
    if not isinstance(signs, Tensor) or signs.dtype != torch.int8 or tuple(signs.shape) != (in_features,):
        got = f"{signs.dtype} {tuple(signs.shape)}" if isinstance(signs, Tensor) else type(signs).__name__
        raise ValueError(f"{prefix}rotation_signs must be int8 of shape ({in_features},), got {got}")
    if isinstance(block, Tensor):
        if block.dim() != 0 or block.is_floating_point() or block.dtype == torch.bool:
            raise ValueError(f"{prefix}rotation_block must be a 0-dim integer tensor, got {block.dtype} "
                             f"{tuple(block.shape)}")
        block = int(block)
    if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block & (block - 1) or in_features % block:
        raise ValueError(f"{prefix}rotation_block must be a power of two >= 2 dividing in_features={in_features}, "
                         f"got {block!r}")
    if signs.device.type != "meta" and not bool((signs.abs() == 1).all()):
        raise ValueError(f"{prefix}rotation_signs must hold only -1 and +1")
    return block
