"""Sibling projections that read the same input -- q/k/v, gate/up -- run as one kbit GEMM launch.

    kbit.fuse_projections(model)                  # on by default: quantize_model, KbitConfig and loading do it
    kbit.fuse_projections(model, enabled=False)   # every projection its own launch again

At one token a projection's GEMM costs mostly its fixed per-call time (docs/PERFORMANCE.md), so the attention's q, k and
v projections, and the MLP's gate and up projections, are computed by one launch over their rows stacked. What makes
that exact: the siblings have the same bits, codebook (bit for bit), rotation (or none), weight dtype and
in_features, so each output row is the same products as in its own launch; each sibling keeps its own per-tensor
scale, which the fused launch applies per 256 output rows (``kbit::gemm`` with a scale per block of the layout, in
the epilogue where the per-tensor one goes: each sibling's rows are whole blocks). Siblings that differ in any of
these stay separate launches (a debug line on the ``"kbit"`` logger says why). The order in which a launch adds a
row's fp32 products depends on how it cuts its tiles over the GPU's SMs, which follows the launch's shape, so a
fused launch can round some outputs differently in the last bit than separate launches would, as a different split-K
would (docs/DESIGN.md#fused-projections). Where the planner would dequantize and call cuBLAS at the fused shape (long
prompts), every sibling runs its own GEMM as unfused.

Memory: no second copy. The group holds one GEMM layout of the siblings' rows stacked (each sibling padded to 256
rows, as its own layout is), and each sibling's ``gemm_codes`` / ``gemm_absmax`` buffers are views of its rows of it,
so ``state_dict``, ``save_pretrained``, ``.to("cpu")`` and ``dequantize`` of each sibling work on its own tensors
(per-projection keys, loadable by the same transformers classes). The stack is made, empty, on the device where the
first sibling becomes GEMM-resident; each sibling that gets its own layout there (moved, loaded: ``KbitLinear.prepare``)
is copied into its rows in place (keeping the addresses CUDA graphs captured) and its own layout freed, so at most one
layer's layout is held twice. Until every sibling is in, they run separately.

How one launch serves three calls inside transformers' unmodified forward (``q_proj(x)``, ``k_proj(x)``,
``v_proj(x)``): the first sibling called computes every sibling's output and the group holds them with that input;
a sibling called with the same tensor (identity) takes its output, and the last one clears the hold. This is plain
Python state, which ``torch.compile`` traces as data flow (no graph break; under CUDA graphs nothing is held between
steps). A sibling called with another input (or the same one written in place since), or twice, while outputs are
held means the parent does not feed its siblings one input (cross-attention, shared KV layers): the group turns
itself off (a debug line) and every sibling runs its own GEMM from then on; ``fuse_projections(model)`` groups
afresh. The outputs are column views of one
[tokens, rows] result (reshaped into heads with ``view``, as transformers does, without a copy).
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

from . import ops, planner
from ._validate import GEMM_DTYPES
from .formats import padded_in_features
from .layout import N_ALIGN, gemm_shapes, row_blocks

__all__ = ["fuse_projections", "FusedProjections", "SIBLING_NAMES", "FUSE_BY_DEFAULT"]

logger = logging.getLogger("kbit")

# The one default of the switch (quantize_model's and KbitConfig's fuse_projections).
FUSE_BY_DEFAULT = True

# Child names of one module that transformers' families call with the same input (Llama, Mistral, Qwen2/3, Gemma,
# the MoE models' attention and shared experts). Phi-3's qkv_proj and gate_up_proj are one projection already.
SIBLING_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def why_separate(members) -> Optional[str]:
    """Why these KbitLinear layers cannot share one launch exactly, or None when they can (values on the meta device
    are not compared: ``refresh`` checks again once they hold data)."""
    first = members[0]
    on_meta = first.codebook.device.type == "meta"
    for m in members[1:]:
        if m.bits != first.bits:
            return f"bits differ ({first.bits} and {m.bits})"
        if m.in_features != first.in_features:
            return f"in_features differ ({first.in_features} and {m.in_features})"
        if m.weight_dtype != first.weight_dtype:
            return f"weight dtypes differ ({first.weight_dtype} and {m.weight_dtype})"
        if m.codebook.device != first.codebook.device:
            return f"devices differ ({first.codebook.device} and {m.codebook.device})"
        if not on_meta and not torch.equal(m.codebook, first.codebook):
            return "codebooks differ"
        rotated = m.rotation_signs is not None
        if rotated != (first.rotation_signs is not None) or m._block != first._block or (
                rotated and not on_meta and not torch.equal(m.rotation_signs, first.rotation_signs)):
            return "input rotations differ"
    return None


class _Stacked(NamedTuple):
    """The siblings' GEMM layouts stacked along the 256-row blocks, and what the fused launch reads beside them."""

    codes: Tensor  # int32 [sum of blocks, KG, 16, k, 32, 4]
    absmax: Tensor  # uint8 [sum of blocks, KG, 16, 2, 8, 8]
    views: tuple  # ((codes, absmax) of each sibling): its rows, the tensors it holds as its buffers
    block_scale: Tensor  # float32 [row blocks]: the per-tensor scale of each 256-row block's sibling
    offsets: tuple  # the first output row of each sibling
    rows: int  # output rows of the fused launch: the last sibling's offset plus its out_features
    splits: tuple  # the output's columns cut as (sibling, gap to the next, sibling, ...): the siblings at even places
    in_features_padded: int  # the launch's K


