"""Shared pytest setup for kbit.

* Every test draws fresh random inputs: an autouse fixture seeds torch with a new seed per test
  (or ``KBIT_TEST_SEED`` to reproduce one) and prints it, so a failure shows its seed.
* Tests marked ``@pytest.mark.cuda`` need a CUDA device and are skipped without one.
"""

from __future__ import annotations

import os
import random

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def pytest_collection_modifyitems(config, items):
    # The CUDA harness's poison report counts the calls of every test before it: run it last.
    items.sort(key=lambda item: item.name == "test_poison_coverage")
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    env = os.environ.get("KBIT_TEST_SEED")
    return [
        f"kbit: torch {torch.__version__}, cuda available: {torch.cuda.is_available()}",
        f"kbit: test seeds {'fixed to ' + env if env else 'fresh per test (printed on failure)'}",
    ]


@pytest.fixture(autouse=True)
def seed(request):
    """A fresh seed per test (``KBIT_TEST_SEED=n`` fixes it); printed so failures can be reproduced."""
    env = os.environ.get("KBIT_TEST_SEED")
    value = int(env) if env else random.SystemRandom().randrange(2**31)
    torch.manual_seed(value)
    random.seed(value)
    print(f"[kbit] {request.node.nodeid}: seed={value} (rerun with KBIT_TEST_SEED={value})")
    return value


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors: one thread avoids oversubscribing a shared CPU (many times faster there)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def ieee_fp32_matmul():
    """fp32 references must be real fp32 products (no TF32)."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)
