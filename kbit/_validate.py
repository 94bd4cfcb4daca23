"""Argument checks of the public API: each raises ``TypeError`` or ``ValueError`` naming the argument.

The public functions and constructors (``kbit.quantize``, ``kbit.matmul``, ``QuantizedWeight``, ``KbitLinear``,
``kbit.quantize_model``, ``KbitConfig``, ``kbit.functional``) call these once, at their boundary; what they call
inside kbit trusts its arguments, the custom ops in ``kbit.ops`` included. The CUDA binding checks again what
reaches a kernel (dtype, shape, device, contiguity).

Checks that read tensor values (``check_codebook``, ``check_scale``, ``check_finite``) synchronize with
the device; they run when a weight is quantized or loaded, never per forward.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from .formats import (
    BLOCK_SIZE,
    CODE_DTYPES,
    EXPERTS_META_FIELDS,
    META_FIELDS,
    SUPPORTED_BITS,
    create_normal_float_codebook,
    decode_absmax_e4m4,
    storage_spec,
)

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what quantize reads and dequantize writes
GEMM_DTYPES = (torch.float16, torch.bfloat16)  # activations of the fused GEMM
# A codebook's largest |value| must be 1 (its levels are multiples of the block absmax); float32 rounding of a
# user's normalization is allowed this much slack.
CODEBOOK_MAX_TOLERANCE = 1e-6


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_tensor(t, name: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_int(value, name: str, minimum: int = None) -> int:
    """A Python (or numpy / 0-dim integer tensor) integer, not a bool or a float; at least ``minimum``."""
    if isinstance(value, Tensor) and value.dim() == 0 and not value.is_floating_point() and value.dtype != torch.bool:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral):
        raise TypeError(f"bits must be an int in {SUPPORTED_BITS} (bits per weight), got {type(bits).__name__}")
    if int(bits) not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS} (bits per weight), got {bits}")
    return int(bits)


def check_dtype(dtype, name: str, allowed=INPUT_DTYPES) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or dtype not in allowed:
        names = ", ".join(_dtype_name(d) for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {_dtype_name(dtype)}")
    return dtype


def check_not_meta(t: Tensor, name: str) -> None:
    if t.device.type == "meta":
        raise ValueError(
            f"{name} is on the meta device and holds no values (was it missing from the checkpoint that was loaded?)"
        )


def check_same_device(**tensors) -> torch.device:
    """All non-None tensors on one device; returns it."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        names = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {names}")
    return first


def check_finite(A: Tensor, name: str) -> None:
    check_not_meta(A, name)
    if A.numel() and not bool(torch.isfinite(A).all()):
        bad = int((~torch.isfinite(A)).sum())
        raise ValueError(f"{name} contains {bad} NaN/Inf value(s); kbit quantizes finite values only")


def check_weight(W, name: str) -> Tensor:
    """A weight to quantize: a non-empty 2-D [out_features, in_features] tensor of finite fp16/bf16/fp32 values."""
    check_tensor(W, name)
    check_dtype(W.dtype, name)
    if W.dim() != 2 or W.shape[0] == 0 or W.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty 2-D [out_features, in_features] tensor, got shape "
                         f"{tuple(W.shape)}")
    check_finite(W, name)
    return W


def check_codebook(codebook, bits: int, name: str = "codebook") -> Tensor:
    """2**bits finite levels, strictly ascending, largest |value| 1. Returns them as contiguous float32."""
    check_tensor(codebook, name)
    if not codebook.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {_dtype_name(codebook.dtype)}")
    if codebook.dim() != 1 or codebook.numel() != 2**bits:
        raise ValueError(f"{name} for bits={bits} must be 1-D with {2**bits} entries, got shape "
                         f"{tuple(codebook.shape)}")
    check_not_meta(codebook, name)
    # The caller's tensor itself where it already is float32 without autograd: the GEMM tells a codebook it has
    # read before by its identity (kbit.ops.weights_settled).
    cb = (codebook.detach() if codebook.requires_grad else codebook).to(torch.float32)
    if not bool(torch.isfinite(cb).all()):
        raise ValueError(f"{name} contains NaN or Inf")
    if not bool((cb[1:] > cb[:-1]).all()):
        raise ValueError(f"{name} must be sorted strictly ascending")
    peak = float(cb.abs().max())
    if abs(peak - 1.0) > CODEBOOK_MAX_TOLERANCE:
        raise ValueError(
            f"{name} values must lie in [-1, 1] with largest |value| exactly 1 (levels are multiples of the "
            f"block absmax), got largest |value| {peak:.6g}; divide it by its largest |value|"
        )
    return cb.contiguous()