class FusedProjections:
    """KbitLinear siblings that read the same input, computed by one GEMM launch (module docstring).

    Made by ``fuse_projections``; each member refers to it (``KbitLinear._fusion``) and keeps its own buffers, which
    are views of the stacked layout while the group is built (``refresh``).
    """

    def __init__(self, members, names):
        self.members = tuple(members)
        self.names = tuple(names)
        self.enabled = True  # off after a call pattern that is not one shared input (module docstring)
        self._stacked: Optional[_Stacked] = None
        self._current = False  # the stack is built and every member holds its rows as its layout buffers (refresh)
        self._held = None  # (input, its version, outputs, which members have yet to take theirs)

    def __repr__(self) -> str:
        state = "built" if self._stacked is not None else "not built"
        return f"FusedProjections({', '.join(self.names)}; {state}{'' if self.enabled else ', off'})"

    @property
    def launching(self) -> bool:
        """Whether the members run as one GEMM launch: switched on, their stacked layout built (on CUDA) and every
        member holding its rows of it."""
        return self.enabled and self._current

    def __getstate__(self):  # outputs held mid-forward belong to that forward
        return {**self.__dict__, "_held": None}

    # ------------------------------------------------------------------ the stacked layout
    def refresh(self) -> None:
        """Bring the stacked layout up to date with the members; called by each member's ``prepare``.

        The stack lives on the device of the GEMM-resident members (made there, empty, once the first of them lands,
        so that each member moves its own layout in as it comes and frees it: at most one layer's layout is held
        twice). A member holding its own layout there is copied into its rows, in place (addresses kept for CUDA
        graphs), and holds views of them from then on. The stack is dropped once no member is resident on its
        device. Members that turn out unable to share a launch once all hold data on one device (a kbit folder's
        layers are grouped on meta, before their values are known) leave the group, with their own copies."""
        members = self.members
        devices = {m.codebook.device for m in members}
        if len(devices) == 1 and next(iter(devices)).type != "meta":
            reason = why_separate(members)
            if reason is not None:
                self._dissolve(reason)
                return
        resident = [m for m in members if m.is_gemm_resident]
        stacked = self._stacked
        if stacked is not None and not any(m.gemm_codes.device == stacked.codes.device for m in resident):
            stacked = None  # every member has left its device (or holds its storage format there)
        if not resident:
            self._stacked = None
            self._current = False
            return
        device = stacked.codes.device if stacked is not None else resident[0].gemm_codes.device
        if stacked is None:
            stacked = self._empty_stack(device)
        for m, (codes, absmax), offset in zip(members, stacked.views, stacked.offsets):
            if not m.is_gemm_resident or m.gemm_codes.device != device:
                continue
            if m.gemm_codes is not codes or m.gemm_absmax is not absmax:
                codes.copy_(m.gemm_codes)
                absmax.copy_(m.gemm_absmax)
                m.gemm_codes, m.gemm_absmax = codes, absmax
                m._invalidate()
            first = offset // N_ALIGN  # its scale may have been loaded: in place too
            stacked.block_scale[first:first + codes.shape[0]].copy_(m.scale.reshape(1).expand(codes.shape[0]))
        self._stacked = stacked
        self._current = all(m._held("gemm_codes") is codes and m._held("gemm_absmax") is absmax
                            for m, (codes, absmax) in zip(members, stacked.views))
        if device.type == "cuda":  # read in place by CUDA graphs, as each member's own buffers (KbitLinear.prepare)
            for t in (stacked.codes, stacked.absmax, stacked.block_scale, *(t for v in stacked.views for t in v)):
                torch._dynamo.mark_static_address(t, guard=False)

    def _dissolve(self, reason: str) -> None:
        logger.debug("kbit: %s stay separate GEMM launches: %s", ", ".join(self.names), reason)
        stacked = self._stacked
        for slot, m in enumerate(self.members):
            if stacked is not None and m.gemm_codes is stacked.views[slot][0]:
                m.gemm_codes, m.gemm_absmax = m.gemm_codes.clone(), m.gemm_absmax.clone()
                m._invalidate()
            m._fusion, m._fusion_slot = None, 0
        self._stacked = None
        self._current = False

    def member_assigned(self) -> None:
        """A member's layout buffer was assigned: the members run alone until ``refresh`` finds every member holding
        its rows of the stack again (a member's ``prepare``)."""
        self._current = False

    def _empty_stack(self, device) -> _Stacked:
        members = self.members
        shapes = [gemm_shapes(m.bits, m.out_features, padded_in_features(m.in_features)) for m in members]
        blocks = sum(b[0] for b, _ in shapes)
        codes = torch.empty((blocks, *shapes[0][0][1:]), dtype=torch.int32, device=device)
        absmax = torch.empty((blocks, *shapes[0][1][1:]), dtype=torch.uint8, device=device)
        views, offsets, block = [], [], 0
        for (b_shape, _), m in zip(shapes, members):
            views.append((codes[block:block + b_shape[0]], absmax[block:block + b_shape[0]]))
            offsets.append(block * N_ALIGN)
            block += b_shape[0]
        rows = offsets[-1] + members[-1].out_features
        block_scale = torch.empty(blocks, dtype=torch.float32, device=device)
        splits = []
        for m, offset, end in zip(members, offsets, offsets[1:] + [rows]):
            splits += [m.out_features, end - offset - m.out_features]
        return _Stacked(codes, absmax, tuple(views), block_scale, tuple(offsets), rows, tuple(splits[:-1]),
                        padded_in_features(members[0].in_features))

    # ------------------------------------------------------------------ forward
    def output(self, member: nn.Module, slot: int, x: Tensor) -> Optional[Tensor]:
        """``member(x)`` from the fused launch (computed now, or held since a sibling's call with this ``x``), or None
        when ``member`` computes it alone."""
        held = self._held
        if held is not None:
            if held[0] is x and held[1] == _version(x) and held[3][slot]:
                waiting = tuple(w and i != slot for i, w in enumerate(held[3]))
                self._held = (*held[:3], waiting) if any(waiting) else None
                return held[2][slot]
            self.enabled = False
            self._held = None
            logger.debug("kbit: %s are not called with one input here; they run as separate GEMM launches",
                         ", ".join(self.names))
            return None
        if not self.launching:
            return None
        outputs = self._compute(x)
        if outputs is None:
            return None
        self._held = (x, _version(x), outputs, tuple(i != slot for i in range(len(outputs))))
        return outputs[slot]

    def _compute(self, x: Tensor) -> Optional[tuple]:
        """Every member's output for ``x`` from one launch, or None where the members run alone: another device or
        dtype, or a plan of dequantize + cuBLAS. Reads no member's own layout buffers (``launching`` knows that each
        holds its rows of the stack): under torch.compile every object the trace reads is guarded at every call of
        the graph, and the stack alone is what the launch reads."""
        # Buffers are read from the modules' dicts (KbitModule._held): an eager decode pays this per call, and
        # nn.Module's attribute lookup costs about a microsecond a name.
        stacked, members = self._stacked, self.members
        first = members[0]
        if (x.dtype not in GEMM_DTYPES or x.device != stacked.codes.device or x.dim() < 1
                or x.shape[-1] != first.in_features):
            return None
        if first._held("rotation_signs") is not None:
            x = first.rotation.rotate(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, first.in_features)
        K = stacked.in_features_padded
        if x.device.type == "cuda" and planner.dequantizes_first(x.device, stacked.rows, K, x2.shape[0], first.bits):
            return None
        y = ops.gemm_direct(x2, stacked.codes, stacked.absmax, first._held("codebook"), stacked.block_scale,
                            self._bias(x.dtype), first.bits, stacked.rows, K, 0)
        return y.view(*lead, stacked.rows).split_with_sizes(stacked.splits, dim=-1)[::2]

    def _bias(self, dtype: torch.dtype) -> Optional[Tensor]:
        """The members' biases stacked as their rows are (zeros for padding and for a member without one), made at
        each call so that it follows the parameters (trained, loaded); None when no member has one."""
        if all(m._parameters.get("bias") is None for m in self.members):
            return None
        parts, stacked = [], self._stacked
        for m, offset in zip(self.members, stacked.offsets):
            rows = min(row_blocks(m.out_features) * N_ALIGN, stacked.rows - offset)
            if m.bias is None:
                parts.append(torch.zeros(rows, dtype=dtype, device=stacked.codes.device))
            else:
                parts.append(nn.functional.pad(m.bias.to(dtype), (0, rows - m.out_features)))
        return torch.cat(parts)


def _version(x: Tensor) -> Optional[int]:
    """x's version counter in eager mode (an in-place write to x between two siblings' calls is a new input), None
    while torch.compile traces (functionalized: no in-place writes to see) and for inference tensors (no counter)."""
    if torch.compiler.is_compiling():
        return None
    try:
        return x._version
    except RuntimeError:
        return None


def groups_of(model: nn.Module, kbit_linear: type):
    """(members, qualified names) of each set of sibling KbitLinear children (``SIBLING_NAMES``), two or more."""
    seen = set()
    for parent_name, parent in model.named_modules():
        for names in SIBLING_NAMES:
            found = [(name, getattr(parent, name, None)) for name in names]
            found = [(name, m) for name, m in found if isinstance(m, kbit_linear)]
            if len(found) < 2 or len({id(m) for _, m in found}) < len(found) or any(id(m) in seen for _, m in found):
                continue
            seen.update(id(m) for _, m in found)
            prefix = parent_name + "." if parent_name else ""
            yield [m for _, m in found], [prefix + name for name, _ in found]
