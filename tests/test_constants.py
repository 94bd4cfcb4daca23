"""The C++ side's format constants (the marked block of kbit/csrc/kbit.h), the grouped GEMM's expert limit
(kbit/csrc/moe.h) and the cut facts the planner prices (cut.h, gemm_ws.cuh) equal their Python copies."""

import re
from pathlib import Path

from kbit import formats, layout, moe, planner

KBIT_H = Path(__file__).resolve().parent.parent / "kbit" / "csrc" / "kbit.h"

PYTHON_VALUES = {
    "kBlock": formats.BLOCK_SIZE,
    "kMinBits": min(formats.SUPPORTED_BITS),
    "kMaxBits": max(formats.SUPPORTED_BITS),
    "kLayoutTileRows": layout.TILE_ROWS,
    "kLayoutNAlign": layout.N_ALIGN,
    "kKGroup": layout.K_GROUP,
    "kXColumnAlign": layout.X_ALIGN,
}


def cpp_constants() -> dict:
    text = KBIT_H.read_text()
    block = re.search(r"// KBIT_CONSTANTS_BEGIN\n(.*?)// KBIT_CONSTANTS_END", text, re.S)
    assert block, "kbit.h lost its KBIT_CONSTANTS_BEGIN / KBIT_CONSTANTS_END block"
    constants = {}
    for line in block.group(1).splitlines():
        code = line.split("//")[0].strip()
        if not code:
            continue
        match = re.fullmatch(r"constexpr int (\w+) = (\d+);", code)
        assert match, f"kbit.h constants block: cannot read {line.strip()!r} (one 'constexpr int kName = 123;' a line)"
        constants[match.group(1)] = int(match.group(2))
    return constants


def test_cpp_constants_equal_python():
    assert cpp_constants() == PYTHON_VALUES


def test_supported_bits_are_a_range():  # C++ checks bits as kMinBits..kMaxBits
    assert formats.SUPPORTED_BITS == tuple(range(min(formats.SUPPORTED_BITS), max(formats.SUPPORTED_BITS) + 1))


def test_grouped_expert_limit_equals_python():
    """moe.h sizes the routing kernel's shared-memory arrays by kMaxGroupedExperts; kbit.moe sends layers with more
    experts to the reference instead (``KbitExperts.grouped_supported``)."""
    match = re.search(r"constexpr int kMaxGroupedExperts = (\d+);", KBIT_H.with_name("moe.h").read_text())
    assert match, "moe.h lost 'constexpr int kMaxGroupedExperts = N;'"
    assert int(match.group(1)) == moe.MAX_GROUPED_EXPERTS


def test_the_planners_cut_facts_equal_the_kernels():
    """The planner refuses tile parts past kMaxGroupedGrid CTAs, prices a tile split kSlicedFrom ways or more as
    summed in slices (``planner.handed_partials``) and offers tiles in at most kMaxClusterCtas clustered parts."""
    for source, name, value in (("cut.h", "kMaxGroupedGrid", planner.MAX_TILE_PARTS_GRID),
                                ("gemm_ws.cuh", "kSlicedFrom", planner.WS_SLICED_FROM),
                                ("gemm.cuh", "kMaxClusterCtas", planner.MAX_CLUSTER_CTAS)):
        match = re.search(rf"constexpr int {name} = (\d+);", KBIT_H.with_name(source).read_text())
        assert match, f"{source} lost 'constexpr int {name} = N;'"
        assert int(match.group(1)) == value, name
