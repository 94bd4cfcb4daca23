"""The CUDA tests' harness itself: poisoned memory reaches the next allocation, and how often it reached the
ops' outputs this session (conftest.py runs that report last)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from cuda_harness import poison, _POISON_STATS

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tests need a CUDA device"),
    pytest.mark.usefixtures("ieee_fp32_matmul"),  # fp32 references are real fp32 products (conftest.py)
]


# ----------------------------------------------------------------------------- harness self-test
def test_poison_reaches_next_allocation():
    """The poisoning trick works with this allocator configuration (else the tests are weaker)."""
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":
        pytest.skip("caching allocator disabled")
    keep = torch.ones(12345, device="cuda")  # some unrelated live allocation
    poison((4096 * 7, torch.float16))
    y = torch.empty(4096 * 7, dtype=torch.float16, device="cuda")
    assert bool(torch.isnan(y).all()), "poisoned memory was not handed to the next same-size allocation"
    del keep


# ----------------------------------------------------------------------------- harness report (keep last)
def test_poison_coverage():
    """Report how often the poisoned blocks really became the ops' outputs in this session.

    Low coverage is not a kernel bug (e.g. the op allocates a workspace before its outputs), but
    it means unwritten outputs would be caught only through mismatches, not NaNs: warn about it.
    """
    calls, hits = _POISON_STATS["calls"], _POISON_STATS["hits"]
    if calls == 0:
        pytest.skip("no poisoned op calls ran in this session")
    print(f"poisoned memory reached the op outputs in {hits} of {calls} calls")
    if hits < 0.9 * calls:
        warnings.warn(f"kbit test harness: poisoned memory reached the op outputs in only {hits} of {calls} calls "
                      "(does an op allocate scratch memory before its outputs?)")
