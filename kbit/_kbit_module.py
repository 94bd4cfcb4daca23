"""What ``KbitLinear`` and ``KbitExperts`` do alike as modules: move, save, load and prepare their quantized weights.

Both hold the storage format (what is saved) or, GEMM-resident on CUDA, the GEMM layout in place of its codes
(derived, never saved), and empty parameters counting the quantized elements (``kbit._counted``). Each quantized
weight it holds (``WEIGHTS``: KbitLinear's one, KbitExperts' two projections with a leading expert dimension) is
seen through a ``QuantizedWeight`` view of its buffers (``_view``), which derives one form from the other. This
class owns those views, the passage between the two forms (``_hold_storage``, ``_hold_layout``) and every step that
goes through it: device and dtype moves, saving, loading. A subclass names its buffers and count parameters in the
class attributes below and supplies:

- ``is_gemm_resident``: whether it holds the layout;
- ``_weight_shape``: the shape and layout row order of each of its weights;
- ``_hold_counts``: make the counting parameters (again);
- ``_moved``: what follows a device or dtype move;
- ``_check_state``: check what a state dict brings for it and return the weight's dtype;
- ``prepare``: which form to hold where, and what else its GEMM needs made beforehand;
- ``_layout_assigned`` (optional): what follows assigning one of its layout buffers.
"""

from __future__ import annotations

import torch
from torch import nn

from ._counted import counts_hidden
from ._validate import refuse_assignment
from .weight import QuantizedWeight


def _same_tensors(a, b) -> bool:
    for x, y in zip(a, b):
        if x is not y:
            return False
    return True


