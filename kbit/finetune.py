"""End-to-end tuning of a quantized model (``quantize_model(..., tune_steps=N)``): with every code fixed, each
``KbitLinear``'s codebook and block scales are tuned so that the quantized model's outputs match the unquantized
model's on the calibration data.

What is tuned is exactly what is saved. During tuning a layer's weight is computed as the storage format defines
it, ``W = codebook[code] * decode_e4m4(absmax) * scale`` (``kbit.formats``), from two free float32 tensors:

* ``levels``, the layer's 2**k codebook levels (starting at the stored codebook). The format wants levels with
  largest |value| exactly 1 that are fp16 values, so the stored codebook is ``levels / max|levels|`` rounded to
  fp16, and the peak ``max|levels|`` (the layer's overall magnitude) moves into the block scales;
* ``log_gain``, one per block of 32 (starting at 0): the stored block scale is
  ``E4M4(decode_e4m4(absmax) * exp(log_gain) * max|levels|)``, rounded to the nearest E4M4 value.

Both roundings pass the gradient straight through, so every loss Adam sees is the loss of a model the format
stores exactly; the per-tensor power-of-two ``scale`` is kept. The levels are kept strictly ascending (a code
keeps its meaning) and at least ``MIN_LEVEL_GAP`` apart. The loss is the KL divergence from the unquantized
model's next-token distribution to the quantized model's, over the reference's ``TOP_K`` most likely tokens plus
one bin for all the others (so the reference needs ``TOP_K`` values per token, not the vocabulary); a model whose
output has no ``logits`` (an encoder) matches its first output tensor instead (squared error relative to the
reference's). One step is one calibration sequence (one item of a list of model inputs); learning rates decay
linearly to 0. The tuned values are kept only if the loss over all the calibration data is lower than before
tuning; otherwise the model is left as quantized.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from ._validate import check_int
from .calibration import check_calibration, model_outputs, run_with_loss
from .formats import decode_absmax_e4m4, encode_absmax_e4m4, unpack_bitplanes
from .methods import MIN_LEVEL_GAP
from .weight import QuantizedWeight

__all__ = ["check_tune_steps", "tuning_batches", "reference_outputs", "tune_end_to_end", "tune_block"]

TOP_K = 128  # reference probabilities kept per token; the rest of the vocabulary is one bin of the KL
LEVEL_LR = 1e-3  # Adam's learning rate for the codebook levels (units of the block scale)
GAIN_LR = 2e-3  # and for the block scales' log-gains: an E4M4 step is a factor of 1 + 1/16 at most


def check_tune_steps(steps) -> int:
    """``tune_steps``: an int >= 0 (0: no tuning)."""
    return check_int(steps, "tune_steps", 0)


def tuning_batches(calibration) -> list:
    """The calibration data as ``check_calibration``'s ``(args, kwargs)`` batches of one step each: one sequence of
    token ids [n_seq, seq_len] per step, or one item of a list of model inputs."""
    if isinstance(calibration, Tensor):
        check_calibration(calibration)
        return [((calibration[i:i + 1],), {}) for i in range(calibration.shape[0])]
    return check_calibration(calibration)


# ----------------------------------------------------------------------------- the loss
def _output_tensor(output) -> Tensor:
    """The tensor an encoder's output is matched on: the output itself, or its first entry."""
    return output if isinstance(output, Tensor) else output[0]


def _reference_of(output):
    """What ``_loss`` compares a batch's output with: (top-k token ids, their log-probabilities) of the logits, or
    the output tensor in float32."""
    logits = getattr(output, "logits", None)
    if logits is not None:
        logp = torch.log_softmax(logits.detach().float(), dim=-1)
        top = torch.topk(logp, min(TOP_K, logp.shape[-1]), dim=-1)
        return top.indices, top.values
    return _output_tensor(output).detach().float()


def _loss(output, reference, mask: Optional[Tensor]) -> Tensor:
    """The batch's mean KL divergence (reference to model, top-k bins plus the rest) per real token, or the relative
    squared error of an encoder's output."""
    if isinstance(reference, tuple):
        ids, ref_logp = reference
        logq = torch.log_softmax(output.logits.float(), dim=-1).gather(-1, ids)
        p = ref_logp.exp()
        p_rest = (1.0 - p.sum(-1)).clamp(min=0.0)
        # log(1 - sum q) from the log-sum-exp of the top-k log-probabilities, without cancellation
        logq_rest = torch.log((-torch.expm1(torch.logsumexp(logq, dim=-1))).clamp(min=1e-30))
        kl = (p * (ref_logp - logq)).sum(-1) + p_rest * (torch.log(p_rest.clamp(min=1e-30)) - logq_rest)
        return kl[mask].mean() if mask is not None else kl.mean()
    out = _output_tensor(output).float()
    err, ref = (out - reference).pow(2).sum(-1), reference.pow(2).sum(-1)
    if mask is not None:
        err, ref = err[mask], ref[mask]
    return err.sum() / ref.sum().clamp(min=1e-30)


