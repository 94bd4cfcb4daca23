"""``from_pretrained(kbit_folder, tp_plan="auto")``: transformers' tensor-parallel loading of a kbit folder, each rank
reading only its shard of every kbit weight.

transformers (5.2x: ``HfQuantizer.update_parallel_plan``) builds the model on the meta device, applies its
``tp_plan`` to it (each style turns the parameters it shards into meta DTensors: placeholders whose placements tell
the loader which slice of each checkpoint tensor this rank reads, via safetensors slices) and then loads. kbit's
storage is buffers its styles do not know, so ``KbitHfQuantizer.update_parallel_plan`` gives the kbit layers
kbit's styles instead (``kbit_colwise``, ``kbit_rowwise``, ``kbit_moe_tp_experts``, and for a quantized ``lm_head``
``kbit_colwise_gather_output``), whose placeholders describe the storage as ``kbit.tensor_parallel`` splits it:

* column parallel: ``packed`` and ``absmax`` (rows after rows, flat) ``Shard(0)``: a contiguous run of whole rows;
  the bias ``Shard(0)``. A gathered-output layer (an ``lm_head``) the same, its output gathered on every rank.
* row parallel: ``packed`` and ``absmax`` ``_StridedShard(0, split_factor=out_features)``: in every row (a group),
  this rank's run of whole blocks; ``rotation_signs`` ``Shard(0)``. A layer whose shards would cut a block (of 32 or
  of its Hadamard transform) gets no placeholders: it loads whole and gathers its input.
* experts: ``*_packed`` / ``*_absmax`` [E, ...] ``_StridedShard(1, ...)``: gate and up halves (2 groups) of every
  expert for ``gate_up``, every row (H groups) of ``down``.
* codebook, scales, ``meta``: whole on every rank.

Once loaded (``finish_loading``, from ``_process_model_after_weight_loading``), each kbit layer's local tensors become
a ``kbit.tensor_parallel`` sharded layer (checked as untrusted input like any load; its GEMM layout derived on its
device), and the plan gets transformers' own style names back (``generate`` reads them to size the KV cache).

``from_pretrained(model_id, quantization_config=KbitConfig(bits=4), tp_plan="auto")``: the layers quantized while
loading get ``kbit_quantize_<style>``, which places nothing, so every rank reads each full-precision weight whole and
quantizes it alike (shards quantized apart would each get their own scale); ``finish_loading`` keeps this rank's shard.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer
from transformers.quantizers.base import HfQuantizer

from .. import tensor_parallel as tp
from ..formats import meta_tensor
from ..moe import KbitExperts
from ..nn import KbitLinear, fuse_projections, has_groups
from ..rotation import Rotation
from ..weight import QuantizedWeight

PREFIX = "kbit_"
QUANTIZE = "quantize_"  # kbit_quantize_<style>: a layer quantized while loading, then split <style>'s way
_KBIT_STYLES = {KbitLinear: tp.LINEAR_STYLES, KbitExperts: (tp.EXPERTS,)}
_SPLITS = tp.LINEAR_STYLES + (tp.EXPERTS,)


def _placeholder(module, name: str, mesh, placement) -> None:
    module._buffers[name] = distribute_tensor(module._buffers[name], mesh, [placement], src_data_rank=None)


class KbitParallel(TensorParallelLayer):
    """A kbit layer's placeholders for one of ``tensor_parallel``'s splits; the layer itself is built after
    loading (``finish_loading``), so nothing wraps its forward."""

    def __init__(self, style: str):
        self.style = style

    def shard_param(self, module, param, mesh):  # the bias; the weights' counts (kbit._counted) hold nothing
        bias = module._parameters.get(param) if param == "bias" else None
        if bias is not None and self.style in tp.COLUMN_STYLES:
            module._parameters[param] = torch.nn.Parameter(
                distribute_tensor(bias, mesh, [Shard(0)], src_data_rank=None), requires_grad=bias.requires_grad)

    def install_forward(self, module, mesh):
        if isinstance(module, KbitExperts):
            self._experts(module, mesh)
        elif isinstance(module, KbitLinear):
            self._linear(module, mesh)
        else:
            raise ValueError(f"the tp_plan gives kbit's {self.style!r} style to a {type(module).__name__}")
        return module

    def _linear(self, layer: KbitLinear, mesh) -> None:
        cls, _ = tp.linear_split(self.style, (layer.out_features, layer.in_features), mesh.size(),
                                 int(getattr(layer, "_kbit_head_dim", 1)), layer._block)
        if cls is None:
            return  # whole on every rank
        layer._kbit_tp = (cls, mesh)
        if issubclass(cls, tp.ColumnParallelKbitLinear):
            for key in ("packed", "absmax"):
                _placeholder(layer, key, mesh, Shard(0))
        elif cls is tp.RowParallelKbitLinear:
            for key in ("packed", "absmax"):
                _placeholder(layer, key, mesh, _StridedShard(0, split_factor=layer.out_features))
            if layer.rotation_signs is not None:
                _placeholder(layer, "rotation_signs", mesh, Shard(0))

    def _experts(self, experts: KbitExperts, mesh) -> None:
        if tp.experts_split_problem(experts, mesh.size()):
            return  # whole on every rank
        experts._kbit_tp = (tp.TensorParallelKbitExperts, mesh)
        for key in ("packed", "absmax"):
            _placeholder(experts, f"gate_up_{key}", mesh, _StridedShard(1, split_factor=2))
            _placeholder(experts, f"down_{key}", mesh, _StridedShard(1, split_factor=experts.hidden_dim))


class QuantizeWhileLoadingParallel(TensorParallelLayer):
    """A layer kbit quantizes while loading under a tp_plan, to be split ``style``'s way: no placeholders, so every
    rank reads its full-precision weight whole and quantizes it alike (quantizing shards apart would give each its own
    scale); ``finish_loading`` then cuts this rank's shard as ``shard_model`` does. A style kbit does not split by
    (``None``) leaves the quantized layer whole on every rank."""

    def __init__(self, style: Optional[str]):
        self.style = style

    def install_forward(self, module, mesh):
        left = module.__dict__.get("_kbit_left_in_full_precision")
        if left is not None:
            key, name = left
            raise ValueError(f"tp_plan entry {key!r} names layers kbit quantizes while loading and {name}, which it "
                             f"does not (skip, min_features): quantize with these settings on one process, save the "
                             f"kbit folder, and load that with tp_plan='auto'")
        if self.style is not None:
            module._kbit_tp_whole = (self.style, mesh)  # the quantized layer that replaces it takes this over
        return module


def register() -> None:
    for style in _SPLITS:
        ALL_PARALLEL_STYLES.register(PREFIX + style, KbitParallel(style))
        ALL_PARALLEL_STYLES.register(PREFIX + QUANTIZE + style, QuantizeWhileLoadingParallel(style))
    ALL_PARALLEL_STYLES.register(PREFIX + QUANTIZE + "whole", QuantizeWhileLoadingParallel(None))


def kbit_plan(model, plan: dict, to_quantize=frozenset()) -> None:
    """Give the kbit layers of ``model`` that ``plan`` (transformers' ``tp_plan``, keys with ``*``) shards kbit's
    styles, in place, and the layers ``to_quantize`` while loading the styles that read them whole. A plan entry that
    names layers quantized while loading and a layer left in full precision (``skip``, ``min_features``) refuses to
    be applied (a tp_plan load; one process never applies it): transformers would shard that one's weight while the
    others are cut only after quantization."""
    register()
    original = model.__dict__.setdefault("_kbit_original_styles", {})  # finish_loading puts them back
    wanted = {}  # plan key -> {the kbit style a layer it names needs ("": transformers' own serves): those layers}
    for name, module in model.named_modules():
        key = next((k for k in plan if tp._pattern(k).fullmatch(name)), None)
        if key is None or key in original:
            continue
        if isinstance(module, KbitLinear) or name in to_quantize:  # an attention projection splits at whole heads
            module._kbit_head_dim = tp._head_dim(model, name)
        styles = next((s for cls, s in _KBIT_STYLES.items() if isinstance(module, cls)), ())
        if name in to_quantize:
            want = QUANTIZE + (plan[key] if plan[key] in _SPLITS else "whole")
            # Its parameters' own plan entries (an experts module's "packed_colwise" gate_up_proj) read them whole too.
            for param, _ in module.named_parameters(recurse=False):
                param_key = next((k for k in plan if tp._pattern(k).fullmatch(f"{name}.{param}")), None)
                if param_key is not None and param_key not in original:
                    wanted.setdefault(param_key, {}).setdefault(QUANTIZE + "whole", []).append(f"{name}.{param}")
        else:
            want = plan[key] if plan[key] in styles else ""
        wanted.setdefault(key, {}).setdefault(want, []).append(name)
    for key, wants in wanted.items():
        quantized = next((w for w in wants if w.startswith(QUANTIZE)), None)
        if quantized is not None:  # a layer it names but leaves in full precision refuses a tp_plan (install_forward)
            for name in wants[""] if "" in wants else ():
                model.get_submodule(name)._kbit_left_in_full_precision = (key, name)
        want = quantized or next((w for w in wants if w), "")
        if want:
            original[key] = plan[key]
            plan[key] = PREFIX + want


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def _shard_quantized_whole(model, name: str, module, style: str, mesh) -> None:
    """Replace the layer ``name``, quantized whole while loading, by this rank's shard of it (``shard_model``'s)."""
    group = tp.RankGroup(mesh.get_group())
    if isinstance(module, KbitExperts) and style == tp.EXPERTS:
        new, _ = tp._shard_experts(module, group)
    elif isinstance(module, KbitLinear) and style in tp.LINEAR_STYLES:
        new, _ = tp._shard_linear(module, style, group, int(getattr(module, "_kbit_head_dim", 1)), name)
    else:
        raise ValueError(f"{name}: a {type(module).__name__} planned {style!r} was to be quantized while loading "
                         f"and was not")
    model.set_submodule(name, new)


def finish_loading(model) -> None:
    """Replace each kbit layer loaded under kbit's styles by its sharded layer, and restore the plan's names."""
    if (getattr(model, "_tp_size", None) or 1) > 1 and not hasattr(HfQuantizer, "update_parallel_plan"):
        raise ValueError("this transformers applies its tp_plan to kbit layers without asking kbit (no "
                         "HfQuantizer.update_parallel_plan): load without tp_plan and shard with "
                         "kbit.tensor_parallel.shard_model, or use a transformers that has it")
    fused, sharded = has_groups(model), False
    for name, module in list(model.named_modules()):
        whole = module.__dict__.pop("_kbit_tp_whole", None)
        if whole is not None:  # quantized while loading, whole on every rank: this rank's shard of it
            _shard_quantized_whole(model, name, module, *whole)
            sharded = True
            continue
        pending = module.__dict__.pop("_kbit_tp", None)
        if pending is None:
            continue
        sharded = True
        cls, mesh = pending
        group = tp.RankGroup(mesh.get_group())
        if isinstance(module, KbitExperts):
            state = {key: _local(t) for key, t in module.state_dict().items() if key != "meta"}
            model.set_submodule(name, tp.local_experts(module, state, group))
            continue
        state = {key: _local(getattr(module, key)) for key in ("packed", "absmax", "codebook", "scale")}
        out_features, in_features = module.out_features, module.in_features
        if issubclass(cls, tp.ColumnParallelKbitLinear):
            out_features //= group.world
        elif cls is tp.RowParallelKbitLinear:
            in_features //= group.world
        state["meta"] = meta_tensor(module.bits, (out_features, in_features), module.weight_dtype)
        try:
            qw = QuantizedWeight.from_state_dict(state)
        except (TypeError, ValueError) as e:
            raise ValueError(f"kbit checkpoint, layer {name}: {e}") from None
        rotation = None
        if module.rotation_signs is not None:
            block = int(_local(module.rotation_block))
            if cls is tp.RowParallelKbitLinear and tp.row_split_problem(module.in_features, group.world, block):
                raise ValueError(f"kbit checkpoint, layer {name}: rotation_block={block} cuts its row shards "
                                 f"(in_features={module.in_features} over {group.world} ranks)")
            rotation = Rotation(_local(module.rotation_signs), block)
        bias = None if module.bias is None else _local(module.bias)
        model.set_submodule(name, tp.local_linear(cls, qw, bias, rotation, group))
    if fused and sharded:  # the shards of sibling projections share one launch as the whole layers did
        fuse_projections(model)
    plan = getattr(model, "_tp_plan", None)
    original = model.__dict__.pop("_kbit_original_styles", {})
    if isinstance(plan, dict):
        plan.update((key, style) for key, style in original.items() if key in plan)
