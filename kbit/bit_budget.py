"""A bit width per layer under an average-bits budget: ``quantize_model(model, bits=3.5)``.

**What a budget counts.** A layer quantized to K bits stores, per row, a K-bit code for each of its
``padded_in_features`` (``in_features`` rounded up to 32) weights and an 8-bit E4M4 scale per block of 32:
``layer_bits(out, in, K) = out * padded_in * (K + 8/32)``. The average bits per weight of a model is the sum of
that over its quantized layers divided by the sum of ``out * in`` (so uniform K on layers whose ``in_features``
is a multiple of 32 is exactly ``K + 0.25``). The per-tensor codebook (``2**K`` float32 levels) and scale
(float32) and the rotation's signs are not counted: at most 1056 bits per layer plus one byte per input
feature, under 0.003 bits per weight for layers of 128 x 128 and more.

**How K is chosen.** Each layer's contribution to the model's loss increase at each K in 2..5 is estimated
(``layer_sensitivities``) and the K's are chosen to minimise the sum under the budget (``allocate_bits``):
start every layer at K = 2, then repeatedly take the upgrade (one layer, from its K to any higher K) with the
largest loss decrease per added bit among those that still fit, until none fits. The estimate of layer l at K is
``1/4 * sum_o F_o * (dW H dW^T)_oo``: ``F_o`` the mean squared gradient of the calibration loss (summed next-token
cross-entropy) with respect to output feature o of the layer, on the unquantized model (a diagonal Fisher
estimate); ``H = 2 X^T X / n`` the layer's input Hessian on the same data; ``dW`` the layer's error when plainly
rounded to K bits (in the rotated basis when the layer is rotated). For ``method="gptq"`` the output error is
GPTQ's own estimate of what it leaves, ``sum_j dW_oj**2 / [H^-1]_jj`` (damped H), since GPTQ feeds each rounding
error into the columns not yet quantized. Models whose output has no ``logits`` (encoders) weigh every output
feature by one over its mean square instead of ``F_o`` (the relative output error).
"""

from __future__ import annotations

import fnmatch
import math
import numbers
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from ._validate import SUPPORTED_BITS, check_bits
from .formats import BLOCK_SIZE, padded_in_features

__all__ = ["layer_bits", "average_bits", "check_budget", "check_bits_setting", "allocate_bits", "layer_sensitivities",
           "choose_layer_bits"]

SCALE_BITS = 8  # one E4M4 block scale per BLOCK_SIZE weights