def codebook_values(codebook, bits: int, name: str = "codebook") -> list:
    """A codebook given as a tensor or a sequence of numbers (``KbitConfig``, config.json) -> its checked levels
    as a list of floats."""
    if not isinstance(codebook, Tensor):
        values = list(codebook) if isinstance(codebook, (list, tuple)) else None
        if values is None or any(isinstance(v, bool) or not isinstance(v, numbers.Real) for v in values):
            raise TypeError(f"{name} must be a tensor or a list of {2**bits} numbers, got {codebook!r:.80}")
        codebook = torch.tensor([float(v) for v in values], dtype=torch.float32)
    return check_codebook(codebook, bits, name).tolist()


def check_skip(skip, name: str = "skip") -> list:
    """Module names or patterns to leave unquantized: one str or an iterable of str -> a list (None: empty)."""
    if skip is None:
        return []
    if isinstance(skip, str):
        return [skip]
    try:
        names = list(skip)
    except TypeError:
        raise TypeError(f"{name} must be a module name or pattern (str) or a list of them, got "
                        f"{type(skip).__name__} ({skip!r:.80})") from None
    odd = [n for n in names if not isinstance(n, str)]
    if odd:
        raise TypeError(f"{name} must hold module names or patterns (str), got {odd[0]!r} "
                        f"({type(odd[0]).__name__})")
    return names


def refuse_assignment(module, name: str, stored: tuple) -> None:
    """``module.<name> = ...`` for a weight a kbit layer holds quantized: a clear error (nn.Module would raise a
    ``KeyError``, or register a parameter that nothing reads)."""
    if name in stored:
        kind = type(module).__name__
        raise AttributeError(
            f"{kind}.{name} cannot be assigned: the layer holds it quantized, read-only; quantize the new weight "
            f"into a new layer (kbit.quantize_model, {kind}.from_{'linear' if kind == 'KbitLinear' else 'experts'}) "
            f"or load quantized tensors with load_state_dict"
        )


def codebook_for(codebook, bits: int, device) -> Tensor:
    """The normal-float codebook, or a checked float32 copy of the caller's (never an alias of it), on ``device``."""
    if codebook is None:
        return create_normal_float_codebook(bits, device=device)
    return check_codebook(codebook, bits).to(device=device, copy=True)


def check_scale(scale, device, name: str = "scale") -> Tensor:
    """A per-tensor scale: a positive, finite power of two (None means 1). Returns a 0-dim float32 tensor."""
    if scale is None:
        return torch.ones((), dtype=torch.float32, device=device)
    if isinstance(scale, Tensor):
        check_not_meta(scale, name)
        if scale.numel() != 1:
            raise ValueError(f"{name} must hold one value, got shape {tuple(scale.shape)}")
        if not scale.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {_dtype_name(scale.dtype)}")
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{name} must be a float or a one-element tensor, got {type(scale).__name__}")
    t = torch.as_tensor(scale).detach().to(dtype=torch.float32).reshape(()).to(device)
    value = float(t)
    if not (math.isfinite(value) and value > 0 and math.frexp(value)[0] == 0.5):
        raise ValueError(f"{name} must be a positive finite power of two, got {value}")
    return t


def _meta_values(meta, name: str, fields) -> list:
    """The integers of a ``meta`` tensor with ``fields`` (``kbit.formats``), its bits and dtype code checked;
    the dtype code replaced by its dtype."""
    check_tensor(meta, name)
    check_not_meta(meta, name)
    if meta.is_floating_point() or meta.is_complex() or meta.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {_dtype_name(meta.dtype)}")
    if tuple(meta.shape) != (len(fields),):
        raise ValueError(f"{name} must have shape ({len(fields)},) [{', '.join(fields)}], got {tuple(meta.shape)}")
    values = [int(v) for v in meta.tolist()]
    try:
        values[0] = check_bits(values[0])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: {e}") from None
    if values[-1] not in CODE_DTYPES:
        raise ValueError(f"{name} holds unknown dtype code {values[-1]} (known: {sorted(CODE_DTYPES)})")
    values[-1] = CODE_DTYPES[values[-1]]
    return values


