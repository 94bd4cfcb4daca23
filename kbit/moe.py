"""``KbitExperts``: the routed experts of a mixture-of-experts layer in kbit storage.

transformers (5.x) keeps a MoE layer's routed experts in one module with two 3-D parameters,
``gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and ``down_proj`` [E, H, I], called as
``experts(hidden_states [T, H], top_k_index [T, top_k], top_k_weights [T, top_k]) -> [T, H]``: token t
goes through experts ``top_k_index[t]`` and the results are summed with weights ``top_k_weights[t]``
(Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3, GLM-4-MoE and the other families whose experts class is
decorated with ``use_experts_implementation``). ``kbit.quantize_model`` replaces such a module with a
``KbitExperts`` holding the same experts quantized, with the same call signature and meaning. Older
transformers versions keep one ``nn.Linear`` per expert projection; ``quantize_model`` swaps those like
any other Linear.

Storage (persistent buffers, what ``state_dict`` holds; H_pad = H rounded up to 32, I_pad likewise; the module's
only parameters, ``gate_up_proj_count`` and ``down_proj_count``, hold nothing: they make parameter counts see the
experts' weights, ``kbit._counted``):

    gate_up_packed  int32   [E, 2I * H_pad / 32 * bits] row e: the ``packed`` of expert e's [2I, H] weight
    gate_up_absmax  uint8   [E, 2I * H_pad / 32]       row e: its ``absmax``
    gate_up_scale   float32 [E]                        its per-tensor power-of-two ``scale``
    down_packed     int32   [E, H * I_pad / 32 * bits]  the same for expert e's [H, I] down weight
    down_absmax     uint8   [E, H * I_pad / 32]
    down_scale      float32 [E]
    codebook        float32 [2**bits]                  shared by every expert of the layer
    meta            int64   [5]                        kbit.formats.EXPERTS_META_FIELDS: [bits, E, H, I, dtype code]

Row e of each projection is exactly what ``kbit.quantize`` makes of that expert's weight alone
(``QuantizedWeight.state_dict``): each projection is a ``QuantizedWeight`` of shape [E, N, K] over these buffers
(``projection``), and ``expert_weight(proj, e)`` is its expert e.

On a CUDA device where the grouped GEMM runs, the module holds each projection's GEMM layout (``kbit.layout``), one
per expert, stacked (``gate_up_gemm_codes`` [E, *B_gemm shape], ``gate_up_gemm_absmax`` [E, *absmax_gemm shape], the
same for ``down``), in place of the ``*_packed`` and ``*_absmax`` buffers (then None): one copy of the codes,
derived when the module lands there (``prepare``; the storage format is dropped), and the storage format derived
back from it whenever asked for (``state_dict``, ``.to("cpu")``, ``dequantize``, ``expert_weight``), bit for bit.
The layout buffers are registered persistent (loaders that re-create non-persistent buffers empty leave them alone)
but never saved. The gate/up layout is that of the weight with its rows interleaved by 8 (the projection's
``row_order``, ``kbit.grouped.gate_up_row_order``): each 16-row MMA tile then holds 8 gate rows and their 8 up rows,
so the grouped GEMM applies ``silu(gate) * up`` in its epilogue. The forward there runs ``kbit.ops.moe_route`` (the
tokens sorted by expert on the GPU), two grouped GEMMs (every expert's tokens in one launch each; the routing
weights applied in the second's epilogue) and ``moe_combine``: no host synchronization, CUDA-graph and
``torch.compile`` safe (``kbit.grouped`` documents the ops). Elsewhere (CPU, float32 activations, shapes the kernel
does not take: H or I not a multiple of 8, more than ``MAX_GROUPED_EXPERTS`` experts, or a GPU whose shared memory
holds none of its configurations at this K) the forward is the per-expert reference: each routed expert's weights
dequantized to float32. Inference only: no gradients flow through the grouped ops.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from . import ops, planner
from ._build import cuda_ext
from ._counted import count_name, hold_count
from ._kbit_module import KbitModule
from ._validate import (
    GEMM_DTYPES,
    check_bits,
    check_codebook,
    check_dtype,
    check_experts_meta,
    check_int,
    check_not_meta,
    check_range,
    check_tensor,
    check_weight,
)
from .formats import create_normal_float_codebook, experts_meta_tensor, padded_in_features, storage_spec
from .grouped import GATE_UP_GROUP, gate_up_row_order
from .layout import X_ALIGN
from .weight import PrecisionLoss, QuantizedWeight, quantize_checked

__all__ = ["KbitExperts", "find_experts", "MAX_GROUPED_EXPERTS"]

PROJECTIONS = ("gate_up", "down")
FUSED_PARAMETERS = tuple(f"{proj}_proj" for proj in PROJECTIONS)  # transformers' names of the experts' weights
WEIGHT_COUNTS = tuple(count_name(name) for name in FUSED_PARAMETERS)  # empty parameters counting them (kbit._counted)
_FORMAT_SUFFIXES = ("packed", "absmax", "scale")
STORAGE = tuple(f"{p}_{s}" for p in PROJECTIONS for s in _FORMAT_SUFFIXES) + ("codebook", "meta")  # the state dict
# Experts per layer the routing kernel sorts in one CTA's shared memory: moe.h's kMaxGroupedExperts (test_constants).
MAX_GROUPED_EXPERTS = 1024
REFERENCE_ROWS_PER_PASS = 32  # off CUDA (the reference operators, tracing tests): any rows per pass is exact


def _is_silu(act: nn.Module) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


class KbitExperts(KbitModule):
    """The routed experts of a MoE layer, k-bit quantized (module docstring: layout and forward).

    Args:
        num_experts, hidden_dim, intermediate_dim: E, H and I.
        bits: bits per weight, 2..5.
        dtype: dtype of the original weights (``meta``; what ``dequantize`` returns by default).
        device: where the buffers live.
        codebook: optional custom codebook (2**bits sorted values in [-1, 1]); default normal-float.
        act_fn: the gate activation (transformers' ``ACT2FN[config.hidden_act]``); default SiLU.

    A module built this way holds all-zero experts: fill it with ``load_state_dict`` or build it with
    ``from_experts``.
    """

    # KbitModule's names: the storage format (its codes derived from the GEMM layouts when GEMM-resident), the
    # buffers of each projection, the counting parameters, transformers' weights that are held quantized.
    FORMAT_KEYS, COUNTS, REFUSED = STORAGE, WEIGHT_COUNTS, FUSED_PARAMETERS
    WEIGHTS = {p: (f"{p}_packed", f"{p}_absmax", f"{p}_scale", f"{p}_gemm_codes", f"{p}_gemm_absmax")
               for p in PROJECTIONS}

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, bits: int = 4,
                 dtype: torch.dtype = torch.float16, device=None, codebook: Optional[Tensor] = None,
                 act_fn: Optional[nn.Module] = None):
        bits = check_bits(bits)
        self._build(check_int(num_experts, "num_experts", 1), check_int(hidden_dim, "hidden_dim", 1),
                    check_int(intermediate_dim, "intermediate_dim", 1), bits, check_dtype(dtype, "dtype"), device,
                    None if codebook is None else check_codebook(codebook, bits), act_fn)

    @classmethod
    def from_checked(cls, num_experts: int, hidden_dim: int, intermediate_dim: int, bits: int, dtype: torch.dtype,
                     device=None, codebook: Optional[Tensor] = None, act_fn: Optional[nn.Module] = None):
        """The constructor without its checks, for arguments checked already (``kbit.quantize_model``'s)."""
        mod = cls.__new__(cls)
        mod._build(num_experts, hidden_dim, intermediate_dim, bits, dtype, device, codebook, act_fn)
        return mod

    def _build(self, num_experts, hidden_dim, intermediate_dim, bits, dtype, device, codebook, act_fn) -> None:
        super().__init__()
        self.bits = bits
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        self.weight_dtype = dtype
        self.act_fn = act_fn if act_fn is not None else nn.SiLU()
        self._invalidate()
        for proj, (N, K) in self.shapes().items():
            for key, fill in (("packed", torch.zeros), ("absmax", torch.zeros), ("scale", torch.ones)):
                dtype_of, shape_of = storage_spec(key, bits, (num_experts, N, K))
                self.register_buffer(f"{proj}_{key}", fill(shape_of, dtype=dtype_of, device=device))
        cb = create_normal_float_codebook(bits) if codebook is None else codebook
        self.register_buffer("codebook", cb.to(device=device, dtype=torch.float32))
        self.register_buffer("meta", self._meta_tensor(device))
        for name in self.LAYOUT_KEYS:  # on CUDA, in place of the *_packed and *_absmax buffers (prepare)
            self.register_buffer(name, None)
        self._rows_supported = ()  # rows per pass the device's grouped GEMM runs at these bits (prepare)
        self._hold_counts()

    # ------------------------------------------------------------------ shapes and views
    def shapes(self) -> dict:
        """{projection: (out_features, in_features)} of one expert."""
        H, I = self.hidden_dim, self.intermediate_dim
        return {"gate_up": (2 * I, H), "down": (H, I)}

    def _meta_tensor(self, device=None) -> Tensor:
        return experts_meta_tensor(self.bits, self.num_experts, self.hidden_dim, self.intermediate_dim,
                                   self.weight_dtype, device)

    def _hold_counts(self) -> None:
        for proj, (N, K) in self.shapes().items():
            hold_count(self, count_name(f"{proj}_proj"), self.num_experts * N * K, self.weight_dtype,
                       self.codebook.device)

    def _check_projection(self, proj: str) -> str:
        if proj not in PROJECTIONS:
            raise ValueError(f"proj must be one of {PROJECTIONS}, got {proj!r}")
        return proj

    @property
    def is_gemm_resident(self) -> bool:
        """Whether the module holds the GEMM layouts in place of the storage format (module docstring)."""
        return self._held("gate_up_packed") is None

    def _weight_shape(self, proj: str) -> tuple:
        """([E, N, K], row order of the GEMM layout) of projection ``proj`` (``KbitModule._view``): gate/up's rows
        interleaved by 8 for the grouped GEMM's fused activation, which runs only where I is a multiple of 8."""
        N, K = self.shapes()[proj]
        interleaved = proj == "gate_up" and self.intermediate_dim % GATE_UP_GROUP == 0
        return (self.num_experts, N, K), gate_up_row_order(self.intermediate_dim, "cpu") if interleaved else None

    def projection(self, proj: str) -> QuantizedWeight:
        """The ``"gate_up"`` ([E, 2I, H]) or ``"down"`` ([E, H, I]) weights of every expert: a ``QuantizedWeight``
        view of the module's buffers, GEMM-resident when the module is (its layout's rows in the grouped GEMM's
        order, ``row_order``)."""
        return self._view(self._check_projection(proj))

    def expert_weight(self, proj: str, expert: int) -> QuantizedWeight:
        """A ``QuantizedWeight`` of expert ``expert``'s ``"gate_up"`` ([2I, H]) or ``"down"`` ([H, I]) weight in the
        storage format: a view of the module's, or derived from its GEMM layout (``projection(proj)[expert]``)."""
        return self.projection(proj)[expert]

    def storage(self, proj: str) -> tuple:
        """(packed [E, ...], absmax [E, ...]) of ``proj``: held, or derived from the GEMM layouts now (new tensors)."""
        return self.projection(proj).storage()

    def dequantize(self, proj: str, dtype=None) -> Tensor:
        """Every expert's reconstructed weight, [E, 2I, H] (``"gate_up"``) or [E, H, I] (``"down"``)."""
        return self.projection(proj).dequantize(dtype)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_weights(cls, gate_up: Tensor, down: Tensor, bits: int = 4, codebook: Optional[Tensor] = None,
                     act_fn: Optional[nn.Module] = None, name: str = "experts"):
        """Quantize gate_up [E, 2I, H] and down [E, H, I] expert by expert: (KbitExperts, [(label, PrecisionLoss)])."""
        bits = check_bits(bits)
        codebook = None if codebook is None else check_codebook(codebook, bits)
        return cls.from_weights_checked(gate_up, down, bits, codebook, act_fn, name)

    @classmethod
    def from_weights_checked(cls, gate_up: Tensor, down: Tensor, bits: int, codebook: Optional[Tensor],
                             act_fn: Optional[nn.Module], name: str):
        """``from_weights`` for ``bits`` and ``codebook`` checked already."""
        check_tensor(gate_up, f"{name}.gate_up_proj")
        check_tensor(down, f"{name}.down_proj")
        if gate_up.dim() != 3 or gate_up.shape[1] % 2:
            raise ValueError(f"{name}.gate_up_proj must be [E, 2I, H], got {tuple(gate_up.shape)}")
        E, I2, H = gate_up.shape
        if tuple(down.shape) != (E, H, I2 // 2):
            raise ValueError(f"{name}.down_proj must be [{E}, {H}, {I2 // 2}] next to gate_up_proj "
                             f"{tuple(gate_up.shape)}, got {tuple(down.shape)}")
        mod = cls.from_checked(E, H, I2 // 2, bits, check_dtype(gate_up.dtype, f"{name}.gate_up_proj"),
                               gate_up.device, codebook, act_fn)
        losses = mod.quantize_projection("gate_up", gate_up, name) + mod.quantize_projection("down", down, name)
        return mod.prepare(), losses

    @classmethod
    def like(cls, experts: nn.Module, bits: int = 4, dtype: torch.dtype = torch.float16, device=None,
             codebook: Optional[Tensor] = None) -> "KbitExperts":
        """All-zero experts of a fused experts module's shape and activation, to fill by ``quantize_projection``
        or ``load_state_dict`` (what loading through transformers does)."""
        E, H, I = experts_shape(experts)
        return cls(E, H, I, bits=bits, dtype=dtype, device=device, codebook=codebook, act_fn=experts.act_fn)

    def quantize_projection(self, proj: str, weight: Tensor, name: str = "experts") -> list:
        """Quantize every expert's ``proj`` weight (``"gate_up"``: [E, 2I, H], ``"down"``: [E, H, I]) into this
        module's storage, expert by expert: [(label, PrecisionLoss)]. Call ``prepare`` once both projections are in."""
        want = (self.num_experts, *self.shapes()[self._check_projection(proj)])
        check_tensor(weight, f"{name}.{proj}_proj")
        check_not_meta(weight, f"{name}.{proj}_proj")
        if tuple(weight.shape) != want:
            raise ValueError(f"{name}.{proj}_proj must be {list(want)}, got {list(weight.shape)}")
        self._hold_storage()
        packed, absmax, scale = (getattr(self, f"{proj}_{s}") for s in _FORMAT_SUFFIXES)
        losses = []
        with torch.no_grad():
            for e in range(self.num_experts):
                label = f"{name}.{proj}_proj[{e}]"
                qw, loss = quantize_checked(check_weight(weight[e].detach(), label), self.bits, self.codebook)
                (packed[e], absmax[e]), scale[e] = qw.storage(), qw.scale
                losses.append((label, loss))
        self._invalidate()  # written in place: a layout a view derived before is stale
        return losses

    @classmethod
    def from_experts(cls, experts: nn.Module, bits: int = 4, codebook: Optional[Tensor] = None,
                     name: str = "experts"):
        """Quantize a transformers fused experts module (``find_experts`` says which are supported)."""
        bits = check_bits(bits)
        return cls.from_experts_checked(experts, bits, None if codebook is None else check_codebook(codebook, bits),
                                        name)

    @classmethod
    def from_experts_checked(cls, experts: nn.Module, bits: int, codebook: Optional[Tensor], name: str = "experts"):
        """``from_experts`` for ``bits`` and ``codebook`` checked already (``kbit.quantize_model``'s)."""
        why = unsupported_reason(experts)
        if why:
            raise ValueError(f"{name}: {why}")
        gate_up, down = (canonical_weight(experts, w) for w in (experts.gate_up_proj, experts.down_proj))
        return cls.from_weights_checked(gate_up, down, bits, codebook, experts.act_fn, name)

    # ------------------------------------------------------------------ GEMM layouts
    def grouped_supported(self) -> bool:
        """Whether the grouped CUDA GEMM takes this layer's shapes (else the forward is the per-expert reference)."""
        return (self.hidden_dim % X_ALIGN == 0 and self.intermediate_dim % X_ALIGN == 0
                and self.num_experts <= MAX_GROUPED_EXPERTS)

    def derive_gemm_layouts(self) -> None:
        """Set the ``*_gemm_codes`` / ``*_gemm_absmax`` buffers from the held storage format, on its device, keeping
        the storage (``prepare`` does this on CUDA, then drops the storage; on CPU the reference ops read them too)."""
        self._derive_layout()

    def prepare(self) -> "KbitExperts":
        """On a CUDA device where the grouped GEMM runs: hold the GEMM layouts (derived from the storage format,
        which is then dropped), as buffers marked static for ``torch.compile``. Elsewhere: hold the storage format
        alone. Returns self.

        Called when the module moves to CUDA or loads a state dict there, and by ``from_weights``; call it yourself
        (or ``kbit.prepare(model)``) after ``quantize_projection`` or replacing a buffer by hand.
        """
        device = self.codebook.device
        self._hold_counts()
        if device.type == "meta":
            return self
        if device.type == "cuda" and self.grouped_supported():
            with torch.cuda.device(device):
                self._rows_supported = tuple(cuda_ext().moe_rows_per_pass_supported(self.bits))
        if device.type != "cuda" or not self.grouped_supported() or not self._rows_supported:
            self._hold_storage()
            return self
        self._hold_layout()
        return self

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """``sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden_states[t])`` for each token t.

        An expert computes ``down(act(gate(x)) * up(x))``. Expert ids outside [0, E) contribute nothing.
        """
        x, idx, w = hidden_states, top_k_index, top_k_weights
        check_tensor(x, "hidden_states")
        check_tensor(idx, "top_k_index")
        check_tensor(w, "top_k_weights")
        if x.dim() != 2 or x.shape[1] != self.hidden_dim:
            raise ValueError(f"hidden_states must be [tokens, {self.hidden_dim}], got {tuple(x.shape)}")
        if idx.dim() != 2 or idx.shape[0] != x.shape[0] or tuple(w.shape) != tuple(idx.shape):
            raise ValueError(f"top_k_index and top_k_weights must both be [{x.shape[0]}, top_k], got "
                             f"{tuple(idx.shape)} and {tuple(w.shape)}")
        if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
            raise TypeError(f"top_k_index must be an integer tensor, got {idx.dtype}")
        if not w.is_floating_point():
            raise TypeError(f"top_k_weights must be a floating-point tensor, got {w.dtype}")
        if not (x.device == idx.device == w.device == self.codebook.device):
            raise ValueError(f"hidden_states ({x.device}), top_k_index ({idx.device}), top_k_weights ({w.device}) "
                             f"and the experts ({self.codebook.device}) must be on one device")
        if x.is_cuda and x.dtype in GEMM_DTYPES and self.gate_up_gemm_codes is not None:
            return self._forward_grouped(x, idx, w)
        return self._forward_reference(x, idx, w)

    def _activate(self, gate_up: Tensor) -> Tensor:
        """act(gate) * up from the [rows, 2I] product (gate columns first)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def _forward_reference(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        """Per routed expert: its products from the storage format as ``kbit.matmul`` makes them off CUDA (the CPU
        kernel, or the weights dequantized to float32), rounded to x's dtype; the weighted sum in float32.
        Synchronizes with the device (it lists the routed experts)."""
        top_k = idx.shape[1]
        out = torch.zeros(x.shape[0], self.hidden_dim, dtype=torch.float32, device=x.device)
        flat, weights = idx.reshape(-1), w.reshape(-1).to(torch.float32)
        routed = flat[(flat >= 0) & (flat < self.num_experts)]
        for e in torch.unique(routed).tolist():
            slots = (flat == e).nonzero().flatten()
            tokens = slots // top_k
            h = self._activate(self.expert_weight("gate_up", e)._matmul_stored(x[tokens]))
            y = self.expert_weight("down", e)._matmul_stored(h)
            out.index_add_(0, tokens, y.to(torch.float32) * weights[slots, None])
        return out.to(x.dtype)

    def rows_per_pass(self, slots: int) -> int:
        """Token rows per pass of the grouped GEMM for ``slots`` (token, expert) pairs, as the planner chooses them
        (``kbit.planner.rows_per_pass``) among those the device runs at these bits."""
        if self.codebook.device.type != "cuda" or not self._rows_supported:
            return REFERENCE_ROWS_PER_PASS
        shapes = ((2 * self.intermediate_dim, self.hidden_dim), (self.hidden_dim, self.intermediate_dim))
        return planner.moe_rows_per_pass(self.codebook.device, slots, self.num_experts, shapes, self.bits,
                                         self._rows_supported)

    def _forward_grouped(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        """Route on the device, then every expert's tokens in one grouped GEMM per projection (kbit.grouped)."""
        T, top_k = idx.shape
        E, H, I = self.num_experts, self.hidden_dim, self.intermediate_dim
        rows = self.rows_per_pass(T * top_k)
        routed = ops.moe_route_direct(idx.contiguous(), w.contiguous(), E, rows)
        x_rows, row_weights, position, passes, num_passes = routed
        fused = _is_silu(self.act_fn)
        h = ops.moe_gemm_direct(x.contiguous(), self.gate_up_gemm_codes, self.gate_up_gemm_absmax, self.codebook,
                                self.gate_up_scale, x_rows, None, passes, num_passes, self.bits, 2 * I,
                                padded_in_features(H), rows, fused, 0)
        if not fused:  # the product's columns come interleaved by 8 (gate_up_row_order): gate, up, gate, ...
            pairs = h.view(h.shape[0], I // 8, 2, 8)
            h = (self.act_fn(pairs[:, :, 0]) * pairs[:, :, 1]).reshape(h.shape[0], I)
        y = ops.moe_gemm_direct(h, self.down_gemm_codes, self.down_gemm_absmax, self.codebook, self.down_scale, None,
                                row_weights, passes, num_passes, self.bits, H, padded_in_features(I), rows, False, 0)
        return ops.moe_combine_direct(y, position)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, bits={self.bits}, "
                f"dtype={str(self.weight_dtype).replace('torch.', '')}")

    # ------------------------------------------------------------------ moving, saving, loading (KbitModule)
    def _moved(self) -> None:
        self.prepare()

    def _check_state(self, state_dict, prefix: str) -> torch.dtype:
        self._hold_storage()  # the checks compare against the storage buffers, which a GEMM-resident module lacks
        meta = state_dict.get(prefix + "meta")
        dtype = self.weight_dtype
        if isinstance(meta, Tensor) and meta.device.type != "meta":
            dtype = self._check_meta(meta, prefix + "meta")
        self._check_incoming(state_dict, prefix, dtype)
        return dtype

    def _check_meta(self, meta, name: str) -> torch.dtype:
        bits, E, H, I, dtype = check_experts_meta(meta, name)
        if (bits, E, H, I) != (self.bits, self.num_experts, self.hidden_dim, self.intermediate_dim):
            raise ValueError(
                f"{name} describes bits={bits} experts E={E}, H={H}, I={I}, but this KbitExperts is bits={self.bits}, "
                f"E={self.num_experts}, H={self.hidden_dim}, I={self.intermediate_dim}; build it with the checkpoint's"
            )
        return dtype

    def _check_incoming(self, state_dict, prefix: str, dtype: torch.dtype) -> None:
        """Dtype, shape, contiguity and values of each storage tensor a state dict brings (missing ones are kept),
        and each expert's range against the weights' ``dtype``."""
        for name in ["codebook"] + [f"{p}_scale" for p in PROJECTIONS]:  # float32 by definition; 16-bit copies load
            t = state_dict.get(prefix + name)
            if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float32:
                state_dict[prefix + name] = t.to(torch.float32)
        for name, want in self._buffers.items():
            if name not in STORAGE or name == "meta" or prefix + name not in state_dict:
                continue
            t = check_tensor(state_dict[prefix + name], prefix + name)
            if t.dtype != want.dtype or t.shape != want.shape:
                raise ValueError(f"{prefix}{name} must be {want.dtype} of shape {tuple(want.shape)}, got {t.dtype} "
                                 f"{tuple(t.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"{prefix}{name} must be contiguous")
            if t.device.type == "meta":
                continue
            if name == "codebook":
                check_codebook(t, self.bits, prefix + name)
            elif name.endswith("_scale"):
                mantissa, _ = torch.frexp(t)
                if not bool((torch.isfinite(t) & (t > 0) & (mantissa == 0.5)).all()):
                    raise ValueError(f"{prefix}{name} must hold positive finite powers of two")
        codebook = state_dict.get(prefix + "codebook", self.codebook)
        for proj in PROJECTIONS:
            absmax, scale = (state_dict.get(f"{prefix}{proj}_{s}", self._buffers[f"{proj}_{s}"])
                             for s in ("absmax", "scale"))
            if all(t.device.type != "meta" for t in (absmax, scale, codebook)):
                check_range(absmax, scale, codebook, dtype, f"{prefix}{proj}_absmax with {prefix}{proj}_scale")


GEMM_LAYOUTS = KbitExperts.LAYOUT_KEYS  # on CUDA (module docstring)


# ---------------------------------------------------------------------- finding experts in a model
def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` keeps experts as 3-D ``gate_up_proj`` / ``down_proj`` parameters (transformers 5.x)."""
    params = [module._parameters.get(name) for name in FUSED_PARAMETERS]
    return all(isinstance(p, Tensor) and p.dim() == 3 for p in params)


def unsupported_reason(module: nn.Module) -> Optional[str]:
    """None if ``KbitExperts`` computes what this fused experts module computes, else why not."""
    if not is_fused_experts(module):
        return f"{type(module).__name__} holds no 3-D gate_up_proj and down_proj parameters"
    flags = {"has_bias": False, "has_gate": True, "is_concatenated": True, "has_post_expert_norm": False}
    odd = [f"{flag}={getattr(module, flag)}" for flag, want in flags.items() if getattr(module, flag, want) != want]
    if odd:
        return f"{type(module).__name__} has {', '.join(odd)}: kbit's experts are gated, concatenated, bias-free"
    if not isinstance(getattr(module, "act_fn", None), nn.Module):
        return f"{type(module).__name__} has no act_fn module"
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate":
        return f"{type(module).__name__} has its own gating (_apply_gate)"
    E, a, b = module.gate_up_proj.shape
    gate_up_rows, hidden = (b, a) if getattr(module, "is_transposed", False) else (a, b)
    down = tuple(module.down_proj.shape)
    want = (E, gate_up_rows // 2, hidden) if getattr(module, "is_transposed", False) else (E, hidden, gate_up_rows // 2)
    if gate_up_rows % 2 or down != want:
        return f"{type(module).__name__} has gate_up_proj {tuple(module.gate_up_proj.shape)} and down_proj {down}"
    return None


def find_experts(model: nn.Module) -> list:
    """[(name, module)] of every fused experts module in ``model`` (supported or not; one entry per name when a
    module is shared), in module order."""
    return [(name, m) for name, m in model.named_modules(remove_duplicate=False) if is_fused_experts(m)]


def canonical_weight(module: nn.Module, weight: Tensor) -> Tensor:
    """A fused experts module's ``gate_up_proj`` or ``down_proj`` (or a tensor loaded for it) as [E, out, in]:
    modules with ``is_transposed`` store [E, in, out]."""
    return weight.transpose(1, 2) if getattr(module, "is_transposed", False) else weight


def experts_shape(module: nn.Module) -> tuple:
    """(E, H, I) of a supported fused experts module."""
    E, a, b = module.gate_up_proj.shape
    return (E, a, b // 2) if getattr(module, "is_transposed", False) else (E, b, a // 2)


def precision_losses(losses) -> list:
    """The (label, PrecisionLoss) entries that lost precision (what quantize_model warns about)."""
    return [(label, loss) for label, loss in losses if isinstance(loss, PrecisionLoss) and
            (loss.beyond_bound or loss.saturated)]