def layer_bits(out_features: int, in_features: int, k: int) -> int:
    """Stored bits of a layer at K bits that a budget counts: codes and block scales of its padded rows."""
    return out_features * padded_in_features(in_features) * k + out_features * (
        padded_in_features(in_features) // BLOCK_SIZE) * SCALE_BITS


def average_bits(shapes: dict, ks: dict) -> float:
    """Average bits per weight of layers ``shapes`` ({name: (out, in)}) at ``ks`` ({name: K}), as a budget counts."""
    bits = sum(layer_bits(o, i, ks[n]) for n, (o, i) in shapes.items())
    return bits / sum(o * i for o, i in shapes.values())


def check_budget(bits) -> float:
    """A budget in average bits per weight, between uniform K = 2 and K = 5 (2.25 .. 5.25)."""
    if isinstance(bits, bool) or not isinstance(bits, (int, float)):
        raise TypeError(f"a bit budget must be a float (average bits per weight), got {type(bits).__name__}")
    low, high = min(SUPPORTED_BITS) + SCALE_BITS / BLOCK_SIZE, max(SUPPORTED_BITS) + SCALE_BITS / BLOCK_SIZE
    if not (low <= bits <= high):
        raise ValueError(f"a bit budget must be between {low} and {high} average bits per weight (K + 8/32 for "
                         f"K = 2..5, block scales counted), got {bits}")
    return float(bits)


def check_bits_setting(bits):
    """``quantize_model``'s ``bits``: an int K (every layer), a float budget (``check_budget``), or a dict
    ``{name or pattern: K}`` (each layer the K of the first key that matches its name, as ``skip`` matches)."""
    if isinstance(bits, bool):
        raise TypeError("bits must be an int K, a float budget or a dict {layer name: K}, got a bool")
    if isinstance(bits, numbers.Integral):
        return check_bits(bits)
    if isinstance(bits, float):
        return check_budget(bits)
    if isinstance(bits, dict):
        if not bits or not all(isinstance(key, str) for key in bits):
            raise ValueError(f"bits as a dict must map layer names or patterns (str) to K, got {bits!r}")
        return {key: check_bits(k) for key, k in bits.items()}
    raise TypeError(f"bits must be an int K, a float budget or a dict {{layer name: K}}, got {type(bits).__name__}")


def allocate_bits(shapes: dict, errors: dict, budget: float, start: Optional[dict] = None) -> dict:
    """{name: K} minimising ``sum errors[name][K]`` with ``average_bits(shapes, ks) <= budget``.

    ``errors``: {name: {K: estimated loss increase}} for K in 2..5. Greedy by loss decrease per added bit (module
    docstring) from ``start`` ({name: K}, default 2 everywhere); ties go to the layer named first.
    """
    budget = check_budget(budget)
    names = list(shapes)
    ks = {n: (start or {}).get(n, min(SUPPORTED_BITS)) for n in names}
    total = sum(o * i for o, i in shapes.values())
    # Integer bits throughout: the budget is met exactly as counted, with no rounding drift.
    left = math.floor(budget * total + 1e-9) - sum(layer_bits(*shapes[n], ks[n]) for n in names)
    if left < 0:
        raise ValueError(f"a budget of {budget} bits per weight is below the smallest choice on these layers "
                         f"({average_bits(shapes, ks):.4f} bits per weight)")
    while True:
        best, best_rate = None, 0.0
        for n in names:
            k0, (o, i) = ks[n], shapes[n]
            for k in range(k0 + 1, max(SUPPORTED_BITS) + 1):
                extra = layer_bits(o, i, k) - layer_bits(o, i, k0)
                gain = errors[n][k0] - errors[n][k]
                if extra <= left and gain > 0 and gain / extra > best_rate:
                    best, best_rate = (n, k, extra), gain / extra
        if best is None:
            return ks
        n, k, extra = best
        ks[n], left = k, left - extra


# ----------------------------------------------------------------------------- sensitivity
def _output_fisher(model: nn.Module, layers: dict, batches: list, run: Callable) -> Optional[dict]:
    """{name: F [out]}: mean squared gradient of the summed next-token loss over each layer's output features,
    or None when the model gives no ``logits`` (the loss is then undefined)."""
    sums, counts, handles = {}, {}, []

    def hook(name):
        def forward_hook(module, inputs, output):
            if not output.requires_grad:  # the first layers: nothing before them needs a gradient
                output.requires_grad_()

            def grad_hook(g):
                g = g.detach().float().reshape(-1, g.shape[-1])
                sums[name] = sums.get(name, 0) + (g * g).sum(dim=0)
                counts[name] = counts.get(name, 0) + g.shape[0]
            output.register_hook(grad_hook)
            return output
        return forward_hook

    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    handles = [m.register_forward_hook(hook(n)) for n, m in layers.items()]
    has_logits = True
    try:
        with torch.enable_grad():
            def loss_of(output, ids, mask):
                nonlocal has_logits
                logits = getattr(output, "logits", None)
                if logits is None or ids is None:
                    has_logits = False
                    return None
                labels = ids[:, 1:] if mask is None else ids[:, 1:].masked_fill(~mask[:, 1:], -100)
                return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(),
                                                   reduction="sum")
            run(loss_of)
    finally:
        for h in handles:
            h.remove()
        for p, flag in flags:
            p.requires_grad_(flag)
    if not has_logits:
        return None
    return {n: s / counts[n] for n, s in sums.items()}


