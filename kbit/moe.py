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

Storage (persistent buffers, what ``state_dict`` holds; H_pad = H rounded up to 32, I_pad likewise):

    gate_up_packed  int32   [E, 2I * H_pad / 32 * k]   row e: the ``packed`` of expert e's [2I, H] weight
    gate_up_absmax  uint8   [E, 2I * H_pad / 32]       row e: its ``absmax``
    gate_up_scale   float32 [E]                        its per-tensor power-of-two ``scale``
    down_packed     int32   [E, H * I_pad / 32 * k]    the same for expert e's [H, I] down weight
    down_absmax     uint8   [E, H * I_pad / 32]
    down_scale      float32 [E]
    codebook        float32 [2**k]                     shared by every expert of the layer
    meta            int64   [5]                        [k, E, H, I, dtype code (kbit.formats.DTYPE_CODES)]

Row e of each projection is exactly what ``kbit.quantize`` makes of that expert's weight alone
(``QuantizedWeight.state_dict``), so ``expert_weight(proj, e)`` is a ``QuantizedWeight`` view of it.

The forward is the per-expert reference: each routed expert's weights dequantized to float32.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ._validate import check_bits, check_codebook, check_int, check_meta, check_not_meta, check_tensor
from .formats import CODE_DTYPES, DTYPE_CODES, create_normal_float_codebook, num_blocks, padded_in_features
from .weight import PrecisionLoss, QuantizedWeight, quantize_with_report

__all__ = ["KbitExperts", "find_experts"]

PROJECTIONS = ("gate_up", "down")
_FORMAT_SUFFIXES = ("packed", "absmax", "scale")


