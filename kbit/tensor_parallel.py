"""Tensor parallel kbit models over ``torch.distributed``: each rank holds a shard of every kbit weight.

    # torchrun --nproc-per-node 2 script.py
    import torch.distributed as dist, kbit
    from kbit.tensor_parallel import shard_model
    dist.init_process_group("nccl")                      # "gloo" on CPU
    model = kbit.quantize_model(model, bits=4)           # or from_pretrained(kbit_folder), on the CPU
    shard_model(model)                                   # the default group; the model's own tp_plan
    model.to(f"cuda:{dist.get_rank()}")

How a kbit weight splits, at the storage level (no re-quantization; ``column_shard``, ``row_shard``):

* column parallel (transformers' ``"colwise"``: q/k/v, gate, up): whole rows of the [out_features, in_features]
  weight, i.e. each row's bit-plane words and block scales. The input is replicated, the output is this rank's
  slice of the features. Attention projections split at whole heads.
* row parallel (``"rowwise"``: o_proj, down): whole blocks of every row, at multiples of 32 input features. Each
  rank multiplies its slice of the input (what the column-parallel layer before it produced) and the partial
  products are summed by an all-reduce (``torch.distributed``'s functional collectives, which ``torch.compile``
  and CUDA graphs take); the bias is added once, after it. A rotated layer (``kbit.rotation``) rotates its input in
  Hadamard blocks: the shards must hold whole Hadamard blocks too (each rank then rotates its own slice). A
  row-parallel layer whose shards would cut a block (of 32 or of its Hadamard transform) stays whole on every
  rank and gathers its input instead (``GatheredInputKbitLinear``); ``shard_model`` says so in its report.
* codebook and per-tensor scale are replicated (they are a few bytes).
* ``KbitExperts`` (a MoE layer's routed experts, transformers' ``"moe_tp_experts"``): every expert's projections
  split as above on every rank (gate and up rows column parallel, down row parallel), one all-reduce per layer.
  Not expert parallel: at decode a token routes to ``top_k`` experts, and with whole experts per rank the step
  waits on the rank that holds the most of them and tokens need an all-to-all; with each expert split, every
  rank reads half of each routed expert's bytes, the router and routing stay unchanged, and the communication is
  the dense MLP's all-reduce.

* an ``lm_head`` (transformers' ``"colwise_gather_output"``): rows of the vocabulary, its logits gathered
  (``ColumnParallelLinear`` in 16 bits, ``GatheredOutputKbitLinear`` quantized). At batch 1 it is the largest tensor
  a decode step reads (128256 x 8192 in 16 bits is 2 GiB, the same as four K=4 layers of a 70B model): replicated,
  it would cap a two-way split at ~1.3x. An ``lm_head`` tied to the input embeddings stays whole (a shard of it
  would be a second copy).

Other modules (embeddings, norms, the router) stay replicated. Each rank
keeps only its shard: the full storage is released once ``shard_model`` returns, and a layer re-derives its GEMM
layout from its shard on its device. ``unshard_model`` gathers the shards back into whole layers (every rank),
so a tensor-parallel model saves like any other (``kbit.save_quantized`` on rank 0) and loads at any TP size.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from .formats import BLOCK_SIZE
from .moe import KbitExperts
from .nn import KbitLinear, fuse_projections, has_groups
from .rotation import Rotation
from .symmetric_all_reduce import symmetric_sum
from .weight import QuantizedWeight

__all__ = ["shard_model", "unshard_model", "column_shard", "row_shard", "row_split_problem", "kbit_bytes",
           "ColumnParallelKbitLinear", "GatheredOutputKbitLinear", "RowParallelKbitLinear",
           "GatheredInputKbitLinear", "TensorParallelKbitExperts", "ColumnParallelLinear"]

# transformers' names for the styles kbit layers take (its ``tp_plan``); any other style leaves a layer whole.
COLWISE, ROWWISE, EXPERTS = "colwise", "rowwise", "moe_tp_experts"
GATHERED_OUTPUT = ("colwise_gather_output", "colwise_rep")  # a layer's rows, its output gathered (an lm_head)
COLUMN_STYLES = (COLWISE,) + GATHERED_OUTPUT  # split by rows
LINEAR_STYLES = COLUMN_STYLES + (ROWWISE,)  # the styles a KbitLinear splits by


# ---------------------------------------------------------------------- storage-level shards
def _own(t: Tensor, experts: tuple) -> Tensor:
    """A contiguous copy, one row per expert of ``experts`` (() for a 2-D weight, else (E,)): the shard must not keep
    the full tensor's storage alive."""
    return t.clone(memory_format=torch.contiguous_format).reshape(*experts, -1)


