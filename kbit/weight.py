"""QuantizedWeight and the high-level API: quantize, dequantize, matmul."""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import _op_contract, ops, planner
from ._validate import (
    GEMM_DTYPES,
    INPUT_DTYPES,
    check_bits,
    check_codebook,
    check_dtype,
    check_int,
    check_meta,
    check_not_meta,
    check_range,
    check_scale,
    check_storage,
    check_tensor,
    check_weight,
)
from .formats import (
    BLOCK_SIZE,
    STATE_KEYS,
    block_count,
    blocks_of,
    choose_tensor_scale,
    create_normal_float_codebook,
    decode_absmax_e4m4,
    meta_tensor,
    nearest_codes,
    pack_bitplanes,
    padded_in_features,
    storage_spec,
)
from .layout import gemm_shapes

class PrecisionWarning(UserWarning):
    """Some blocks of a quantized weight lost more than the format's error bound (see ``PrecisionLoss``)."""


class PrecisionLoss(NamedTuple):
    """Blocks of a quantized weight outside the format's per-block bound ``(max_gap / 2 + 1/16) * absmax``.

    ``kbit.quantize`` puts the largest block absmax of a weight near the top of E4M4's range (a per-tensor power
    of two), which leaves 2**14 below it at full precision and 2**19 in all. A block far smaller than the
    largest one (a weight with a huge outlier) falls into E4M4's subnormals or below them: its scale keeps few
    bits (``beyond_bound``) or rounds to zero (``zeroed``). A weight within 1/16 of its dtype's largest finite
    value would dequantize to Inf; such blocks get the next smaller block scale instead (``saturated``), so
    every finite weight dequantizes to a finite value.
    """

    zeroed: int  # blocks with a nonzero absmax whose block scale rounds to zero (included in beyond_bound)
    beyond_bound: int  # blocks whose largest error exceeds the bound
    saturated: int  # blocks whose block scale was lowered to stay finite in the weight's dtype
    blocks: int

    def describe(self, name: str) -> str:
        return (
            f"{name}: {self.beyond_bound} of {self.blocks} blocks lose more than the format's error bound "
            f"({self.zeroed} of them round to zero, {self.saturated} saturated at the dtype's largest value): the "
            f"weight spans more than E4M4's dynamic range (2**19 between its largest and smallest block absmax), "
            f"for example a huge outlier; those blocks are reconstructed with a larger error"
        )


def _check_row_order(row_order: Optional[Tensor], shape: tuple) -> Optional[Tensor]:
    """``row_order`` of a weight of ``shape``: None, or for one with experts an int64 [out_features] tensor (its
    values, a permutation, are not read)."""
    if row_order is None:
        return None
    if len(shape) != 3:
        raise ValueError(f"row_order is for a weight of experts [E, out_features, in_features]; a {list(shape)} "
                         f"weight's GEMM layout keeps its rows (kbit.matmul reads it)")
    check_tensor(row_order, "row_order")
    if row_order.dtype != torch.int64 or tuple(row_order.shape) != (shape[1],):
        raise ValueError(f"row_order must be int64 of shape ({shape[1]},), a permutation of the rows, got "
                         f"{row_order.dtype} {tuple(row_order.shape)}")
    return row_order