def check_meta(meta, name: str = "meta"):
    """The ``meta`` tensor of a saved weight (``formats.META_FIELDS``) -> (bits, (out_features, in_features), dtype)."""
    bits, out_features, in_features, dtype = _meta_values(meta, name, META_FIELDS)
    if out_features <= 0 or in_features <= 0:
        raise ValueError(f"{name} describes a [{out_features}, {in_features}] weight; both sizes must be positive")
    return bits, (out_features, in_features), dtype


def check_experts_meta(meta, name: str = "meta"):
    """The ``meta`` tensor of a mixture-of-experts layer (``formats.EXPERTS_META_FIELDS``) ->
    (bits, num_experts, hidden_dim, intermediate_dim, dtype)."""
    return tuple(_meta_values(meta, name, EXPERTS_META_FIELDS))


def check_range(absmax: Tensor, scale: Tensor, codebook: Tensor, dtype: torch.dtype, name: str) -> None:
    """Every value a weight can reconstruct is finite in its ``dtype``: its largest block scale (``absmax``'s
    largest code; E4M4 codes ascend with the value) times ``scale`` times the codebook's largest |level| is at most
    the dtype's largest value, as ``kbit.quantize`` ensures. ``absmax`` [..., blocks] and ``scale`` [...]: one
    weight, or one per expert (``name`` then says which)."""
    peak = decode_absmax_e4m4(absmax.amax(dim=-1)) * scale.to(torch.float32) * codebook.abs().max().float()
    too_big = ~(peak <= torch.finfo(dtype).max)  # an overflow to Inf in float32 included
    if bool(too_big.any()):
        where = f", expert {int(too_big.nonzero()[0, 0])}" if too_big.dim() else ""
        raise ValueError(
            f"{name}{where}: its block scales times its scale reach {float(peak.flatten()[too_big.flatten()][0]):.6g}, "
            f"past {_dtype_name(dtype)}'s largest value {torch.finfo(dtype).max:.6g}: it would dequantize to Inf"
        )


# What a checkpoint may store each kbit entry as (safetensors' dtype names), by the entry's name or its suffix
# after "_" (``gate_up_packed``): what ``load_state_dict`` accepts. The codes, block scales and rotation signs exactly
# as kbit writes them; the codebook and scales in any float (loading widens them to float32); meta and the rotation
# block in any integer. A loader that casts to the module's buffers (transformers) must not hide another dtype.
_FLOATS = ("F16", "BF16", "F32", "F64")
_INTEGERS = ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64")
SAVED_DTYPES = {"packed": ("I32",), "absmax": ("U8",), "codebook": _FLOATS, "scale": _FLOATS, "meta": _INTEGERS,
                "rotation_signs": ("I8",), "rotation_block": _INTEGERS}


def check_saved_dtype(entry: str, stored: str, name: str) -> None:
    """Entry ``entry`` of a kbit module (``packed``, ``gate_up_absmax``, ...), stored on disk as safetensors dtype
    ``stored`` under ``name``: refused unless loading it as stored would be accepted."""
    kind = entry if entry in SAVED_DTYPES else entry.rpartition("_")[2]
    allowed = SAVED_DTYPES[kind]
    if stored not in allowed:
        raise ValueError(f"{name} is stored as {stored}; a kbit checkpoint stores it as {' or '.join(allowed)}")


def check_storage_tensor(t, key: str, bits: int, shape, prefix: str = "") -> None:
    """Dtype, shape and contiguity of storage tensor ``key`` (no values read)."""
    check_tensor(t, prefix + key)
    dtype, want = storage_spec(key, bits, shape)
    if t.dtype != dtype:
        raise TypeError(f"{prefix}{key} must be {_dtype_name(dtype)}, got {_dtype_name(t.dtype)}")
    if tuple(t.shape) != want:
        raise ValueError(
            f"{prefix}{key} of a bits={bits} {list(shape)} weight (blocks of {BLOCK_SIZE}) must have shape "
            f"{want}, got {tuple(t.shape)}"
        )
    if not t.is_contiguous():
        raise ValueError(f"{prefix}{key} must be contiguous")


def check_storage(packed, absmax, codebook, scale, bits: int, shape, prefix: str = "") -> None:
    """Dtypes, shapes and devices of a weight's storage (no values read: cheap, safe while tracing)."""
    tensors = {"packed": packed, "absmax": absmax, "codebook": codebook, "scale": scale}
    for key, t in tensors.items():
        check_storage_tensor(t, key, bits, shape, prefix)
    check_same_device(**{prefix + key: t for key, t in tensors.items()})
