"""Calibration: the input Hessians of a model's Linear layers, and quantizing the layers with a method.

``quantize_layers`` is what ``kbit.quantize_model(model, bits, method=..., calibration=...)`` runs for the methods
other than ``"rtn"``. For ``"gptq"`` it needs each layer's input Hessian ``H = 2 X^T X / n`` over calibration
inputs. Quantization errors compound through depth, so a model whose layers sit in a list of blocks (a
transformer's ``model.layers`` / ``encoder.layer``) is calibrated block by block: block i's Hessians come from
the inputs that the already-quantized blocks before it produce, which lets GPTQ compensate for them too. Inside a
block, the layers are quantized in the order they run, in groups that share one input (q/k/v projections,
gate/up), each group with the Hessians of a pass of the block in which the groups before it are quantized (a
pass sums only that group's Hessians and, from the second batch on, stops once the group ran; one more pass gives
the quantized block's outputs to the next block). While that runs, a quantized layer's weight is temporarily
replaced by its dequantized value; every original weight is back in place when ``quantize_layers`` returns or
raises, so the model changes only when ``quantize_model`` swaps in the finished layers.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Iterable, Optional

import torch
from torch import Tensor, nn

from ._validate import check_int
from .methods import quantize_tensor_checked, weight_for_fp_inputs
from .rotation import Rotation
from .weight import QuantizedWeight

__all__ = ["collect_hessians", "collect_hessians_by_block", "quantize_layers", "check_calibration", "model_outputs",
           "run_with_loss", "uses_calibration", "check_calibration_used", "check_gptq_refinements"]

CALIBRATION_BATCH = 8  # sequences per forward pass when calibration is a tensor of token ids


# ----------------------------------------------------------------------------- running the model
def uses_calibration(method: str, bits, tune_steps: int) -> bool:
    """Whether quantizing with these (checked) settings runs calibration data through the model: ``method="gptq"``,
    a bit budget (a float ``bits``: per-layer sensitivities) or end-to-end tuning."""
    return method == "gptq" or isinstance(bits, float) or tune_steps > 0


def check_calibration_used(calibration, method: str, bits, tune_steps: int) -> None:
    """Refuse calibration data that these (checked) settings would not use: it would be silently ignored."""
    if calibration is not None and not uses_calibration(method, bits, tune_steps):
        raise ValueError(f"calibration is used by method='gptq', bit budgets and tune_steps only, got "
                         f"method={method!r}, bits={bits!r} and tune_steps={tune_steps}")


def check_gptq_refinements(method: str, fp_targets, block_tune_steps) -> tuple:
    """``(fp_targets, block_tune_steps)`` checked: a bool and an int >= 0, both refinements of the (checked)
    ``method="gptq"`` only (``quantize_layers``' ``fp_targets`` and ``block_tuner``), so set with another method
    they are refused rather than silently ignored."""
    if not isinstance(fp_targets, bool):
        raise TypeError(f"fp_targets must be a bool, got {type(fp_targets).__name__}")
    block_tune_steps = check_int(block_tune_steps, "block_tune_steps", 0)
    if (fp_targets or block_tune_steps) and method != "gptq":
        raise ValueError(f"fp_targets and block_tune_steps refine method='gptq', got method={method!r} with "
                         f"fp_targets={fp_targets} and block_tune_steps={block_tune_steps}")
    return fp_targets, block_tune_steps


def check_calibration(calibration) -> list:
    """The calibration data as a list of ``(args, kwargs)`` model inputs; raises on anything else.

    Accepted: token ids [n_seq, seq_len] (run ``CALIBRATION_BATCH`` sequences at a time), or a list whose items
    are dicts of keyword inputs (a tokenizer's output) or tensors (the model's first argument).
    """
    if isinstance(calibration, Tensor):
        if calibration.dim() < 2 or calibration.shape[0] == 0 or calibration.shape[1] == 0:
            raise ValueError(f"calibration must be token ids [n_seq, seq_len] with n_seq, seq_len >= 1, got shape "
                             f"{tuple(calibration.shape)}")
        return [((calibration[s:s + CALIBRATION_BATCH],), {})
                for s in range(0, calibration.shape[0], CALIBRATION_BATCH)]
    if isinstance(calibration, (list, tuple)):
        if not calibration:
            raise ValueError("calibration must hold at least one batch, got an empty list")
        batches = []
        for item in calibration:
            if isinstance(item, dict):
                batches.append(((), dict(item)))
            elif isinstance(item, Tensor):
                batches.append(((item,), {}))
            else:
                raise TypeError(f"calibration items must be dicts of model inputs or tensors, got {type(item).__name__}")
        return batches
    raise TypeError("calibration must be token ids [n_seq, seq_len] or a list of dicts of model inputs, got "
                    f"{type(calibration).__name__}")


class _StopForward(Exception):
    """Raised by a hook to end a forward pass once the inputs it needs are captured."""


def _device_of(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


def _token_mask(kwargs: dict) -> Optional[Tensor]:
    """The batch's 2-D ``attention_mask`` as bool [batch, seq] (the real tokens), or None."""
    mask = kwargs.get("attention_mask")
    return mask.bool() if isinstance(mask, Tensor) and mask.dim() == 2 else None


def _run(model: nn.Module, batches: list, hooks: Optional["_HessianHooks"] = None) -> None:
    """The model's forward pass over every batch (``use_cache=False`` where it takes it); hooks do the work."""
    device = _device_of(model)
    takes_use_cache = "use_cache" in inspect.signature(model.forward).parameters
    for args, kwargs in batches:
        if hooks is not None:
            hooks.start_batch(_token_mask(kwargs))
        args = tuple(a.to(device) if isinstance(a, Tensor) else a for a in args)
        kwargs = {key: v.to(device) if isinstance(v, Tensor) else v for key, v in kwargs.items()}
        if takes_use_cache:
            kwargs.setdefault("use_cache", False)
        try:
            model(*args, **kwargs)
        except _StopForward:
            pass


class _HessianHooks:
    """Forward hooks summing ``X^T X`` (float32, on the layer's device) and the row count of each layer's input.

    ``first_inputs`` keeps each layer's first input tensor, in the order the layers ran: layers fed the very
    same tensor (q/k/v projections, gate/up) form one group of ``first_group``. ``start_batch(mask)`` before each
    batch; ``mask``: its real tokens (bool [batch, seq]); an input of that leading shape counts only their rows,
    not the padding's. ``first_group_only``: sum only for the layers of ``first_group`` (the others' sums would be
    thrown away), and from the second batch on, end the forward pass (``_StopForward``) when a layer outside the
    group runs after each layer of the group ran as often as in the first batch (which runs whole: the group and
    its calls are known). ``targets``: where set (name -> the unquantized model's input of that layer on the
    current batch), the hooks also sum ``(X_fp - X)^T X`` per layer (``crosses``).
    """

    def __init__(self, layers: dict, first_group_only: bool = False):
        self.sums, self.counts, self.first_inputs, self.crosses = {}, {}, {}, {}
        self.mask: Optional[Tensor] = None
        self.targets: Optional[dict] = None
        self.paused = False  # while the unquantized block runs
        self.first_group_only = first_group_only
        self.batch, self.first_calls, self.calls = -1, {}, {}  # calls per layer of the group: first batch, this one
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in layers.items()]

    def start_batch(self, mask: Optional[Tensor]) -> None:
        self.mask, self.batch, self.calls = mask, self.batch + 1, {}

    def first_group(self) -> list:
        """Names of the layers that ran first, all on the same input."""
        if not self.first_inputs:
            return []
        first = next(iter(self.first_inputs.values()))
        return [n for n, x in self.first_inputs.items() if x is first]

    def _group_ran(self) -> bool:
        """From the second batch on: each layer of the group ran as often as in the first batch."""
        return self.batch > 0 and bool(self.first_calls) and all(
            self.calls.get(n, 0) >= c for n, c in self.first_calls.items())

    def _hook(self, name: str):
        def hook(module, inputs, output):
            if self.paused:
                return
            first = self.first_inputs.setdefault(name, inputs[0])
            if self.first_group_only and first is not next(iter(self.first_inputs.values())):
                # not in first_group (the same test first_group makes)
                if self._group_ran():
                    raise _StopForward
                return
            self.calls[name] = self.calls.get(name, 0) + 1
            if self.batch == 0:
                self.first_calls[name] = self.calls[name]
            x = self._rows(inputs[0])
            if name not in self.sums:
                self.sums[name] = torch.zeros(x.shape[1], x.shape[1], device=x.device)
                self.counts[name] = 0
            self.sums[name].addmm_(x.T, x)
            self.counts[name] += x.shape[0]
            if self.targets is not None and name in self.targets:
                if name not in self.crosses:
                    self.crosses[name] = torch.zeros_like(self.sums[name])
                self.crosses[name].addmm_((self._rows(self.targets[name]) - x).T, x)
        return hook

    def _rows(self, x: Tensor) -> Tensor:
        """An input as float32 rows [n, features], the padding's rows left out."""
        x = x.detach()
        if self.mask is not None and tuple(x.shape[:-1]) == tuple(self.mask.shape):
            x = x[self.mask.to(x.device)]
        return x.to(torch.float32).reshape(-1, x.shape[-1])

    def remove(self) -> dict:
        """Unhook; ``{name: 2 X^T X / n}`` of the layers that saw at least one input (``crosses`` scaled alike)."""
        for h in self.handles:
            h.remove()
        self.handles = []
        for n, c in self.crosses.items():
            c.mul_(2.0 / self.counts[n])
        return {n: s.mul_(2.0 / self.counts[n]) for n, s in self.sums.items() if self.counts[n]}