def _even_part(size: int, rank: int, world: int) -> tuple:
    return rank * size // world, (rank + 1) * size // world


def column_shard(qw: QuantizedWeight, rank: int, world: int, groups: int = 1) -> QuantizedWeight:
    """Rows ``[rank * N / world, (rank + 1) * N / world)`` of ``qw`` (N = out_features, divisible by ``world``), of
    each expert's for a weight with experts: those rows' bit-plane words and block scales, copied; codebook and scale
    shared. ``groups`` > 1 splits each of that many equal row groups so (gate/up: the gate rows, then the up rows)."""
    *experts, N, K = qw.shape
    if N % (world * groups):
        of_groups = f" of each of its {groups} row groups" if groups > 1 else ""
        raise ValueError(f"out_features={N} does not split into {world} equal column shards{of_groups}")
    lo, hi = _even_part(N // groups, rank, world)
    packed, absmax = (_own(t.view(*experts, groups, N // groups, -1)[..., lo:hi, :], tuple(experts))
                      for t in qw.storage())
    return QuantizedWeight.from_checked(packed, absmax, qw.codebook, qw.scale, qw.bits,
                                        (*experts, groups * (hi - lo), K), qw.dtype)


def row_split_problem(in_features: int, world: int, rotation_block: int = 0) -> Optional[str]:
    """None if ``world`` row shards of ``in_features`` each hold whole blocks of 32 (and whole Hadamard blocks of
    ``rotation_block``), else why not."""
    unit = max(BLOCK_SIZE, rotation_block)  # both powers of two: the larger is a multiple of the smaller
    if in_features % (world * unit):
        what = f"Hadamard blocks of {rotation_block}" if rotation_block > BLOCK_SIZE else f"blocks of {BLOCK_SIZE}"
        return f"in_features={in_features} does not split into {world} shards of whole {what}"
    return None


def row_shard(qw: QuantizedWeight, rank: int, world: int) -> QuantizedWeight:
    """Input features ``[rank * K / world, (rank + 1) * K / world)`` of ``qw``: whole blocks of every row (of every
    expert's for a weight with experts), copied (``row_split_problem`` must find none); codebook and scale shared."""
    *experts, N, K = qw.shape
    problem = row_split_problem(K, world)
    if problem:
        raise ValueError(problem)
    lo, hi = (b // BLOCK_SIZE for b in _even_part(K, rank, world))
    packed, absmax = qw.storage()  # derived once from a GEMM-resident weight
    packed = _own(packed.view(*experts, N, -1, qw.bits)[..., lo:hi, :], tuple(experts))
    absmax = _own(absmax.view(*experts, N, -1)[..., lo:hi], tuple(experts))
    return QuantizedWeight.from_checked(packed, absmax, qw.codebook, qw.scale, qw.bits,
                                        (*experts, N, (hi - lo) * BLOCK_SIZE), qw.dtype)


def _gathered_storage(qw: QuantizedWeight, dim: int, group, groups: int = 1) -> tuple:
    """(packed, absmax) of the whole weight that every rank's shard ``qw`` is part of, in rank order: the inverse of
    ``column_shard`` (``dim`` -2, the rows of each of ``groups`` row groups) or of ``row_shard`` (``dim`` -1)."""
    *experts, N, _ = qw.shape
    return tuple(_all_gather(t.view(*experts, groups, N // groups, -1), dim, group).reshape(*experts, -1)
                 for t in qw.storage())


def kbit_bytes(model: nn.Module) -> int:
    """Bytes this process holds in kbit layers' buffers (storage, and on CUDA the GEMM layout) for ``model``."""
    return sum(t.numel() * t.element_size() for m in model.modules() if isinstance(m, (KbitLinear, KbitExperts))
               for t in m.buffers(recurse=False))


# ---------------------------------------------------------------------- communication
class RankGroup:
    """The process group a sharded layer talks over, with this rank's place in it."""

    def __init__(self, group):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.name = group.group_name  # a plain string: what a compiled step reads of it (symmetric_sum)

    def __deepcopy__(self, memo):  # a copied model talks over the same group
        return self


def _all_reduce(y: Tensor, tp: RankGroup) -> Tensor:
    """The sum of ``y`` over ``tp``'s ranks: a decode step's through symmetric memory where asked
    (``kbit.symmetric_all_reduce``), else NCCL through the functional collectives."""
    total = symmetric_sum(y, tp.name)
    return total if total is not None else funcol.wait_tensor(funcol.all_reduce(y, "sum", tp.group))


# all_gather_single where torch has it (all_gather_tensor, its older name, warns there that it is deprecated)
_ALL_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def _all_gather(x: Tensor, dim: int, group) -> Tensor:
    """The ranks' ``x`` concatenated along ``dim`` in rank order. Gathered along dim 0, then laid side by side: for
    another dim funcol waits outside the traced graph, which breaks a compiled step and keeps CUDA graphs out."""
    gathered = funcol.wait_tensor(_ALL_GATHER(x.contiguous(), 0, group))
    if dim % x.dim() == 0:
        return gathered
    return torch.cat(gathered.chunk(gathered.shape[0] // x.shape[0], 0), dim)


# ---------------------------------------------------------------------- sharded layers
class ColumnParallelKbitLinear(KbitLinear):
    """A ``KbitLinear`` holding rows ``[rank * N / world, ...)`` of a [N, in_features] weight (and of its bias):
    a replicated input, this rank's slice of the output features. No communication."""

    tp: RankGroup

    def extra_repr(self) -> str:
        return super().extra_repr() + f", column shard {self.tp.rank} of {self.tp.world}"


class GatheredOutputKbitLinear(ColumnParallelKbitLinear):
    """A ``ColumnParallelKbitLinear`` whose output every rank gathers whole (a quantized ``lm_head`` planned
    ``"colwise_gather_output"``: each rank reads its rows of the vocabulary, every rank gets all the logits)."""

    def forward(self, x: Tensor) -> Tensor:
        return _all_gather(super().forward(x), -1, self.tp.group)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", output gathered"


class RowParallelKbitLinear(KbitLinear):
    """A ``KbitLinear`` holding input features ``[rank * K / world, ...)`` of a [out_features, K] weight: its input is
    this rank's slice of the features, its output the all-reduced sum of every rank's product, plus the bias (kept
    whole on every rank, added once)."""

    tp: RankGroup

    def forward(self, x: Tensor) -> Tensor:
        y = _all_reduce(self._product(x, None), self.tp)  # the bias after the sum
        bias = self._parameters["bias"]
        return y if bias is None else y + bias.to(y.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", row shard {self.tp.rank} of {self.tp.world}"


class GatheredInputKbitLinear(KbitLinear):
    """A whole ``KbitLinear`` planned row parallel whose weight does not split into whole blocks
    (``row_split_problem``): it gathers its input's feature slices from every rank, then computes on every rank."""

    tp: RankGroup

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(_all_gather(x, -1, self.tp.group))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", whole on each of {self.tp.world} ranks (input gathered)"


class TensorParallelKbitExperts(KbitExperts):
    """``KbitExperts`` holding, for every expert, gate and up rows ``[rank * I / world, ...)`` and the same input
    features of down: experts of intermediate size I / world whose outputs the ranks sum (one all-reduce)."""

    tp: RankGroup

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return _all_reduce(super().forward(hidden_states, top_k_index, top_k_weights), self.tp)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", shard {self.tp.rank} of {self.tp.world} of every expert"


class ColumnParallelLinear(nn.Linear):
    """A 16-bit ``nn.Linear`` holding rows ``[rank * N / world, ...)`` of its weight and bias (an ``lm_head``): a
    replicated input; every rank's slice of the output gathered, so the output is whole on every rank."""

    tp: RankGroup

    def forward(self, x: Tensor) -> Tensor:
        return _all_gather(super().forward(x), -1, self.tp.group)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", column shard {self.tp.rank} of {self.tp.world}, output gathered"


_PARALLEL = (ColumnParallelKbitLinear, RowParallelKbitLinear, GatheredInputKbitLinear, TensorParallelKbitExperts,
             ColumnParallelLinear)


def local_linear(cls, qw: QuantizedWeight, bias: Optional[Tensor], rotation: Optional[Rotation],
                 tp: RankGroup) -> KbitLinear:
    """A sharded layer of class ``cls`` (``linear_split``) from this rank's weight, bias and rotation."""
    layer = cls.from_quantized(qw, bias, rotation)
    layer.tp = tp
    return layer


def _head_dim(model: nn.Module, name: str) -> int:
    """The head size of the attention module holding layer ``name`` (1 where there is none): a column split of an
    attention projection must keep heads whole."""
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    return int(getattr(parent, "head_dim", 1) or 1)


def linear_split(style: str, shape, world: int, head_dim: int = 1, rotation_block: int = 0, name: str = "layer"):
    """How a [out_features, in_features] ``KbitLinear`` planned ``style`` (``"colwise"``, ``"rowwise"`` or one of
    ``GATHERED_OUTPUT``) splits over ``world`` ranks: (the sharded class, what becomes of it). A column split must keep
    heads of ``head_dim`` whole (ValueError otherwise); a row split that would cut a block leaves the layer whole, its
    input gathered; a gathered-output layer whose rows do not split evenly stays whole (class None), as a 16-bit
    one does."""
    out_features, in_features = shape
    if style in GATHERED_OUTPUT:
        if out_features % world:
            return None, f"whole: out_features={out_features} does not split into {world} equal shards"
        return GatheredOutputKbitLinear, "column shard, output gathered"
    if style == COLWISE:
        if out_features % (world * head_dim):
            unit = f"heads of {head_dim}" if head_dim > 1 else "rows"
            raise ValueError(f"{name}: out_features={out_features} does not split into {world} equal shards of "
                             f"whole {unit}")
        return ColumnParallelKbitLinear, "column shard"
    problem = row_split_problem(in_features, world, rotation_block)
    if problem:
        return GatheredInputKbitLinear, f"whole (input gathered): {problem}"
    return RowParallelKbitLinear, "row shard"


def _shard_linear(layer: KbitLinear, style: str, tp: RankGroup, head_dim: int, name: str):
    qw, bias, rotation = layer.qweight, layer.bias, layer.rotation
    bias = None if bias is None else bias.detach()
    cls, how = linear_split(style, qw.shape, tp.world, head_dim, 0 if rotation is None else rotation.block, name)
    if cls is None:
        return layer, how
    if issubclass(cls, ColumnParallelKbitLinear):
        lo, hi = _even_part(qw.out_features, tp.rank, tp.world)
        qw, bias = column_shard(qw, tp.rank, tp.world), None if bias is None else bias[lo:hi].clone()
    elif cls is RowParallelKbitLinear:
        lo, hi = _even_part(qw.in_features, tp.rank, tp.world)
        qw = row_shard(qw, tp.rank, tp.world)
        rotation = None if rotation is None else Rotation(rotation.signs[lo:hi].clone(), rotation.block)
    return local_linear(cls, qw, bias, rotation, tp), how


def experts_split_problem(experts: KbitExperts, world: int) -> Optional[str]:
    """None if every expert's intermediate size splits into ``world`` shards of whole blocks, else why not."""
    return row_split_problem(experts.intermediate_dim, world)


def local_experts(experts: KbitExperts, state: dict, tp: RankGroup) -> "TensorParallelKbitExperts":
    """This rank's ``TensorParallelKbitExperts`` of ``experts``' shape from its shard of the storage: ``state`` holds
    ``gate_up_*`` / ``down_*`` packed and absmax of intermediate size I / world (``_shard_experts`` slices them, a
    tensor-parallel load reads them), and the replicated codebook and scales. The values are checked as on load."""
    E, H, I = experts.num_experts, experts.hidden_dim, experts.intermediate_dim
    lo, hi = _even_part(I, tp.rank, tp.world)
    local = TensorParallelKbitExperts.from_checked(E, H, hi - lo, experts.bits, experts.weight_dtype, "meta",
                                                   act_fn=experts.act_fn)
    state = dict(state, meta=local._meta_tensor(state["codebook"].device))
    local.load_state_dict({k: v.contiguous() for k, v in state.items()}, assign=True)
    local.tp = tp
    return local.prepare()


def _shard_experts(experts: KbitExperts, tp: RankGroup):
    problem = experts_split_problem(experts, tp.world)
    if problem:  # replicated input, replicated output: whole experts compute the same on every rank
        return experts, f"whole: intermediate {problem}"
    gate_up = column_shard(experts.projection("gate_up"), tp.rank, tp.world, groups=2)  # gate rows, then up rows
    down = row_shard(experts.projection("down"), tp.rank, tp.world)
    state = {"codebook": experts.codebook}
    for proj, qw in (("gate_up", gate_up), ("down", down)):
        state.update((f"{proj}_{key}", getattr(qw, key)) for key in ("packed", "absmax", "scale"))
    return local_experts(experts, state, tp), "shard of every expert"


# ---------------------------------------------------------------------- whole models
def _pattern(key: str) -> re.Pattern:
    """transformers' plan keys name layers with ``*`` for the layer number."""
    return re.compile(re.escape(key).replace(r"\*", r"\d+"))


def model_plan(model: nn.Module) -> dict:
    """The tensor-parallel plan of a transformers model (``model.tp_plan``, or its config's
    ``base_model_tp_plan`` under the base model's prefix); {} for other modules."""
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix):
        return {f"{prefix}.{key}": style for key, style in base.items()}
    return dict(base)


def _style(name: str, plan: dict) -> Optional[str]:
    for key, style in plan.items():
        if _pattern(key).fullmatch(name):
            return style
    return None


def shard_model(model: nn.Module, group=None, plan: Optional[dict] = None) -> dict:
    """Shard every kbit layer of ``model`` in place over ``group`` (default: the default process group).

    ``plan`` maps layer names (``*`` for a layer number) to ``"colwise"``, ``"rowwise"`` or (``KbitExperts``)
    ``"moe_tp_experts"``, as transformers' ``tp_plan``, and an ``lm_head`` (16-bit ``nn.Linear`` or ``KbitLinear``) to
    ``"colwise_gather_output"``; default ``model_plan(model)``. Layers it does not name (and other modules) stay
    whole on every rank. Every rank of ``group`` must call this with
    the same model; the storage is sliced where it lies (shard on the CPU, then move each rank's model to its GPU).
    Returns {layer name: what became of it}.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("shard_model needs torch.distributed initialized (dist.init_process_group, e.g. torchrun)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    tp = RankGroup(group if group is not None else dist.group.WORLD)
    plan = model_plan(model) if plan is None else plan
    if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items()):
        raise TypeError(f"plan must be a dict of layer name -> style name, got {type(plan).__name__}")
    report, fused = {}, has_groups(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, _PARALLEL):
            raise ValueError(f"{name} is sharded already: shard_model runs once per model")
        style = _style(name, plan)
        if isinstance(module, KbitLinear) and style in LINEAR_STYLES:
            new, report[name] = _shard_linear(module, style, tp, _head_dim(model, name), name)
        elif isinstance(module, KbitExperts) and style == EXPERTS:
            new, report[name] = _shard_experts(module, tp)
        elif type(module) is nn.Linear and style in GATHERED_OUTPUT:
            new, report[name] = _shard_dense(model, module, tp)
        else:
            if isinstance(module, (KbitLinear, KbitExperts)):
                report[name] = f"whole: style {style!r}"
            continue
        if not name:
            raise ValueError("model is itself a kbit layer: shard it inside a model that has a plan for it")
        model.set_submodule(name, new)
    if fused:  # the shards of sibling projections share one launch as the whole layers did
        fuse_projections(model)
    return report


def _shard_dense(model: nn.Module, layer: nn.Linear, tp: RankGroup):
    N = layer.out_features
    if any(p is layer.weight for mod in model.modules() if mod is not layer for p in mod.parameters(recurse=False)):
        return layer, "whole: tied to another module's weight"
    if N % tp.world:
        return layer, f"whole: out_features={N} does not split into {tp.world} equal shards"
    lo, hi = _even_part(N, tp.rank, tp.world)
    local = ColumnParallelLinear(layer.in_features, hi - lo, bias=layer.bias is not None, device="meta")
    local.weight = nn.Parameter(layer.weight.detach()[lo:hi].clone(), requires_grad=layer.weight.requires_grad)
    if layer.bias is not None:
        local.bias = nn.Parameter(layer.bias.detach()[lo:hi].clone(), requires_grad=layer.bias.requires_grad)
    local.tp = tp
    return local, "column shard, output gathered"


def _gathered_dense(layer: ColumnParallelLinear) -> nn.Linear:
    weight = _all_gather(layer.weight.detach(), 0, layer.tp.group)
    whole = nn.Linear(layer.in_features, weight.shape[0], bias=layer.bias is not None, device="meta")
    whole.weight = nn.Parameter(weight, requires_grad=layer.weight.requires_grad)
    if layer.bias is not None:
        whole.bias = nn.Parameter(_all_gather(layer.bias.detach(), 0, layer.tp.group),
                                  requires_grad=layer.bias.requires_grad)
    return whole


def _gathered_linear(layer: KbitLinear) -> KbitLinear:
    tp, qw, bias, rotation = layer.tp, layer.qweight, layer.bias, layer.rotation
    bias = None if bias is None else bias.detach()
    N, K = qw.shape
    if isinstance(layer, ColumnParallelKbitLinear):
        packed, absmax = _gathered_storage(qw, -2, tp.group)
        shape = (N * tp.world, K)
        bias = None if bias is None else _all_gather(bias, 0, tp.group)
    else:
        packed, absmax = _gathered_storage(qw, -1, tp.group)
        shape = (N, K * tp.world)
        if rotation is not None:
            rotation = Rotation(_all_gather(rotation.signs, 0, tp.group), rotation.block)
    whole = QuantizedWeight.from_checked(packed, absmax, qw.codebook, qw.scale, qw.bits, shape, qw.dtype)
    return KbitLinear.from_quantized(whole, bias, rotation)


def _gathered_experts(experts: TensorParallelKbitExperts) -> KbitExperts:
    tp = experts.tp
    E, H, I_local = experts.num_experts, experts.hidden_dim, experts.intermediate_dim
    whole = KbitExperts.from_checked(E, H, I_local * tp.world, experts.bits, experts.weight_dtype, "meta",
                                     act_fn=experts.act_fn)
    gate_up, down = experts.projection("gate_up"), experts.projection("down")
    state = {"codebook": experts.codebook, "meta": whole._meta_tensor(experts.codebook.device),
             "gate_up_scale": gate_up.scale, "down_scale": down.scale}
    state["gate_up_packed"], state["gate_up_absmax"] = _gathered_storage(gate_up, -2, tp.group, groups=2)
    state["down_packed"], state["down_absmax"] = _gathered_storage(down, -1, tp.group)
    whole.load_state_dict(state, strict=False, assign=True)
    return whole.prepare()


def unshard_model(model: nn.Module) -> nn.Module:
    """Gather every sharded layer of ``model`` back into a whole ``KbitLinear`` / ``KbitExperts`` / ``nn.Linear``, in
    place, on every rank (each rank of the group must call it). Layers kept whole by ``shard_model`` become plain kbit
    layers again. Returns the model, which then saves (``kbit.save_quantized`` on rank 0) and loads at any TP size."""
    fused = has_groups(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, TensorParallelKbitExperts):
            model.set_submodule(name, _gathered_experts(module))
        elif isinstance(module, ColumnParallelLinear):
            model.set_submodule(name, _gathered_dense(module))
        elif isinstance(module, GatheredInputKbitLinear):
            model.set_submodule(name, KbitLinear.from_quantized(module.qweight, module.bias, module.rotation))
        elif isinstance(module, (ColumnParallelKbitLinear, RowParallelKbitLinear)):
            model.set_submodule(name, _gathered_linear(module))
    if fused:
        fuse_projections(model)
    return model
