"""``KbitLinear`` (a drop-in ``nn.Linear`` replacement) and ``quantize_model``.

    layer = kbit.KbitLinear.from_linear(linear, k=4)
    model = kbit.quantize_model(model, k=4)          # swaps eligible nn.Linear layers in place

A ``KbitLinear`` holds the storage format of its weight as buffers named like the keys of
``QuantizedWeight.state_dict()`` (``packed``, ``absmax``, ``codebook``, ``scale``, ``meta``) plus
an optional ``bias`` parameter, so it saves and loads through ``state_dict`` (``torch.save`` or
safetensors) and loads into a module built from its shape alone::

    fresh = kbit.KbitLinear(in_features, out_features, bias=True, k=4)
    fresh.load_state_dict(state)

Dtype casts (``.half()``, ``.to(torch.bfloat16)``) move the bias but never touch the quantized
buffers; device moves move everything. The module keeps one ``QuantizedWeight`` view of its
buffers so that the GEMM layout derived on CUDA is cached across forwards; the view is rebuilt
whenever the buffers change (device moves, ``load_state_dict``, or assigning a new buffer).
"""

from __future__ import annotations

import fnmatch
from typing import Iterable, Optional, Union

import torch
from torch import Tensor, nn

from .formats import check_bits, check_codebook, create_normal_float_codebook, num_blocks
from .weight import _CODE_DTYPES, _DTYPE_CODES, STATE_KEYS, QuantizedWeight, matmul, padded_in_features, quantize

__all__ = ["KbitLinear", "quantize_model"]

# Buffers whose dtype is part of the format: module-wide dtype casts must leave them alone.
_FORMAT_BUFFERS = ("packed", "absmax", "codebook", "scale", "meta")


class KbitLinear(nn.Module):
    """``y = x @ W_hat.T + bias`` with ``W_hat`` stored k-bit quantized (``kbit.matmul``).

    Args:
        in_features, out_features: the shape of the original ``nn.Linear``.
        bias: whether the layer has a bias (a ``Parameter`` of ``dtype``).
        k: bits per weight, 2..5.
        dtype: dtype of the original weight (what ``dequantize`` returns by default) and of the bias.
        device: where the buffers live.
        codebook: optional custom codebook (2**k sorted values in [-1, 1]); default normal-float.

    A module built this way holds an all-zero weight: fill it with ``load_state_dict`` or build
    it with ``from_linear`` / ``from_quantized``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        k: int = 4,
        dtype: torch.dtype = torch.float16,
        device=None,
        codebook: Optional[Tensor] = None,
    ):
        super().__init__()
        check_bits(k)
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if dtype not in _DTYPE_CODES:
            raise TypeError(f"dtype must be one of {tuple(_DTYPE_CODES)}, got {dtype}")
        self.in_features, self.out_features, self.k = in_features, out_features, k
        self.weight_dtype = dtype
        nb = num_blocks(out_features * padded_in_features(in_features))
        cb = create_normal_float_codebook(k) if codebook is None else check_codebook(codebook, k)
        self.register_buffer("packed", torch.zeros(nb * k, dtype=torch.int32, device=device))
        self.register_buffer("absmax", torch.zeros(nb, dtype=torch.uint8, device=device))
        self.register_buffer("codebook", cb.to(device=device, dtype=torch.float32))
        self.register_buffer("scale", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("meta", self._meta_tensor(device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self._qw: Optional[QuantizedWeight] = None

    # ------------------------------------------------------------------ construction
    def _meta_tensor(self, device=None) -> Tensor:
        return torch.tensor(
            [self.k, self.out_features, self.in_features, _DTYPE_CODES[self.weight_dtype]],
            dtype=torch.int64, device=device,
        )

    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: Optional[Tensor] = None) -> "KbitLinear":
        """Wrap an existing ``QuantizedWeight`` (its tensors are shared, not copied)."""
        if not isinstance(qw, QuantizedWeight):
            raise TypeError(f"qw must be a kbit.QuantizedWeight, got {type(qw).__name__}")
        N, K = qw.shape
        if bias is not None:
            if not isinstance(bias, Tensor):
                raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
            if tuple(bias.shape) != (N,):
                raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
        mod = cls(K, N, bias=bias is not None, k=qw.k, dtype=qw.dtype, device="meta")
        mod.packed, mod.absmax, mod.codebook, mod.scale = qw.packed, qw.absmax, qw.codebook, qw.scale
        mod.meta = mod._meta_tensor(qw.device)
        if bias is not None:
            mod.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        mod._qw = qw
        return mod

    @classmethod
    def from_linear(cls, linear: nn.Linear, k: int = 4, codebook: Optional[Tensor] = None) -> "KbitLinear":
        """Quantize an ``nn.Linear`` (on its own device) into a new ``KbitLinear``."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        w = linear.weight
        if w.device.type == "meta":
            raise ValueError("cannot quantize a Linear whose weight is on the meta device (it holds no values); "
                             "load its weights first")
        with torch.no_grad():
            qw = quantize(w.detach(), k=k, codebook=codebook)
        return cls.from_quantized(qw, linear.bias)

    # ------------------------------------------------------------------ the QuantizedWeight view
    @property
    def qweight(self) -> QuantizedWeight:
        """A ``QuantizedWeight`` view of the buffers (kept, so its GEMM layout stays cached)."""
        qw = self._qw
        if (
            qw is None
            or qw.packed is not self.packed
            or qw.absmax is not self.absmax
            or qw.codebook is not self.codebook
            or qw.scale is not self.scale
        ):
            qw = QuantizedWeight(
                self.packed, self.absmax, self.codebook, self.scale,
                self.k, (self.out_features, self.in_features), self.weight_dtype,
            )
            self._qw = qw
        return qw

    def _invalidate(self) -> None:
        self._qw = None

    def dequantize(self, dtype=None) -> Tensor:
        """The [out_features, in_features] reconstructed weight (default: the original dtype)."""
        return self.qweight.dequantize(dtype)

    def forward(self, x: Tensor) -> Tensor:
        return matmul(x, self.qweight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"k={self.k}, dtype={str(self.weight_dtype).replace('torch.', '')}"
        )

    # ------------------------------------------------------------------ device / dtype moves
    def _apply(self, fn, recurse=True):
        # Module-wide dtype casts (.half(), .to(dtype), .float()) must not change the format's
        # buffers: codebook and scale are float32 by definition. Apply fn to find the target
        # device, then move the original tensor there without changing its dtype.
        before = {name: self._buffers.get(name) for name in _FORMAT_BUFFERS}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers.get(name)
            if old is not None and new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(device=new.device)
        self._invalidate()
        return self

    # ------------------------------------------------------------------ loading
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        meta = state_dict.get(prefix + "meta")
        if isinstance(meta, Tensor) and meta.device.type != "meta":
            if meta.shape != (4,):
                error_msgs.append(f"{prefix}meta must have shape (4,), got {tuple(meta.shape)}")
                return
            k, N, K, code = (int(v) for v in meta.tolist())
            if (k, N, K) != (self.k, self.out_features, self.in_features):
                error_msgs.append(
                    f"{prefix}meta describes a k={k} [{N}, {K}] weight, but this KbitLinear is k={self.k} "
                    f"[{self.out_features}, {self.in_features}]; build it with the checkpoint's shape and k"
                )
                return
            if code not in _CODE_DTYPES:
                error_msgs.append(f"{prefix}meta holds unknown dtype code {code}")
                return
            dtype = _CODE_DTYPES[code]
        else:
            dtype = self.weight_dtype
        # Keep the format's float32 buffers float32 even if the checkpoint was cast.
        for name in ("codebook", "scale"):
            t = state_dict.get(prefix + name)
            if isinstance(t, Tensor) and t.dtype != torch.float32 and t.is_floating_point():
                state_dict[prefix + name] = t.to(torch.float32)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self.weight_dtype = dtype
        self._invalidate()

    def __setstate__(self, state):
        super().__setstate__(state)
        self._qw = None