class _InputCapture:
    """Forward hooks keeping each layer's input of the last forward pass (``inputs``: name -> tensor)."""

    def __init__(self, layers: dict):
        self.inputs = {}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in layers.items()]

    def _hook(self, name: str):
        def hook(module, inputs, output):
            self.inputs[name] = inputs[0].detach()
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def collect_hessians(model: nn.Module, layers: dict, calibration) -> dict:
    """``{name: H}``, ``H = 2 X^T X / n`` [in, in] float32, of each of ``layers`` (name -> module) over
    ``calibration`` (``check_calibration``'s forms). A layer that no input reached is absent."""
    return _hessians_over(model, layers, check_calibration(calibration))


def _hessians_over(model: nn.Module, layers: dict, batches: list) -> dict:
    hooks = _HessianHooks(layers)
    try:
        with torch.no_grad():
            _run(model, batches, hooks)
    finally:
        hessians = hooks.remove()
    return hessians


def model_outputs(model: nn.Module, batches: list):
    """The model's output on each batch in turn (``use_cache=False`` where it takes it), as ``(output, ids, mask)``
    (``ids``: the batch's token ids, or None; ``mask``: its real tokens, or None)."""
    device = _device_of(model)
    takes_use_cache = "use_cache" in inspect.signature(model.forward).parameters
    for args, kwargs in batches:
        args = tuple(a.to(device) if isinstance(a, Tensor) else a for a in args)
        kwargs = {key: v.to(device) if isinstance(v, Tensor) else v for key, v in kwargs.items()}
        if takes_use_cache:
            kwargs.setdefault("use_cache", False)
        ids = args[0] if args and isinstance(args[0], Tensor) else kwargs.get("input_ids")
        yield model(*args, **kwargs), ids, _token_mask(kwargs)