def _rounding_errors(w: Tensor, H: Tensor, fisher: Optional[Tensor], gptq: bool, damp: float) -> dict:
    """{K: estimated loss increase} of one layer (module docstring)."""
    from .methods import damped_hessian
    from .weight import quantize

    w = w.float()
    H = H.to(device=w.device, dtype=torch.float32)
    if gptq:
        dead = torch.diagonal(H) <= 0  # inputs never reached
        inv_diag = torch.diagonal(torch.cholesky_inverse(torch.linalg.cholesky(damped_hessian(H, damp)))).float()
        col_weight = torch.where(dead, 0.0, 1.0 / inv_diag)
    out = {}
    for k in SUPPORTED_BITS:
        dw = w - quantize(w, bits=k).dequantize(torch.float32)
        per_row = (dw * dw) @ col_weight if gptq else ((dw @ H) * dw).sum(dim=1)
        if fisher is None:  # relative output error: each row over its mean squared output (w H w^T / 2)
            energy = ((w @ H) * w).sum(dim=1)
            per_row = per_row / energy.clamp(min=1e-30 * float(energy.max().clamp(min=1e-30)))
            out[k] = float(per_row.sum())
        else:
            out[k] = 0.25 * float((fisher.to(per_row.device) * per_row).sum())
    return out


def layer_sensitivities(model: nn.Module, layers: list, batches: list, weight_of: Callable, rotations: dict,
                        gptq: bool, damp: float) -> dict:
    """{name: {K: estimated loss increase}} of ``layers`` ([(name, module)]), on calibration ``batches``
    (``kbit.calibration.check_calibration``'s form). Layers no calibration input reached are absent."""
    from .calibration import collect_hessians_by_block, run_with_loss

    named = dict(layers)
    fisher = _output_fisher(model, named, batches, lambda loss_of: run_with_loss(model, batches, loss_of))
    out = {}

    def measure(hessians: dict) -> None:
        for name, H in hessians.items():
            layer = named[name]
            w = weight_of(layer).detach()
            rotation = rotations.get(id(layer))
            if rotation is not None:
                w, H = rotation.rotate(w.float()), rotation.hessian(H)
            f = None if fisher is None else fisher.get(name)
            if fisher is not None and f is None:  # ran forward, but no gradient reached it: it does not matter
                f = torch.zeros(w.shape[0])
            out[name] = _rounding_errors(w, H, f, gptq, damp)

    collect_hessians_by_block(model, named, batches, measure)
    return out


def choose_layer_bits(model: nn.Module, layers: list, bits, batches: Optional[list], weight_of: Callable,
                      rotations: dict, gptq: bool, damp: float) -> dict:
    """{id(layer): K} for ``layers`` ([(name, module)]) from ``bits``, a budget or a dict (``check_bits_setting``).

    A budget measures the layers on ``batches`` (``layer_sensitivities``); a layer no calibration input reached
    keeps the largest K whose uniform cost fits the budget, and the others share the rest.
    """
    shapes = {name: (weight_of(m).shape[0], weight_of(m).shape[1]) for name, m in layers}
    if isinstance(bits, dict):
        chosen, unmatched = {}, []
        for name, m in layers:
            k = next((k for key, k in bits.items()
                      if name == key or name.endswith("." + key) or fnmatch.fnmatchcase(name, key)), None)
            if k is None:
                unmatched.append(name)
            chosen[id(m)] = k
        if unmatched:
            raise ValueError(f"bits names no K for {len(unmatched)} layer(s), e.g. {unmatched[:3]}; add a key that "
                             "matches them (a name, a name suffix or an fnmatch pattern such as '*')")
        return chosen
    errors = layer_sensitivities(model, layers, batches, weight_of, rotations, gptq, damp)
    fallback = max(k for k in SUPPORTED_BITS if k + SCALE_BITS / BLOCK_SIZE <= bits)
    start = {name: fallback for name in shapes if name not in errors}
    errors.update({name: {k: 0.0 for k in SUPPORTED_BITS} for name in start})
    ks = allocate_bits(shapes, errors, bits, start)
    return {id(m): ks[name] for name, m in layers}