class KbitModule(nn.Module):
    FORMAT_KEYS: tuple = ()  # buffers of the storage format, as saved
    # {weight: (packed, absmax, scale, layout codes, layout absmax)}: the buffers of each quantized weight, which
    # share the buffer ``codebook``. DERIVED_KEYS and LAYOUT_KEYS follow from it.
    WEIGHTS: dict = {}
    DERIVED_KEYS: tuple = ()  # the storage format's codes: held off CUDA, derived from the layout when saved on CUDA
    LAYOUT_KEYS: tuple = ()  # buffers of the GEMM layout, held in place of DERIVED_KEYS on CUDA
    COUNTS: tuple = ()  # the empty parameters counting the quantized elements
    REFUSED: tuple = ()  # names that cannot be assigned: the full-precision weights the module stands for

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.DERIVED_KEYS = tuple(key for keys in cls.WEIGHTS.values() for key in keys[:2])
        cls.LAYOUT_KEYS = tuple(key for keys in cls.WEIGHTS.values() for key in keys[3:])

    # ------------------------------------------------------------------ the weights
    def _view(self, name: str) -> QuantizedWeight:
        """A ``QuantizedWeight`` of weight ``name``'s buffers (``WEIGHTS``), GEMM-resident when the module is; kept
        while they stay the same tensors, so that a GEMM layout derived from the storage format stays cached."""
        packed, absmax, scale, codes, gemm_absmax = self.WEIGHTS[name]
        gemm = self.is_gemm_resident
        held = tuple(map(self._held, ((codes, gemm_absmax) if gemm else (packed, absmax)) + ("codebook", scale)))
        qw = self._views.get(name)
        if qw is None or qw.is_gemm_resident != gemm or not _same_tensors(qw.resident, held):
            # Checked: a buffer may have been assigned by hand, or left on meta by a partial assign-load.
            shape, row_order = self._weight_shape(name)
            make = QuantizedWeight.from_gemm_layout if gemm else QuantizedWeight
            qw = self._views[name] = make(*held, self.bits, shape, self.weight_dtype, row_order)
        return qw

    def _held(self, key: str):
        """Buffer ``key``, from the buffer dict where it is there (nn.Module's attribute lookup costs ~1.5 us, which a
        small layer's forward at one token pays several times), else as an attribute (a loader may hold it elsewhere
        for a while)."""
        buffers = self._buffers
        return buffers[key] if key in buffers else getattr(self, key)

    def _invalidate(self) -> None:
        """Forget the views: the buffers they were made of have been replaced or written."""
        self._views = {}

    # ------------------------------------------------------------------ the two forms
    def _derived_storage(self) -> dict:
        """{buffer: tensor} of the storage format's codes, derived from the GEMM layout (new tensors)."""
        derived = {}
        for name, (packed, absmax, *_) in self.WEIGHTS.items():
            derived[packed], derived[absmax] = self._view(name).storage()
        return derived

    def _derive_layout(self) -> None:
        """Set the layout's buffers from the held storage format, on its device, keeping it; the views then hold
        that layout (no second derivation or check at the next call)."""
        for name, (*_, codes, absmax) in self.WEIGHTS.items():
            qw = self._view(name).gemm_resident()
            b, a = qw.gemm_layout()
            setattr(self, codes, b)
            setattr(self, absmax, a)
            self._views[name] = qw

    def _hold_storage(self) -> None:
        """Hold the storage format (derived from the GEMM layout on its device if need be) and no layout."""
        if self.is_gemm_resident:
            for name, t in self._derived_storage().items():
                setattr(self, name, t)
            self._invalidate()  # the views hold the layout
        for name in self.LAYOUT_KEYS:
            setattr(self, name, None)

    def _hold_layout(self) -> None:
        """Hold the GEMM layout (derived from the storage format on its device if need be, which is then dropped),
        with the format's other buffers marked static for ``torch.compile``."""
        if not self.is_gemm_resident:
            self._derive_layout()
            for name in self.DERIVED_KEYS:
                setattr(self, name, None)
        for name in self.FORMAT_KEYS + self.LAYOUT_KEYS:
            t = self._buffers[name]
            if t is not None:
                # CUDA graphs (torch.compile mode="reduce-overhead") then read it in place instead of copying it in.
                torch._dynamo.mark_static_address(t, guard=False)

    # ------------------------------------------------------------------ device / dtype moves
    def _apply(self, fn, recurse=True):
        # Leaving the GPU, the storage format travels (derived there by the CUDA kernel), not the layout.
        if self.is_gemm_resident and fn(self._buffers[self.LAYOUT_KEYS[0]].new_empty(0)).device.type != "cuda":
            self._hold_storage()
        # Module-wide dtype casts (.half(), .to(dtype), .float()) must not change the format's buffers: codebook and
        # scales are float32 by definition. Apply fn to find the target device, then move the originals there.
        before = {name: self._buffers.get(name) for name in self.FORMAT_KEYS + self.LAYOUT_KEYS}
        with counts_hidden(self, self.COUNTS):
            super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers.get(name)
            if old is not None and new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        self._invalidate()
        self._moved()
        return self

    # ------------------------------------------------------------------ saving
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # The storage format, whichever form the module holds; never the GEMM layout.
        saved = {}
        with counts_hidden(self, self.COUNTS):
            super()._save_to_state_dict(saved, prefix, keep_vars)
        if self.is_gemm_resident:
            saved.update((prefix + name, t) for name, t in self._derived_storage().items())
        for name in (*self._parameters, *self._buffers):  # in the order of a module that holds the storage format
            if name not in self.LAYOUT_KEYS and prefix + name in saved:
                destination[prefix + name] = saved[prefix + name]

    # ------------------------------------------------------------------ loading
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # A checkpoint is untrusted: check what it holds for this module before any of it is assigned. It holds the
        # storage format: load into that (the current one derived, so that a partial or failed load keeps the
        # weights), then derive the layout again (prepare), one module at a time.
        layout = [(name, self._buffers[name]) for name in self.LAYOUT_KEYS] if self.is_gemm_resident else None
        try:
            dtype = self._check_state(state_dict, prefix)
        except (TypeError, ValueError) as e:
            error_msgs.append(str(e))
            if layout is not None and not self.is_gemm_resident:
                # The checks derived the storage format to compare with: back to the very layout tensors (CUDA
                # graphs captured over them stay valid).
                for name in self.DERIVED_KEYS:
                    setattr(self, name, None)
                for name, t in layout:
                    setattr(self, name, t)
                self._invalidate()
            return
        self._hold_storage()
        with counts_hidden(self, self.COUNTS):
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
        self.weight_dtype = dtype
        self._invalidate()  # loaded in place, or assigned
        self._loaded(state_dict, prefix)
        self.prepare()

    def _loaded(self, state_dict: dict, prefix: str) -> None:
        """What a module keeps from a state dict besides its buffers (KbitLinear: its rotation block)."""

    def __setstate__(self, state):  # a copied parameter loses its attributes: the counts are made again
        super().__setstate__(state)
        self._invalidate()  # a copy makes its own views of its own buffers
        self._hold_counts()

    def __setattr__(self, name: str, value) -> None:
        refuse_assignment(self, name, self.REFUSED)
        super().__setattr__(name, value)
        if name in self.LAYOUT_KEYS:
            self._layout_assigned()

    def _layout_assigned(self) -> None:
        """A GEMM layout buffer was assigned (KbitLinear: its fused siblings stop reading their stack)."""