def run_with_loss(model: nn.Module, batches: list, loss_of: Callable) -> None:
    """Forward and backward passes over the batches: ``loss_of(output, ids, mask)`` gives each batch's scalar loss
    (``model_outputs``' ids and mask), or None to stop there without a backward pass. The caller enables gradients
    where it needs them; hooks collect what it needs."""
    for output, ids, mask in model_outputs(model, batches):
        loss = loss_of(output, ids, mask)
        if loss is None:
            return
        loss.backward()


# ----------------------------------------------------------------------------- sequential calibration
def _block_list(model: nn.Module, names: list):
    """``(prefix, ModuleList)`` whose children hold the most of ``names``, in at least two children; or None."""
    best, best_count = None, 0
    for prefix, m in model.named_modules():
        if not prefix or not isinstance(m, nn.ModuleList) or len(m) < 2:
            continue
        inside = [n[len(prefix) + 1:].split(".", 1)[0] for n in names if n.startswith(prefix + ".")]
        if len(set(inside)) >= 2 and len(inside) > best_count:
            best, best_count = (prefix, m), len(inside)
    return best


def _capture_inputs(model: nn.Module, block: nn.Module, batches: list) -> list:
    """``[(args, kwargs)]`` that ``block`` receives over the batches; the forward pass stops right there."""
    captured = []

    def pre_hook(module, args, kwargs):
        captured.append((args, dict(kwargs)))
        raise _StopForward

    handle = block.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        _run(model, batches)
    finally:
        handle.remove()
    return captured