class QuantizedWeight:
    """A ``bits``-bit quantized [out_features, in_features] weight: its codes and block scales in one of two forms.
    Or E such weights of one shape, [E, out_features, in_features] (a mixture-of-experts projection, ``kbit.moe``).

    Storage format: the matrix zero-padded to ``padded_in_features`` columns (a multiple of 32), flattened row-major
    and quantized in blocks of 32 (``kbit.formats``), so each block lies within one row. ``scale`` is the per-tensor
    power of two (a 0-dim float32 tensor). What ``kbit.quantize`` returns holds this form; on a CUDA device the GEMM
    layout (``kbit.layout``) is derived from it by ``prepare()`` (or on first eager use) and cached beside it.

    A weight made by ``from_gemm_layout`` (or ``gemm_resident()``) holds the GEMM layout alone, one copy of the codes:
    what a kbit layer keeps on the GPU. Its storage format is derived from the layout whenever it is asked for
    (``storage()``, ``packed``, ``absmax``, ``state_dict``, ``to("cpu")``, ``dequantize``), bit for bit the one it was
    made from (``kbit.ops.unrepack``), and dropped after use.

    With experts (``experts`` is E): ``packed`` [E, blocks * bits], ``absmax`` [E, blocks] and ``scale`` [E] hold
    each expert's storage in its row (what ``kbit.quantize`` makes of that expert alone), the codebook is shared,
    and the GEMM layout is each expert's stacked, [E, *layout shape]: what the grouped GEMM reads
    (``kbit.ops.moe_gemm``), optionally with each expert's rows in ``row_order`` (``row_order[i]`` is the weight row
    that layout row i holds; the storage format keeps the weight's order). ``w[e]`` is expert e's 2-D weight in
    the storage format. ``kbit.matmul`` takes 2-D weights only.

    The constructor checks dtypes, shapes, devices and contiguity (no values: it is cheap and safe while
    tracing; so a ``row_order`` must be a permutation of range(out_features) unchecked); ``from_state_dict`` also
    checks the values an untrusted checkpoint could get wrong.
    """

    def __init__(self, packed: Tensor, absmax: Tensor, codebook: Tensor, scale: Tensor, bits: int, shape, dtype,
                 row_order: Optional[Tensor] = None):
        bits = check_bits(bits)
        if not isinstance(shape, (tuple, list, torch.Size)) or len(shape) not in (2, 3):
            raise ValueError(f"shape must be (out_features, in_features) or (experts, out_features, in_features), "
                             f"got {shape!r}")
        shape = tuple(check_int(n, f"shape[{i}]", 1) for i, n in enumerate(shape))
        check_dtype(dtype, "dtype")
        check_storage(packed, absmax, codebook, scale, bits, shape)
        self._set(packed, absmax, codebook, scale, bits, shape, dtype, _check_row_order(row_order, shape))

    @classmethod
    def from_checked(cls, packed: Tensor, absmax: Tensor, codebook: Tensor, scale: Tensor, bits: int, shape,
                     dtype, row_order: Optional[Tensor] = None) -> "QuantizedWeight":
        """The constructor without its checks, for storage that kbit made or has checked already."""
        qw = cls.__new__(cls)
        qw._set(packed, absmax, codebook, scale, bits, tuple(shape), dtype, row_order)
        return qw

    @classmethod
    def from_gemm_layout(cls, b_gemm: Tensor, absmax_gemm: Tensor, codebook: Tensor, scale: Tensor, bits: int, shape,
                         dtype, row_order: Optional[Tensor] = None) -> "QuantizedWeight":
        """A weight that holds only its GEMM layout (``kbit.layout``; dtypes, shapes and devices checked)."""
        qw = cls.__new__(cls)
        shape = tuple(shape)
        qw._set(None, None, codebook, scale, check_bits(bits), shape, dtype, _check_row_order(row_order, shape))
        qw._check_gemm_layout(b_gemm, absmax_gemm)
        qw._gemm = (b_gemm.device, b_gemm, absmax_gemm)
        return qw

    def _set(self, packed, absmax, codebook, scale, bits, shape, dtype, row_order) -> None:
        self._packed, self._absmax = packed, absmax  # None when only the GEMM layout is held
        self.codebook, self.scale = codebook, scale
        self.bits, self.shape, self.dtype = bits, shape, dtype
        self.row_order = row_order  # of each expert's rows in the GEMM layout; None: the weight's own
        self._gemm = None  # (device, b_gemm, absmax_gemm)

    def _check_gemm_layout(self, b_gemm: Tensor, absmax_gemm: Tensor) -> None:
        want = tuple((*self.shape[:-2], *s) for s in gemm_shapes(self.bits, self.out_features,
                                                                 self.in_features_padded))
        got = (tuple(b_gemm.shape), tuple(absmax_gemm.shape))
        if got != want or (b_gemm.dtype, absmax_gemm.dtype) != (torch.int32, torch.uint8):
            raise ValueError(f"a GEMM layout of int32 {want[0]} and uint8 {want[1]} was expected, got "
                             f"{b_gemm.dtype} {got[0]} and {absmax_gemm.dtype} {got[1]}")
        if not (b_gemm.device == absmax_gemm.device == self.codebook.device == self.scale.device):
            raise ValueError(f"the GEMM layout ({b_gemm.device}, {absmax_gemm.device}), codebook "
                             f"({self.codebook.device}) and scale ({self.scale.device}) must be on one device")
        if not (b_gemm.is_contiguous() and absmax_gemm.is_contiguous()):
            raise ValueError("the GEMM layout tensors must be contiguous")

    # ------------------------------------------------------------------ the two forms
    @property
    def is_gemm_resident(self) -> bool:
        """Whether this weight holds only the GEMM layout (its storage format derived on demand)."""
        return self._packed is None

    def storage(self) -> tuple:
        """(packed, absmax): the held storage format, or for a GEMM-resident weight one derived from the layout now,
        on its device (a new pair at every call: nothing is kept)."""
        if self._packed is not None:
            return self._packed, self._absmax
        if self.experts is None:
            _, b, a = self._gemm
            return ops.unrepack(b, a, self.bits, self.out_features, self.in_features_padded)
        specs = (storage_spec(key, self.bits, self.shape) for key in ("packed", "absmax"))
        packed, absmax = (torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in specs)
        for e in range(self.experts):
            packed[e], absmax[e] = self._expert_storage(e)
        return packed, absmax

    def _expert_storage(self, e: int) -> tuple:
        """(packed, absmax) of expert ``e``, derived from its GEMM layout: the inverse of ``_expert_layout``."""
        _, b, a = self._gemm
        packed, absmax = ops.unrepack(b[e], a[e], self.bits, self.out_features, self.in_features_padded)
        if self.row_order is None:
            return packed, absmax
        order = self.row_order.to(packed.device)  # layout row i is weight row order[i]: put each one back
        return tuple(torch.empty_like(t).view(self.out_features, -1).index_copy_(0, order, t.view(
            self.out_features, -1)).reshape(-1) for t in (packed, absmax))

    def _expert_layout(self, e: int, order: Optional[Tensor]) -> tuple:
        """(B_gemm, absmax_gemm) of expert ``e``, derived from its storage format with its rows in ``order`` (this
        weight's ``row_order`` on its device, or None)."""
        packed, absmax = self._packed[e], self._absmax[e]
        if order is not None:  # a storage row is whole blocks: reordering rows reorders their blocks
            packed, absmax = (t.view(self.out_features, -1)[order].reshape(-1) for t in (packed, absmax))
        return ops.repack(packed, absmax, self.bits, self.out_features, self.in_features_padded)

    @property
    def packed(self) -> Tensor:
        """The bit-plane codes (``kbit.formats``); derived at each access on a GEMM-resident weight (``storage``)."""
        return self.storage()[0]

    @property
    def absmax(self) -> Tensor:
        """The E4M4 block scales; derived at each access on a GEMM-resident weight (``storage``)."""
        return self.storage()[1]

    @property
    def resident(self) -> tuple:
        """The tensors this weight holds: (packed, absmax, codebook, scale) or (b_gemm, absmax_gemm, codebook, scale)
        for a GEMM-resident one (a layout cached beside the storage format is not listed)."""
        codes = (self._packed, self._absmax) if self._packed is not None else self._gemm[1:]
        return (*codes, self.codebook, self.scale)

    def gemm_resident(self) -> "QuantizedWeight":
        """This weight holding only its GEMM layout (the cached one, else derived now on its device), sharing the
        codebook and scale: once the storage format is no longer referenced elsewhere, one copy of the codes."""
        if self.is_gemm_resident:
            return self
        check_not_meta(self._packed, "packed")
        b, a = self.gemm_layout()
        return QuantizedWeight.from_gemm_layout(b, a, self.codebook, self.scale, self.bits, self.shape, self.dtype,
                                                self.row_order)

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self.resident[0].device

    @property
    def experts(self) -> Optional[int]:
        """E of a weight of shape [E, out_features, in_features]; None for a 2-D one."""
        return self.shape[0] if len(self.shape) == 3 else None

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    @property
    def out_features(self) -> int:
        return self.shape[-2]

    @property
    def in_features_padded(self) -> int:
        """Columns of the stored matrix: in_features rounded up to a multiple of 32."""
        return padded_in_features(self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes of the storage format (packed + absmax + codebook + scale), in either form."""
        blocks = block_count(self.out_features * self.in_features_padded)
        return (self.experts or 1) * (blocks * (4 * self.bits + 1) + 4) + 4 * self.codebook.numel()

    @property
    def resident_bytes(self) -> int:
        """Bytes of the tensors this weight holds on its device: ``resident``, plus a GEMM layout cached beside the
        storage format."""
        cached = self._gemm[1:] if self._gemm is not None and not self.is_gemm_resident else ()
        return sum(t.numel() * t.element_size() for t in (*self.resident, *cached))

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / math.prod(self.shape)

    def __repr__(self) -> str:
        return (
            f"QuantizedWeight(shape={self.shape}, bits={self.bits}, dtype={str(self.dtype).replace('torch.', '')}, "
            f"device={self.device}, bits_per_weight={self.bits_per_weight:.3f})"
        )

    # ------------------------------------------------------------------ conversions
    def to(self, device) -> "QuantizedWeight":
        """The weight on ``device``: a GEMM-resident one stays so on a CUDA device; elsewhere it becomes the storage
        format, derived on its current device first."""
        device = torch.device(device)
        codebook, scale = self.codebook.to(device), self.scale.to(device)
        if self.is_gemm_resident and device.type == "cuda":  # the layout is plain data: moving it is valid
            _, b, a = self._gemm
            return QuantizedWeight.from_gemm_layout(b.to(device), a.to(device), codebook, scale, self.bits,
                                                    self.shape, self.dtype, self.row_order)
        packed, absmax = self.storage()
        moved = QuantizedWeight.from_checked(packed.to(device), absmax.to(device), codebook, scale, self.bits,
                                             self.shape, self.dtype, self.row_order)
        if self._gemm is not None and not self.is_gemm_resident:
            moved._gemm = (device, self._gemm[1].to(device), self._gemm[2].to(device))
        return moved

    def cuda(self, device=None) -> "QuantizedWeight":
        return self.to(device if device is not None else "cuda")

    def cpu(self) -> "QuantizedWeight":
        return self.to("cpu")

    def gemm_layout(self):
        """(B_gemm, absmax_gemm) on this weight's device: held, or derived once from the storage format and cached."""
        if self._gemm is None or self._gemm[0] != self.device:
            if torch.compiler.is_compiling() and self.device.type == "cuda":
                # Derived inside a compiled region, the layout would be a graph output kept alive by this object:
                # under CUDA graphs (mode="reduce-overhead") its memory belongs to the graph's pool.
                raise RuntimeError(
                    "kbit: this weight's GEMM layout was not prepared before torch.compile; call kbit.prepare(model) "
                    "(or QuantizedWeight.prepare()) after moving the model to the GPU"
                )
            self._gemm = (self.device, *self._derived_layout())
            if self.device.type == "cuda" and self.experts is None:  # kbit.matmul plans from these facts, also
                planner.device_facts(self.device)                     # while torch.compile traces it
        return self._gemm[1], self._gemm[2]

    def _derived_layout(self) -> tuple:
        """(B_gemm, absmax_gemm) derived from the held storage format now: with experts, each expert's, stacked."""
        if self.experts is None:
            return ops.repack(self._packed, self._absmax, self.bits, self.out_features, self.in_features_padded)
        b_shape, a_shape = gemm_shapes(self.bits, self.out_features, self.in_features_padded)
        b = torch.empty(self.experts, *b_shape, dtype=torch.int32, device=self.device)
        a = torch.empty(self.experts, *a_shape, dtype=torch.uint8, device=self.device)
        order = None if self.row_order is None else self.row_order.to(self.device)
        for e in range(self.experts):
            b[e], a[e] = self._expert_layout(e, order)
        return b, a

    def prepare(self) -> "QuantizedWeight":
        """Derive the GEMM layout now when on a CUDA device, so that no later call allocates it. Returns self."""
        check_not_meta(self.resident[0], "packed")
        if self.device.type == "cuda":
            self.gemm_layout()
            planner.device_facts(self.device)
        return self

    def dequantize(self, dtype=None) -> Tensor:
        """The [out_features, in_features] reconstruction in ``dtype`` (default: the dtype it was quantized from);
        with experts [E, out_features, in_features], each expert's ``self[e].dequantize(dtype)``."""
        dtype = self.dtype if dtype is None else check_dtype(dtype, "dtype")
        if self.experts is not None:
            return torch.stack([expert.dequantize(dtype) for expert in self])
        return warn_overflow(self._dequantize(dtype), self.dtype)

    # ------------------------------------------------------------------ experts
    def __getitem__(self, expert: int) -> "QuantizedWeight":
        """Expert ``expert``'s [out_features, in_features] weight in the storage format: views of this weight's rows,
        or derived from its GEMM layout (rows in the weight's order), sharing the codebook."""
        e = check_int(expert, "expert", 0)
        if e >= self._experts_or_error():
            raise ValueError(f"expert must be < {self.experts}, got {e}")
        packed, absmax = (self._packed[e], self._absmax[e]) if self._packed is not None else self._expert_storage(e)
        return QuantizedWeight.from_checked(packed, absmax, self.codebook, self.scale[e], self.bits, self.shape[1:],
                                            self.dtype)

    def __iter__(self):
        """Each expert's 2-D weight (``self[e]``), in order."""
        return (self[e] for e in range(self._experts_or_error()))

    def _experts_or_error(self) -> int:
        if self.experts is None:
            raise TypeError(f"a {list(self.shape)} QuantizedWeight has no experts: only one of shape "
                            f"[experts, out_features, in_features] is indexed by expert")
        return self.experts

    def _dequantize(self, dtype: torch.dtype) -> Tensor:
        out_features, in_features = self.shape
        padded = self.in_features_padded
        if self._packed is None:  # GEMM-resident: straight from the layout, no storage in between
            _, b, a = self._gemm
            w = ops.dequantize_layout(b, a, self.codebook, self.bits, out_features, padded, dtype, self.scale)
        else:
            w = ops.dense_stored(self._packed, self._absmax, self.codebook, self.bits, out_features, padded, dtype,
                                 self.scale)
        return w if padded == in_features else w[:, :in_features].contiguous()

    def _matmul_stored(self, x: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        """x [M, in_features] @ W_hat^T (+ bias) from the storage format (``ops.matmul_stored``), unchecked."""
        packed, absmax = self.storage()
        return ops.matmul_stored_direct(x, packed, absmax, self.codebook, self.scale, bias, self.bits,
                                        self.out_features, self.in_features_padded)

    def _stored_cpu_kernel(self, x: Tensor, bias: Optional[Tensor]):
        """``_matmul_stored`` as a CPU kernel bound to this weight (a function (x, bias) -> y that skips the custom
        op), its arguments checked here once against a sample x [M, in_features] and bias; None without the
        kernels."""
        packed, absmax = self.storage()
        _op_contract.matmul_stored(x, packed, absmax, self.codebook, self.scale, bias, self.bits, self.out_features,
                                   self.in_features_padded)
        return ops.stored_cpu_kernel(packed, absmax, self.codebook, self.scale, self.bits, self.out_features,
                                     self.in_features_padded)

    # ------------------------------------------------------------------ serialization
    def meta_tensor(self) -> Tensor:
        if self.experts is not None:  # a layer of experts saves its own meta (kbit.moe: KbitExperts)
            raise TypeError(f"a QuantizedWeight of {self.experts} experts has no single-weight meta or state_dict: "
                            f"save each expert's (w[e]) or the KbitExperts holding it")
        return meta_tensor(self.bits, self.shape, self.dtype)

    def state_dict(self, prefix: str = "") -> dict:
        """Tensors only (``formats.STATE_KEYS``), so the dict saves with torch.save and safetensors alike (a
        2-D weight's)."""
        meta = self.meta_tensor()
        packed, absmax = self.storage()
        tensors = {"packed": packed, "absmax": absmax, "codebook": self.codebook, "scale": self.scale, "meta": meta}
        return {prefix + key: tensors[key] for key in STATE_KEYS}

    @classmethod
    def from_state_dict(cls, state: dict, prefix: str = "") -> "QuantizedWeight":
        """The weight saved by ``state_dict(prefix)``, every tensor and value checked (untrusted input)."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict of tensors, got {type(state).__name__}")
        missing = [prefix + key for key in STATE_KEYS if prefix + key not in state]
        if missing:
            raise ValueError(f"state dict lacks {', '.join(missing)}")
        bits, shape, dtype = check_meta(state[prefix + "meta"], prefix + "meta")
        tensors = {key: check_tensor(state[prefix + key], prefix + key) for key in STATE_KEYS if key != "meta"}
        for key in ("codebook", "scale"):  # float32 by definition; a checkpoint cast to 16 bits still loads
            if tensors[key].is_floating_point():
                tensors[key] = tensors[key].to(torch.float32)
        check_storage(*tensors.values(), bits, shape, prefix=prefix)
        check_codebook(tensors["codebook"], bits, prefix + "codebook")
        check_scale(tensors["scale"], tensors["scale"].device, prefix + "scale")
        check_range(tensors["absmax"], tensors["scale"], tensors["codebook"], dtype,
                    f"{prefix}absmax with {prefix}scale")
        return cls.from_checked(*tensors.values(), bits, shape, dtype)


# ---------------------------------------------------------------------- high-level API
# Blocks per piece of the audit: its float32 temporaries (about 16 bytes per weight) stay near 64 MiB whatever the
# layer's size, below the layer itself in 16 bits for large layers (quantizing while loading onto the GPU).
AUDIT_BLOCKS = 1 << 17


def _block_errors(Wp: Tensor, packed: Tensor, absmax: Tensor, cb: Tensor, bits: int, scale: Tensor):
    """Per block of the padded weight: (largest |error| in float32, true absmax, largest |reconstruction|)."""
    blocks = Wp.reshape(-1, BLOCK_SIZE)
    pieces = []
    for start in range(0, blocks.shape[0], AUDIT_BLOCKS):
        stop = min(start + AUDIT_BLOCKS, blocks.shape[0])
        w_hat = ops.dequantize(packed[start * bits:stop * bits], absmax[start:stop], cb, bits,
                               (stop - start) * BLOCK_SIZE, torch.float32, scale).reshape(-1, BLOCK_SIZE)
        w = blocks[start:stop].to(torch.float32)
        peak = _abs_max(w_hat)
        pieces.append((_abs_max(w_hat.sub_(w)), _abs_max(w), peak))  # |w - w_hat| == |w_hat - w|
    return tuple(torch.cat(parts) for parts in zip(*pieces))


def _abs_max(blocks: Tensor) -> Tensor:
    """max |x| per row without an |x| temporary (one pass; the CPU quantize is bound by such passes)."""
    lo, hi = torch.aminmax(blocks, dim=1)
    return torch.maximum(-lo, hi)


def _saturate(Wp: Tensor, packed: Tensor, absmax: Tensor, cb: Tensor, bits: int, scale: Tensor,
              blocks: Tensor) -> None:
    """Lower the block scale of ``blocks`` until their largest level fits Wp's dtype, re-choosing their codes.

    The true absmax of such a block is finite in the dtype, so one or two E4M4 steps down suffice; the top
    element then clips by less than one step (1/16).
    """
    limit = torch.finfo(Wp.dtype).max
    peak = float(cb.abs().max())
    codes = absmax[blocks].to(torch.int32)
    for _ in range(4):
        too_big = decode_absmax_e4m4(codes.to(torch.uint8)) * float(scale) * peak > limit
        codes = torch.where(too_big & (codes > 0), codes - 1, codes)
    new_absmax = codes.to(torch.uint8)
    x = blocks_of(Wp, scale)[blocks]
    absmax[blocks] = new_absmax
    codes = pack_bitplanes(nearest_codes(x, decode_absmax_e4m4(new_absmax), cb), bits)
    packed.view(-1, bits)[blocks] = codes.view(-1, bits)


def _audit(Wp: Tensor, packed: Tensor, absmax: Tensor, cb: Tensor, bits: int, scale: Tensor) -> PrecisionLoss:
    """Fix blocks that would dequantize past the dtype's range, then count blocks beyond the format's bound."""
    err, true_absmax, peak = _block_errors(Wp, packed, absmax, cb, bits, scale)
    overflow = (peak > torch.finfo(Wp.dtype).max).nonzero().flatten()
    if overflow.numel():  # rare: only then is a second pass over the weight needed
        _saturate(Wp, packed, absmax, cb, bits, scale, overflow)
        err, true_absmax, _ = _block_errors(Wp, packed, absmax, cb, bits, scale)
    gaps = cb[1:] - cb[:-1]
    slack = 1e-6 * true_absmax + torch.finfo(torch.float32).tiny  # float32 rounding of the comparison itself
    bound = (float(gaps.max()) / 2 + 1 / 16) * true_absmax + slack
    zeroed = (true_absmax > 0) & (decode_absmax_e4m4(absmax) == 0)
    return PrecisionLoss(
        zeroed=int(zeroed.sum()), beyond_bound=int((err > bound).sum()), saturated=int(overflow.numel()),
        blocks=int(absmax.numel()),
    )


def quantize_checked(W: Tensor, bits: int, codebook: Optional[Tensor] = None):
    """``quantize_with_report`` for arguments already checked at a public boundary (``kbit._validate``):
    ``W`` by ``check_weight``, ``bits`` by ``check_bits``, ``codebook`` by ``check_codebook`` (or None: normal-float).
    """
    cb = create_normal_float_codebook(bits, W.device) if codebook is None else codebook.to(W.device, copy=True)
    in_features = W.shape[1]
    padded = padded_in_features(in_features)
    Wp = W.detach() if padded == in_features else torch.nn.functional.pad(W.detach(), (0, padded - in_features))
    Wp = Wp.contiguous()
    scale = choose_tensor_scale(torch.maximum(Wp.amax(), -Wp.amin()))  # the largest |w|, with no |W| copy
    packed, absmax = ops.quantize(Wp, cb, bits, scale)
    loss = _audit(Wp, packed, absmax, cb, bits, scale)
    return QuantizedWeight.from_checked(packed, absmax, cb, scale, bits, tuple(W.shape), W.dtype), loss


def quantize_with_report(W: Tensor, bits: int = 4, codebook: Optional[Tensor] = None, name: str = "W"):
    """``quantize`` without the warning: ``(QuantizedWeight, PrecisionLoss)``. ``name`` appears in errors."""
    bits = check_bits(bits)
    check_weight(W, name)
    cb = None if codebook is None else check_codebook(codebook, bits)
    return quantize_checked(W, bits, cb)


def quantize(W: Tensor, bits: int = 4, codebook: Optional[Tensor] = None, name: str = "W") -> QuantizedWeight:
    """Quantize an [out_features, in_features] weight (nn.Linear layout, fp16/bf16/fp32, any shape).

    Warns (``kbit.PrecisionWarning``, naming ``name`` and the count) when some blocks lose more than the
    format's error bound; ``warnings.simplefilter("error", kbit.PrecisionWarning)`` makes that an error.
    """
    qw, loss = quantize_with_report(W, bits, codebook, name)
    warn_precision(loss, name)
    return qw


def warn_precision(loss: PrecisionLoss, name: str, stacklevel: int = 2) -> None:
    """A ``PrecisionWarning`` naming ``name`` if ``loss`` counts blocks beyond the bound or saturated; ``stacklevel``
    as ``warnings.warn`` would take it in the caller."""
    if loss.beyond_bound or loss.saturated:
        warnings.warn(loss.describe(name), PrecisionWarning, stacklevel=stacklevel + 1)


def warn_overflow(w: Tensor, source: torch.dtype) -> Tensor:
    """``w``, the reconstruction of a weight quantized from ``source``: a ``PrecisionWarning`` if ``w``'s dtype is
    narrower and some values were past its range (they are Inf). Every value fits ``source`` itself (``quantize``
    and loading make sure), so only a narrower dtype is checked: its extremes (one host synchronization; counting
    Inf over the whole weight costs more than dequantizing it on a CPU), the Inf counted only where there are some."""
    if torch.finfo(w.dtype).max < torch.finfo(source).max and w.numel():
        if bool(torch.stack(torch.aminmax(w)).isinf().any()):
            overflowed = int(torch.isinf(w).sum())
            warnings.warn(
                f"dequantize: {overflowed} of {w.numel()} values of a {str(source).replace('torch.', '')} weight lie "
                f"past {str(w.dtype).replace('torch.', '')}'s largest value and became Inf; dequantize to the "
                f"weight's own dtype (the default) to keep them", PrecisionWarning, stacklevel=3)
    return w


def dequantize(qw: QuantizedWeight, dtype=None) -> Tensor:
    """The [out_features, in_features] reconstruction of ``qw`` in ``dtype`` (default: the dtype it was quantized
    from)."""
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw must be a kbit.QuantizedWeight, got {type(qw).__name__}")
    return qw.dequantize(dtype)


def matmul(x: Tensor, qw: QuantizedWeight, bias: Optional[Tensor] = None, grid_override: int = 0) -> Tensor:
    """``x @ dequantize(qw).T (+ bias)`` for x of shape [..., in_features]; fused kernel on CUDA.

    On CPU, a kernel that dequantizes each block of 32 into registers multiplies it in float32 (``kbit._build_cpu``;
    else the weight is dequantized in float32 and multiplied in float32). On CUDA, float32 activations (a float32
    model; no fused kernel takes them) multiply the weight dequantized to float32 with cuBLAS. Never synchronizes.
    ``grid_override`` > 0 forces the CUDA kernel's grid size (tests use it to force split-K).
    """
    check_tensor(x, "x")
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw must be a kbit.QuantizedWeight, got {type(qw).__name__}")
    if qw.experts is not None:
        raise TypeError(f"qw is a QuantizedWeight of {qw.experts} experts, shape {list(qw.shape)}: kbit.matmul "
                        f"multiplies by a 2-D weight (qw[e] is expert e's)")
    out_features, in_features = qw.shape
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(f"x must have shape [..., {in_features}] to multiply a [{out_features}, {in_features}] "
                         f"weight, got {tuple(x.shape)}")
    if x.device != qw.device:
        raise ValueError(f"x is on {x.device} but the weight is on {qw.device}")
    if bias is not None:
        check_tensor(bias, "bias")
        if bias.shape != (out_features,):
            raise ValueError(f"bias must have shape ({out_features},), got {tuple(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device} but x is on {x.device}")
    grid_override = check_int(grid_override, "grid_override", 0)
    check_dtype(x.dtype, "x", INPUT_DTYPES)
    if grid_override and x.device.type == "cuda" and x.dtype not in GEMM_DTYPES:
        raise TypeError(f"grid_override forces the fused kernel, which takes float16 or bfloat16 x, got {x.dtype}")
    return matmul_unchecked(x, qw, bias, grid_override)


def matmul_unchecked(x: Tensor, qw: QuantizedWeight, bias: Optional[Tensor] = None, grid_override: int = 0) -> Tensor:
    """``matmul`` without its checks, for a caller that holds a checked 2-D weight and bias (kbit's layers) and has
    checked x: [..., in_features], an input dtype, on the weight's device."""
    out_features, in_features = qw.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    if x.device.type == "cuda":
        bias_c = None if bias is None else bias.to(x.dtype).contiguous()
        if x.dtype not in GEMM_DTYPES or not grid_override and planner.dequantizes_first(
                x.device, out_features, qw.in_features_padded, x2.shape[0], qw.bits):
            y = torch.nn.functional.linear(x2, qw._dequantize(x.dtype), bias_c)
        else:
            b, a = qw.gemm_layout()
            y = ops.gemm_direct(x2, b, a, qw.codebook, qw.scale, bias_c, qw.bits, out_features,
                                qw.in_features_padded, grid_override)
    elif qw.is_gemm_resident and x.dtype in GEMM_DTYPES:  # from the layout it holds (the reference op), as on CUDA
        y = ops.gemm_direct(x2, *qw.gemm_layout(), qw.codebook, qw.scale, None if bias is None else bias.to(x.dtype),
                            qw.bits, out_features, qw.in_features_padded, grid_override)
    else:
        y = qw._matmul_stored(x2, bias)
    return y.reshape(*lead, out_features)