# ---------------------------------------------------------------------- model conversion
def _matches(name: str, patterns: Iterable[str]) -> bool:
    for p in patterns:
        if name == p or name.endswith("." + p) or fnmatch.fnmatchcase(name, p):
            return True
    return False


def _progress(iterable, total: int, enabled: bool):
    if not enabled:
        return iterable
    try:
        from tqdm.auto import tqdm
    except Exception:  # tqdm is optional
        return iterable
    return tqdm(iterable, total=total, desc="kbit: quantizing", unit="layer", leave=False)


def quantize_model(
    model: nn.Module,
    k: int = 4,
    codebook: Optional[Tensor] = None,
    skip: Union[str, Iterable[str]] = ("lm_head",),
    min_features: int = 128,
    progress: bool = True,
) -> nn.Module:
    """Replace every eligible ``nn.Linear`` of ``model`` with a ``KbitLinear``, in place.

    A Linear is eligible unless its qualified name matches ``skip`` (exact name, a name suffix
    after a dot such as ``"lm_head"`` for ``"model.lm_head"``, or an ``fnmatch`` pattern such as
    ``"*.mlp.gate"``), or ``min(in_features, out_features) < min_features`` (tiny layers such as
    MoE routers are better left in full precision), or it is the output projection of an
    ``nn.MultiheadAttention`` (which reads its weight directly). A Linear shared under several
    names becomes one shared ``KbitLinear``. Returns the model (or the new module if ``model``
    itself is an eligible Linear).
    """
    check_bits(k)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if codebook is not None:
        codebook = check_codebook(codebook, k)
    skip = (skip,) if isinstance(skip, str) else tuple(skip or ())

    mha_children = set()
    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention):
            mha_children.update(id(c) for c in m.children())

    targets = []
    for name, m in model.named_modules(remove_duplicate=False):
        if not isinstance(m, nn.Linear) or isinstance(m, KbitLinear):
            continue
        if id(m) in mha_children or _matches(name, skip):
            continue
        if min(m.in_features, m.out_features) < min_features:
            continue
        targets.append((name, m))

    replaced = {}
    with torch.no_grad():
        for name, lin in _progress(targets, len(targets), progress):
            new = replaced.get(id(lin))
            if new is None:
                new = KbitLinear.from_linear(lin, k=k, codebook=codebook)
                replaced[id(lin)] = new
            if name == "":
                return new
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, new)
    return model