@torch.no_grad()
def reference_outputs(model: nn.Module, batches: list) -> list:
    """The unquantized model's reference for each of ``batches`` (``tuning_batches``), for ``tune_end_to_end``."""
    return [_reference_of(output) for output, _, _ in model_outputs(model, batches)]


@torch.no_grad()
def _mean_loss(model: nn.Module, batches: list, references: list) -> float:
    losses = [float(_loss(output, ref, mask))
              for (output, _, mask), ref in zip(model_outputs(model, batches), references)]
    return sum(losses) / len(losses)


# ----------------------------------------------------------------------------- a layer while it is tuned
def _straight_through(x: Tensor, rounded: Tensor) -> Tensor:
    """``rounded``'s value, ``x``'s gradient."""
    return x + (rounded - x).detach()


def _e4m4(x: Tensor) -> Tensor:
    """Nearest E4M4 value (saturating at 31), as the stored block scale will decode."""
    return decode_absmax_e4m4(encode_absmax_e4m4(x.detach()))


class _Gather(torch.autograd.Function):
    """``levels[codes] * block_scale[:, None]`` for int32 codes [blocks, 32]; the backward pass reuses the gathered
    levels (a gather over every weight costs more than the rest of this op)."""

    @staticmethod
    def forward(ctx, codes: Tensor, levels: Tensor, block_scale: Tensor) -> Tensor:
        ctx.levels_count = levels.numel()
        gathered = torch.index_select(levels, 0, codes.reshape(-1)).reshape(codes.shape)
        ctx.save_for_backward(codes, gathered, block_scale)
        return gathered * block_scale[:, None]

    @staticmethod
    def backward(ctx, grad: Tensor):
        codes, gathered, block_scale = ctx.saved_tensors
        grad_levels = grad.new_zeros(ctx.levels_count).index_add_(0, codes.reshape(-1),
                                                                  (grad * block_scale[:, None]).reshape(-1))
        return None, grad_levels, (grad * gathered).sum(dim=1)


class _TunedWeight(nn.Module):
    """A ``QuantizedWeight`` whose codebook and block scales are free (module docstring); codes and tensor scale
    stay as stored. ``weight()``: the [out, in] weight the format stores for the current values."""

    def __init__(self, qw: QuantizedWeight):
        super().__init__()
        packed, absmax = qw.storage()
        self.packed, self.bits, self.shape, self.dtype = packed, qw.bits, qw.shape, qw.dtype
        self.register_buffer("codes", unpack_bitplanes(packed, qw.bits).to(torch.int32))
        self.register_buffer("base_scale", decode_absmax_e4m4(absmax))
        self.register_buffer("tensor_scale", qw.scale.detach().clone())
        self.levels = nn.Parameter(qw.codebook.detach().clone().float())
        self.log_gain = nn.Parameter(torch.zeros_like(self.base_scale))

    def stored(self) -> tuple:
        """(codebook, block scales as E4M4 codes): what the format stores for the current values; the forward pass
        uses exactly these."""
        with torch.no_grad():
            peak = self.levels.abs().max()
            codebook = (self.levels / peak).half().float()
            absmax = encode_absmax_e4m4(self.base_scale * self.log_gain.exp() * peak)
        return codebook, absmax

    def weight(self) -> Tensor:
        peak = self.levels.abs().max()
        normalized = self.levels / peak
        codebook = _straight_through(normalized, normalized.detach().half().float())
        block = self.base_scale * self.log_gain.exp() * peak
        block = _straight_through(block, _e4m4(block))
        out_features, in_features = self.shape
        w = _Gather.apply(self.codes, codebook, block * self.tensor_scale).reshape(out_features, -1)
        return w[:, :in_features]

    @torch.no_grad()
    def keep_levels_apart(self) -> None:
        """Levels strictly ascending, at least ``MIN_LEVEL_GAP`` apart once divided by their peak (so they stay
        distinct as fp16 values): a code keeps its level."""
        gap = MIN_LEVEL_GAP * float(self.levels.abs().max())
        steps = torch.arange(self.levels.numel(), device=self.levels.device, dtype=torch.float32) * gap
        self.levels.copy_(torch.cummax(self.levels - steps, dim=0).values + steps)

    def quantized(self) -> QuantizedWeight:
        """The ``QuantizedWeight`` holding the tuned codebook and block scales (the codes as before)."""
        codebook, absmax = self.stored()
        return QuantizedWeight(self.packed, absmax, codebook, self.tensor_scale, self.bits, self.shape, self.dtype)


class _TunedLinear(_TunedWeight):
    """A ``KbitLinear`` being tuned: its ``_TunedWeight``, with bias and rotation as stored."""

    def __init__(self, layer):
        super().__init__(layer.qweight)
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        rotation = self.layer.rotation
        if rotation is not None:
            x = rotation.rotate(x)
        return nn.functional.linear(x, self.weight().to(x.dtype), self.layer.bias)

    def tuned_layer(self):
        """A ``KbitLinear`` holding the tuned codebook and block scales (the codes as before)."""
        return type(self.layer).from_quantized(self.quantized(), self.layer.bias, self.layer.rotation)


