"""The tensor-parallel layers' decode sums through torch's one-shot symmetric-memory all-reduce (opt-in).

``KBIT_TP_ALL_REDUCE=symmetric`` sends each all-reduce of a sharded kbit layer of at most ``SYMMETRIC_BYTES`` (a
decode step's: tokens x hidden, fp16 widened to fp32, ``SUMMED_DTYPES``) through torch's
``symm_mem::one_shot_all_reduce_copy``: every rank copies its partial sum into a buffer of symmetric memory
(``torch.distributed._symmetric_memory``) and one kernel on the compute stream reads every rank's copy over NVLink
and adds them. The default, ``collective``, is the process group's all-reduce (NCCL on GPUs), which runs on NCCL's
own stream with a hand-off before and after each call; a decode step makes two a layer. Larger sums (a prompt's),
and every sum while no buffer is there, take the collective whatever the setting.

The buffer, one per process group and GPU, is made and exchanged by the first eager sum on CUDA (a prompt's, say)
on every rank of the group (``symm_mem.empty`` and ``rendezvous`` are collective: every rank runs the same layers
in the same order, as tensor parallelism does); a graph that torch.compile traces before any eager sum keeps the
collective. It is marked static, so that CUDA graphs read it in place.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor
from torch.torch_version import TorchVersion

ENV = "KBIT_TP_ALL_REDUCE"
MODES = ("collective", "symmetric")
SYMMETRIC_BYTES = 256 * 1024  # the largest sum sent through symmetric memory: a decode step's, not a prompt's
# What torch's one-shot kernel adds (torch 2.11 dispatches fp32 and bf16 only). Any other dtype (fp16) is summed in
# fp32 and rounded once, which for two ranks gives the bits of NCCL's 16-bit sum (the sum of two fp16 values is exact
# in fp32).
SUMMED_DTYPES = (torch.float32, torch.bfloat16)

_buffers: dict = {}  # (group name, device) -> uint8 [SYMMETRIC_BYTES] in symmetric memory, exchanged


def mode() -> str:
    """The all-reduce ``KBIT_TP_ALL_REDUCE`` asks for (read at each eager call, so that a process can switch)."""
    value = os.environ.get(ENV, "collective").strip().lower() or "collective"
    if value not in MODES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected one of {', '.join(MODES)}")
    return value


def symmetric_sum(y: Tensor, group_name: str) -> Optional[Tensor]:
    """The sum of ``y`` over the ranks of group ``group_name`` through the one-shot symmetric-memory kernel, or
    None where the process group's all-reduce sums it: not on CUDA, larger than ``SYMMETRIC_BYTES``, or no buffer
    (that mode not asked for, or tracing before any eager call made one). While compiling only the buffer is read,
    as a static input."""
    if not y.is_cuda:
        return None
    buffer = _buffers.get((group_name, y.device))
    if not torch.compiler.is_compiling():  # a trace reads no environment: the mode an eager call saw made the buffer
        if mode() != "symmetric":
            return None
        if buffer is None:  # at the first eager sum of any size (a prompt's), so that a decode step traced next has it
            buffer = _exchange(group_name, y.device)
    dtype = y.dtype if y.dtype in SUMMED_DTYPES else torch.float32
    nbytes = y.numel() * dtype.itemsize
    if buffer is None or nbytes > SYMMETRIC_BYTES:
        return None
    staged = buffer[:nbytes].view(dtype).view(y.shape)
    total = torch.ops.symm_mem.one_shot_all_reduce_copy(staged, y.to(dtype).contiguous(), "sum", group_name)
    return total.to(y.dtype)


def _exchange(group_name: str, device: torch.device) -> Tensor:
    """A buffer of symmetric memory on ``device``, exchanged with the group's ranks (collective)."""
    from torch.distributed import _symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None and TorchVersion(torch.__version__) < (2, 9):  # needed before 2.9; since, only a warning
        enable(group_name)
    buffer = symm_mem.empty(SYMMETRIC_BYTES, dtype=torch.uint8, device=device)
    symm_mem.rendezvous(buffer, group_name)
    torch._dynamo.mark_static_address(buffer, guard=False)
    _buffers[(group_name, device)] = buffer
    return buffer