class KbitExperts(nn.Module):
    """The routed experts of a MoE layer, k-bit quantized (module docstring: layout and forward).

    Args:
        num_experts, hidden_dim, intermediate_dim: E, H and I.
        k: bits per weight, 2..5.
        dtype: dtype of the original weights (``meta``; what ``dequantize`` returns by default).
        device: where the buffers live.
        codebook: optional custom codebook (2**k sorted values in [-1, 1]); default normal-float.
        act_fn: the gate activation (transformers' ``ACT2FN[config.hidden_act]``); default SiLU.

    A module built this way holds all-zero experts: fill it with ``load_state_dict`` or build it with
    ``from_experts``.
    """

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, k: int = 4,
                 dtype: torch.dtype = torch.float16, device=None, codebook: Optional[Tensor] = None,
                 act_fn: Optional[nn.Module] = None):
        super().__init__()
        self.k = check_bits(k)
        self.num_experts = check_int(num_experts, "num_experts", 1)
        self.hidden_dim = check_int(hidden_dim, "hidden_dim", 1)
        self.intermediate_dim = check_int(intermediate_dim, "intermediate_dim", 1)
        if dtype not in DTYPE_CODES:
            raise TypeError(f"dtype must be one of {tuple(DTYPE_CODES)}, got {dtype}")
        self.weight_dtype = dtype
        self.act_fn = act_fn if act_fn is not None else nn.SiLU()
        E = self.num_experts
        for proj, (N, K) in self.shapes().items():
            nb = num_blocks(N * padded_in_features(K))
            self.register_buffer(f"{proj}_packed", torch.zeros(E, nb * k, dtype=torch.int32, device=device))
            self.register_buffer(f"{proj}_absmax", torch.zeros(E, nb, dtype=torch.uint8, device=device))
            self.register_buffer(f"{proj}_scale", torch.ones(E, dtype=torch.float32, device=device))
        cb = create_normal_float_codebook(k) if codebook is None else check_codebook(codebook, k)
        self.register_buffer("codebook", cb.to(device=device, dtype=torch.float32))
        self.register_buffer("meta", self._meta_tensor(device))

    # ------------------------------------------------------------------ shapes and views
    def shapes(self) -> dict:
        """{projection: (out_features, in_features)} of one expert."""
        H, I = self.hidden_dim, self.intermediate_dim
        return {"gate_up": (2 * I, H), "down": (H, I)}

    def _meta_tensor(self, device=None) -> Tensor:
        values = [self.k, self.num_experts, self.hidden_dim, self.intermediate_dim, DTYPE_CODES[self.weight_dtype]]
        return torch.tensor(values, dtype=torch.int64, device=device)

    def _check_projection(self, proj: str) -> str:
        if proj not in PROJECTIONS:
            raise ValueError(f"proj must be one of {PROJECTIONS}, got {proj!r}")
        return proj

    def expert_weight(self, proj: str, expert: int) -> QuantizedWeight:
        """A ``QuantizedWeight`` view of expert ``expert``'s ``"gate_up"`` ([2I, H]) or ``"down"`` ([H, I]) weight."""
        self._check_projection(proj)
        e = check_int(expert, "expert", 0)
        if e >= self.num_experts:
            raise ValueError(f"expert must be < {self.num_experts}, got {e}")
        return QuantizedWeight(getattr(self, f"{proj}_packed")[e], getattr(self, f"{proj}_absmax")[e], self.codebook,
                               getattr(self, f"{proj}_scale")[e], self.k, self.shapes()[proj], self.weight_dtype)

    def dequantize(self, proj: str, dtype=None) -> Tensor:
        """Every expert's reconstructed weight, [E, 2I, H] (``"gate_up"``) or [E, H, I] (``"down"``)."""
        self._check_projection(proj)
        return torch.stack([self.expert_weight(proj, e).dequantize(dtype) for e in range(self.num_experts)])

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_weights(cls, gate_up: Tensor, down: Tensor, k: int = 4, codebook: Optional[Tensor] = None,
                     act_fn: Optional[nn.Module] = None, name: str = "experts"):
        """Quantize gate_up [E, 2I, H] and down [E, H, I] expert by expert: (KbitExperts, [(label, PrecisionLoss)])."""
        check_tensor(gate_up, f"{name}.gate_up_proj")
        check_tensor(down, f"{name}.down_proj")
        if gate_up.dim() != 3 or gate_up.shape[1] % 2:
            raise ValueError(f"{name}.gate_up_proj must be [E, 2I, H], got {tuple(gate_up.shape)}")
        E, I2, H = gate_up.shape
        if tuple(down.shape) != (E, H, I2 // 2):
            raise ValueError(f"{name}.down_proj must be [{E}, {H}, {I2 // 2}] next to gate_up_proj "
                             f"{tuple(gate_up.shape)}, got {tuple(down.shape)}")
        for w, proj in ((gate_up, "gate_up_proj"), (down, "down_proj")):
            check_not_meta(w, f"{name}.{proj}")
        mod = cls(E, H, I2 // 2, k=k, dtype=gate_up.dtype, device=gate_up.device, codebook=codebook, act_fn=act_fn)
        losses = []
        with torch.no_grad():
            for proj, w in (("gate_up", gate_up), ("down", down)):
                packed, absmax, scale = (getattr(mod, f"{proj}_{s}") for s in _FORMAT_SUFFIXES)
                for e in range(E):
                    label = f"{name}.{proj}_proj[{e}]"
                    qw, loss = quantize_with_report(w[e].detach(), k=k, codebook=mod.codebook, name=label)
                    packed[e], absmax[e], scale[e] = qw.packed, qw.absmax, qw.scale
                    losses.append((label, loss))
        return mod, losses

    @classmethod
    def from_experts(cls, experts: nn.Module, k: int = 4, codebook: Optional[Tensor] = None, name: str = "experts"):
        """Quantize a transformers fused experts module (``find_experts`` says which are supported)."""
        why = unsupported_reason(experts)
        if why:
            raise ValueError(f"{name}: {why}")
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if getattr(experts, "is_transposed", False):  # stored [E, H, 2I] and [E, I, H]
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        return cls.from_weights(gate_up, down, k=k, codebook=codebook, act_fn=experts.act_fn, name=name)

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
        return self._forward_reference(x, idx, w)

    def _activate(self, gate_up: Tensor) -> Tensor:
        """act(gate) * up from the [rows, 2I] product (gate columns first)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def _forward_reference(self, x: Tensor, idx: Tensor, w: Tensor) -> Tensor:
        """Per routed expert: its weights dequantized to float32, products rounded to x's dtype like
        ``kbit.matmul``; the weighted sum in float32. Synchronizes with the device (it lists the routed experts)."""
        top_k = idx.shape[1]
        out = torch.zeros(x.shape[0], self.hidden_dim, dtype=torch.float32, device=x.device)
        flat, weights = idx.reshape(-1), w.reshape(-1).to(torch.float32)
        routed = flat[(flat >= 0) & (flat < self.num_experts)]
        for e in torch.unique(routed).tolist():
            slots = (flat == e).nonzero().flatten()
            tokens = slots // top_k
            gu = x[tokens].to(torch.float32) @ self.expert_weight("gate_up", e).dequantize(torch.float32).T
            h = self._activate(gu.to(x.dtype))
            y = (h.to(torch.float32) @ self.expert_weight("down", e).dequantize(torch.float32).T).to(x.dtype)
            out.index_add_(0, tokens, y.to(torch.float32) * weights[slots, None])
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, k={self.k}, "
                f"dtype={str(self.weight_dtype).replace('torch.', '')}")

    # ------------------------------------------------------------------ device / dtype moves
    def _apply(self, fn, recurse=True):
        # Module-wide dtype casts (.half(), .to(dtype)) must not change the format's buffers (codebook and scales
        # are float32 by definition): apply fn for the target device, then move the originals there unchanged.
        names = [f"{p}_{s}" for p in PROJECTIONS for s in _FORMAT_SUFFIXES] + ["codebook", "meta"]
        before = {name: self._buffers.get(name) for name in names}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers.get(name)
            if old is not None and new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        return self

    # ------------------------------------------------------------------ loading
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # A checkpoint is untrusted: check everything it holds for this layer before any of it is assigned.
        dtype = self.weight_dtype
        meta = state_dict.get(prefix + "meta")
        try:
            if isinstance(meta, Tensor) and meta.device.type != "meta":
                dtype = self._check_meta(meta, prefix + "meta")
            self._check_incoming(state_dict, prefix)
        except (TypeError, ValueError) as e:
            error_msgs.append(str(e))
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self.weight_dtype = dtype

    def _check_meta(self, meta, name: str) -> torch.dtype:
        check_tensor(meta, name)
        if meta.is_floating_point() or meta.is_complex() or meta.dtype == torch.bool or tuple(meta.shape) != (5,):
            raise ValueError(f"{name} must be an integer tensor of shape (5,) [k, E, H, I, dtype code], got "
                             f"{meta.dtype} {tuple(meta.shape)}")
        k, E, H, I, code = (int(v) for v in meta.tolist())
        if code not in CODE_DTYPES:
            raise ValueError(f"{name} holds unknown dtype code {code} (known: {sorted(CODE_DTYPES)})")
        if (k, E, H, I) != (self.k, self.num_experts, self.hidden_dim, self.intermediate_dim):
            raise ValueError(
                f"{name} describes k={k} experts E={E}, H={H}, I={I}, but this KbitExperts is k={self.k}, "
                f"E={self.num_experts}, H={self.hidden_dim}, I={self.intermediate_dim}; build it with the checkpoint's"
            )
        return CODE_DTYPES[code]

    def _check_incoming(self, state_dict, prefix: str) -> None:
        """Dtype, shape, contiguity and values of each storage tensor a state dict brings (missing ones are kept)."""
        for name in ["codebook"] + [f"{p}_scale" for p in PROJECTIONS]:  # float32 by definition; 16-bit copies load
            t = state_dict.get(prefix + name)
            if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float32:
                state_dict[prefix + name] = t.to(torch.float32)
        for name, want in self._buffers.items():
            if name == "meta" or prefix + name not in state_dict:
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
                check_codebook(t, self.k, prefix + name)
            elif name.endswith("_scale"):
                mantissa, _ = torch.frexp(t)
                if not bool((torch.isfinite(t) & (t > 0) & (mantissa == 0.5)).all()):
                    raise ValueError(f"{prefix}{name} must hold positive finite powers of two")


# ---------------------------------------------------------------------- finding experts in a model
def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` keeps experts as 3-D ``gate_up_proj`` / ``down_proj`` parameters (transformers 5.x)."""
    params = module._parameters
    return (isinstance(params.get("gate_up_proj"), Tensor) and isinstance(params.get("down_proj"), Tensor)
            and params["gate_up_proj"].dim() == 3 and params["down_proj"].dim() == 3)


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


def experts_shape(module: nn.Module) -> tuple:
    """(E, H, I) of a supported fused experts module."""
    E, a, b = module.gate_up_proj.shape
    return (E, a, b // 2) if getattr(module, "is_transposed", False) else (E, b, a // 2)


def precision_losses(losses) -> list:
    """The (label, PrecisionLoss) entries that lost precision (what quantize_model warns about)."""
    return [(label, loss) for label, loss in losses if isinstance(loss, PrecisionLoss) and
            (loss.beyond_bound or loss.saturated)]