def _block_pass(block: nn.Module, inputs: list, masks: list, layers: dict, fp=None, first_group_only: bool = False):
    """Run ``block`` on every captured input with Hessian hooks on ``layers``: (outputs, Hessians, the hooks).

    ``fp``: ``(fp_inputs, substitution, crosses)``, the unquantized model's inputs of this block, the weights
    swapped in so far and whether to collect the cross terms. Before each batch the block runs once more, on the
    unquantized model's input with the original weights; the hooks then also collect ``crosses``
    (``_HessianHooks``) where asked. ``first_group_only`` as ``_HessianHooks``; the outputs are then None (the
    passes may have stopped early; the unquantized block's always run whole). Returns (outputs, Hessians, the
    hooks, the unquantized block's outputs or None).
    """
    hooks = _HessianHooks(layers, first_group_only)
    fp_outputs = None if fp is None else []
    try:
        outputs = []
        for b, ((a, kw), mask) in enumerate(zip(inputs, masks)):
            if fp is not None:
                fp_inputs, substitution, crosses = fp
                capture, hooks.paused = _InputCapture(layers if crosses else {}), True
                try:
                    with substitution.originals_in_place():
                        fa, fkw = fp_inputs[b]
                        fp_outputs.append(block(*fa, **fkw))
                finally:
                    capture.remove()
                    hooks.paused = False
                hooks.targets = capture.inputs if crosses else None
            hooks.start_batch(mask)
            try:
                outputs.append(block(*a, **kw))
            except _StopForward:
                pass
    finally:
        hessians = hooks.remove()
    return None if first_group_only else outputs, hessians, hooks, fp_outputs