# ----------------------------------------------------------------------------- tuning
def _swap(model: nn.Module, new_of: dict) -> None:
    """Replace every module whose id is a key of ``new_of`` (under each of its names) with its value."""
    for name, m in list(model.named_modules(remove_duplicate=False)):
        if id(m) in new_of and name:
            model.set_submodule(name, new_of[id(m)])


@contextmanager
def _frozen_in_eval(module: nn.Module):
    """``module`` in eval mode (no dropout: the loss compares deterministic outputs) with its own trainable
    parameters frozen, both restored on leaving."""
    frozen = [p for p in module.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    training = module.training
    module.eval()
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)
        module.train(training)


def _adam_steps(tuned: list, batch_count: int, steps: int, seed: int, backward: Callable[[int], None]) -> None:
    """``steps`` Adam steps on the levels and gains of ``tuned`` (``_TunedWeight``s; rates decaying linearly to 0),
    one batch each, batches in seeded random order; ``backward(i)`` computes batch i's loss and its gradients."""
    optimizer = torch.optim.Adam([{"params": [t.levels for t in tuned], "lr": LEVEL_LR},
                                  {"params": [t.log_gain for t in tuned], "lr": GAIN_LR}])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / steps)
    order, perm = torch.Generator().manual_seed(seed), []
    for _ in range(steps):
        if not perm:
            perm = torch.randperm(batch_count, generator=order).tolist()
        i = perm.pop()
        optimizer.zero_grad(set_to_none=True)
        with torch.enable_grad():
            backward(i)
        optimizer.step()
        schedule.step()
        for t in tuned:
            t.keep_levels_apart()


def tune_end_to_end(model: nn.Module, layers: list, batches: list, references: list, steps: int,
                    seed: int = 0) -> dict:
    """Tune the codebooks and block scales of ``layers`` (``model``'s ``KbitLinear`` layers, each once) for
    ``steps`` Adam steps (module docstring), in place; ``references``: ``reference_outputs`` of the unquantized
    model on ``batches``. Returns ``{"loss_before", "loss_after", "kept"}`` (mean loss over all batches; ``kept``:
    whether the tuned values were kept, i.e. the loss went down). ``steps``: checked by the caller
    (``check_tune_steps``: ``quantize_model``)."""
    if not layers or not steps:
        return {"loss_before": math.nan, "loss_after": math.nan, "kept": False}
    tuned = {id(m): _TunedLinear(m) for m in layers}
    with _frozen_in_eval(model):
        _swap(model, tuned)
        try:
            before = _mean_loss(model, batches, references)
            _adam_steps(list(tuned.values()), len(batches), steps, seed, lambda i: run_with_loss(
                model, [batches[i]], lambda output, ids, mask: _loss(output, references[i], mask)))
            after = _mean_loss(model, batches, references)
            kept = after < before
            with torch.no_grad():
                result = {id(t): t.tuned_layer() if kept else t.layer for t in tuned.values()}
        except BaseException:
            _swap(model, {id(t): t.layer for t in tuned.values()})
            raise
    _swap(model, result)
    return {"loss_before": before, "loss_after": after, "kept": kept}


def tune_block(block: nn.Module, weights: dict, inputs: list, masks: list, targets: list, steps: int,
               seed: int = 0) -> Optional[dict]:
    """Tune the codebooks and block scales of one block's quantized weights so that the block's outputs on
    ``inputs`` match ``targets`` (relative squared error over the real tokens), for ``steps`` Adam steps of one
    batch each; the block itself is not changed.

    ``weights``: ``{name: (qw, rotation, transposed)}`` for the block's parameters named ``name`` (as
    ``block.named_parameters`` names them) that hold a ``QuantizedWeight`` ``qw``, stored in the basis rotated
    by ``rotation`` (or None) and, where ``transposed``, as the [in, out] transpose of the format's [out, in].
    ``inputs``: ``[(args, kwargs)]`` of the block; ``masks``: each batch's real tokens (or None); ``targets``: the
    outputs wanted, one per batch. Returns ``{name: tuned QuantizedWeight}``, or None where tuning did not lower
    the mean loss over all batches. ``steps``: checked by the caller (``quantize_model``'s ``block_tune_steps``).
    """
    if not weights or not steps:
        return None
    tuned = {name: _TunedWeight(qw) for name, (qw, _, _) in weights.items()}
    dtypes = {name: p.dtype for name, p in block.named_parameters() if name in weights}
    references = [_output_tensor(t).detach().float() for t in targets]

    def run(i: int):
        params = {}
        for name, t in tuned.items():
            _, rotation, transposed = weights[name]
            w = t.weight() if rotation is None else rotation.unrotate(t.weight())
            params[name] = (w.T if transposed else w).to(dtypes[name])
        args, kwargs = inputs[i]
        return _loss(torch.func.functional_call(block, params, args, kwargs), references[i], masks[i])

    def mean_loss() -> float:
        with torch.no_grad():
            return sum(float(run(i)) for i in range(len(inputs))) / len(inputs)

    with _frozen_in_eval(block):
        before = mean_loss()
        _adam_steps(list(tuned.values()), len(inputs), steps, seed, lambda i: run(i).backward())
        if mean_loss() >= before:
            return None
        return {name: t.quantized() for name, t in tuned.items()}
