"""What ``KbitLinear`` and ``KbitExperts`` do alike as modules: move, save, load and prepare their quantized weights.

Both hold the storage format (what is saved) or, GEMM-resident on CUDA, the GEMM layout in place of its codes
(derived, never saved), and empty parameters counting the quantized elements (``kbit._counted``). This class owns
the passage between the two forms (``_hold_storage``, ``_hold_layout``) and every step that goes through it: device
and dtype moves, saving, loading. A subclass names its buffers and count parameters in the class attributes below
and supplies:

- ``is_gemm_resident``: whether it holds the layout;
- ``_hold_counts``: make the counting parameters (again);
- ``_derived_storage``: {buffer: tensor} of the storage format's codes, derived from the layout;
- ``_derive_layout``: set the layout's buffers from the held storage format, keeping it;
- ``_moved``: what follows a device or dtype move;
- ``_check_state``: check what a state dict brings for it and return the weight's dtype;
- ``prepare``: which form to hold where, and what else its GEMM needs made beforehand.
"""

from __future__ import annotations

import torch
from torch import nn

from ._counted import counts_hidden
from ._validate import refuse_assignment


class KbitModule(nn.Module):
    FORMAT_KEYS: tuple = ()  # buffers of the storage format, as saved
    DERIVED_KEYS: tuple = ()  # the storage format's codes: held off CUDA, derived from the layout when saved on CUDA
    LAYOUT_KEYS: tuple = ()  # buffers of the GEMM layout, held in place of DERIVED_KEYS on CUDA
    COUNTS: tuple = ()  # the empty parameters counting the quantized elements
    REFUSED: tuple = ()  # names that cannot be assigned: the full-precision weights the module stands for

    # ------------------------------------------------------------------ the two forms
    def _hold_storage(self) -> None:
        """Hold the storage format (derived from the GEMM layout on its device if need be) and no layout."""
        if self.is_gemm_resident:
            for name, t in self._derived_storage().items():
                setattr(self, name, t)
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
        try:
            dtype = self._check_state(state_dict, prefix)
        except (TypeError, ValueError) as e:
            error_msgs.append(str(e))
            return
        self._hold_storage()
        with counts_hidden(self, self.COUNTS):
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
        self.weight_dtype = dtype
        self._loaded(state_dict, prefix)
        self.prepare()

    def _loaded(self, state_dict: dict, prefix: str) -> None:
        """What a module keeps from a state dict besides its buffers (KbitLinear: its rotation block)."""

    def __setstate__(self, state):  # a copied parameter loses its attributes: the counts are made again
        super().__setstate__(state)
        self._hold_counts()

    def __setattr__(self, name: str, value) -> None:
        refuse_assignment(self, name, self.REFUSED)
        super().__setattr__(name, value)