def _with_hidden(args: tuple, kwargs: dict, output):
    """The next block's inputs: the same arguments with the hidden states replaced by ``output``'s."""
    hidden = output[0] if isinstance(output, (tuple, list)) else output
    if args:
        return (hidden,) + tuple(args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


class _WeightSubstitution:
    """Puts dequantized weights in place of layers' weights and the originals back (``restore``)."""

    def __init__(self, weight_of: Callable[[nn.Module], Tensor]):
        self.weight_of, self.originals = weight_of, []

    def put(self, layer: nn.Module, qw: QuantizedWeight, rotation: Optional[Rotation]) -> None:
        """``qw`` dequantized in place of the layer's weight (its original kept aside the first time)."""
        param = layer.weight
        if all(p is not param for p, _ in self.originals):
            self.originals.append((param, param.data))
            param.data = param.data.clone()  # written through the [out, in] view, whatever the layer's own layout
        view = self.weight_of(layer)
        w = qw.dequantize(torch.float32)
        view.copy_((w if rotation is None else rotation.unrotate(w)).to(device=view.device, dtype=view.dtype))

    def restore(self) -> None:
        for w, data in reversed(self.originals):
            w.data = data
        self.originals = []

    @contextlib.contextmanager
    def originals_in_place(self):
        """The original weights in place for the duration (the unquantized model), the dequantized ones after."""
        swapped = [(w, w.data) for w, _ in self.originals]
        for w, data in self.originals:
            w.data = data
        try:
            yield
        finally:
            for w, data in swapped:
                w.data = data


def collect_hessians_by_block(model: nn.Module, layers: dict, batches: list, measure: Callable[[dict], None]) -> None:
    """``measure({name: H})`` for the layers (name -> module) of each block of the unquantized model in turn (the
    Hessians of one block at a time in memory), then for the layers outside the blocks; see ``collect_hessians``."""
    with torch.no_grad():
        blocks = _block_list(model, list(layers))
        done = set()
        if blocks is not None:
            prefix, block_list = blocks
            inputs = _capture_inputs(model, block_list[0], batches)
            masks = [_token_mask(kw) for _, kw in batches]
            for i, block in enumerate(block_list):
                mine = {n: m for n, m in layers.items() if n.startswith(f"{prefix}.{i}.")}
                outputs, hessians, _, _ = _block_pass(block, inputs, masks, mine)
                measure(hessians)
                done.update(mine)
                inputs = [_with_hidden(a, kw, out) for (a, kw), out in zip(inputs, outputs)]
        rest = {n: m for n, m in layers.items() if n not in done}
        if rest:
            measure(_hessians_over(model, rest, batches))


def quantize_layers(model: nn.Module, layers: list, k, method: str, codebook: Optional[Tensor] = None,
                    calibration=None, on_layer: Optional[Callable[[], None]] = None,
                    weight_of: Callable[[nn.Module], Tensor] = lambda layer: layer.weight,
                    rotations: Optional[dict] = None, fp_targets: bool = False,
                    block_tuner: Optional[Callable] = None) -> dict:
    """``{id(layer): QuantizedWeight}`` for ``layers`` (``[(name, module)]``, one entry per module), at ``k`` bits:
    an int, or ``{id(layer): K}`` per layer (``k`` and ``codebook`` as ``kbit.quantize_model`` checked them).

    ``weight_of(layer)`` is the layer's weight in ``nn.Linear``'s [out, in] layout (a transposed view for
    transformers' ``Conv1D``); the layer's input is its forward's first argument. ``rotations``: ``{id(layer):
    Rotation}`` of the layers to quantize rotated (``kbit.rotation``); their QuantizedWeight holds ``W @ R``,
    chosen with the Hessian of the rotated inputs.

    ``"mse"`` quantizes each weight on its own; ``"gptq"`` runs ``calibration`` through the model (block by block
    where the layers sit in a list of blocks, see the module docstring). GPTQ runs on the GPU when there is one,
    whatever device the model is on. ``on_layer`` is called after each layer (a progress bar). The model's
    weights are unchanged when this returns or raises.

    ``fp_targets`` (gptq, layers inside blocks): each layer's target is the unquantized model's output on the
    unquantized model's inputs, not its own weight on the inputs the quantized layers before it produce
    (``weight_for_fp_inputs``); the unquantized model runs beside the quantized one, block by block.
    ``block_tuner`` (gptq, layers inside blocks): once a block's layers are quantized, ``block_tuner(block, weights,
    inputs, masks, targets)`` (``kbit.finetune.tune_block`` with its steps) tunes their codebooks and block scales
    so that the block's outputs match the unquantized model's, before the next block is calibrated on them.
    """
    if method == "rtn":
        raise ValueError("quantize_layers is for the methods other than 'rtn' (kbit.quantize_model does that one)")
    result = {}
    rotations = rotations or {}

    def quantize(name: str, layer: nn.Module, hessian: Optional[Tensor], cross: Optional[Tensor] = None
                 ) -> QuantizedWeight:
        w = weight_of(layer).detach()
        label = f"{name or type(layer).__name__}.weight"
        rotation, bits = rotations.get(id(layer)), k if isinstance(k, int) else k[id(layer)]
        if cross is not None and hessian is not None:  # where GPTQ runs: a solve of H's size
            on = "cuda" if method == "gptq" and torch.cuda.is_available() else w.device
            w = weight_for_fp_inputs(w.to(on), hessian.to(on), cross.to(on)).to(device=w.device, dtype=w.dtype)
        if rotation is not None:
            w = rotation.rotate(w.float()).to(w.dtype)
            hessian = None if hessian is None else rotation.hessian(hessian)
        if method == "gptq" and hessian is None:  # calibration never reached it: nothing to weigh the error by
            qw = quantize_tensor_checked(w, bits, "mse", codebook, name=label)
        elif method == "gptq" and torch.cuda.is_available() and w.device.type != "cuda":
            qw = quantize_tensor_checked(w.cuda(), bits, method, codebook, hessian.cuda(), name=label).to(w.device)
        else:
            qw = quantize_tensor_checked(w, bits, method, codebook, hessian, name=label)
        result[id(layer)] = qw
        if on_layer is not None:
            on_layer()
        return qw

    if method == "mse":
        for name, layer in layers:
            quantize(name, layer, None)
        return result

    batches = check_calibration(calibration)
    substitution = _WeightSubstitution(weight_of)

    def tune(block: nn.Module, mine: list, inputs: list, masks: list, targets: list) -> None:
        names = {id(p): n for n, p in block.named_parameters(remove_duplicate=False)}
        weights = {names[id(layer.weight)]: (result[id(layer)], rotations.get(id(layer)),
                                            weight_of(layer) is not layer.weight) for _, layer in mine}
        tuned = block_tuner(block, weights, inputs, masks, targets)
        for _, layer in mine if tuned is not None else []:
            qw = result[id(layer)] = tuned[names[id(layer.weight)]]
            substitution.put(layer, qw, rotations.get(id(layer)))

    try:
        with torch.no_grad():
            blocks = _block_list(model, [n for n, _ in layers])
            done = set()
            if blocks is not None:
                prefix, block_list = blocks
                inputs = _capture_inputs(model, block_list[0], batches)
                # the unquantized model's inputs, block by block
                fp_inputs = inputs if fp_targets or block_tuner is not None else None
                masks = [_token_mask(kw) for _, kw in batches]
                for i, block in enumerate(block_list):
                    remaining = dict((n, m) for n, m in layers if n.startswith(f"{prefix}.{i}."))
                    fp_next = None
                    while True:  # one pass per group of layers, and one for the output of the quantized block
                        with_fp = fp_inputs is not None and (remaining or fp_next is None)
                        # Only the first group is quantized after a pass (the later groups' inputs change with it):
                        # those passes sum only its Hessians and may stop early; the last one gives the outputs.
                        outputs, hessians, hooks, fp_outputs = _block_pass(
                            block, inputs, masks, remaining, (fp_inputs, substitution, fp_targets) if with_fp else None,
                            first_group_only=bool(remaining))
                        if with_fp:
                            fp_next = fp_outputs  # the unquantized block's outputs (all its weights original)
                        if not remaining:
                            break
                        group = hooks.first_group() or list(remaining)  # layers never run: quantized with "mse"
                        crosses = hooks.crosses
                        del hooks  # its first inputs
                        for name in group:
                            layer = remaining.pop(name)
                            substitution.put(layer, quantize(name, layer, hessians.get(name), crosses.get(name)),
                                             rotations.get(id(layer)))
                            done.add(name)
                        if not remaining and block_tuner is not None:
                            mine = [(n, m) for n, m in layers if n.startswith(f"{prefix}.{i}.")]
                            tune(block, mine, inputs, masks, fp_next)
                        if not remaining and i + 1 == len(block_list):
                            break  # nothing reads the last block's output
                    if i + 1 < len(block_list):  # the next block's inputs
                        inputs = [_with_hidden(a, kw, out) for (a, kw), out in zip(inputs, outputs)]
                        if fp_inputs is not None:
                            fp_inputs = [_with_hidden(a, kw, out) for (a, kw), out in zip(fp_inputs, fp_next)]
            rest = [(n, m) for n, m in layers if n not in done]
            if rest:  # outside the blocks (or no blocks): one pass of the model as quantized so far
                hessians = _hessians_over(model, dict(rest), batches)
                for name, layer in rest:
                    quantize(name, layer, hessians.get(name))
    finally:
        substitution.restore()
    return result
