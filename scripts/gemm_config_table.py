"""Print docs/DESIGN.md's table of the fused GEMM's built configurations (shared memory per CTA, the compute
capabilities their code is built for) from the extension's report as tests/gemm_configs.json pins it.

    python scripts/gemm_config_table.py [tests/gemm_configs.json]

tests/test_docs.py checks that DESIGN.md holds exactly this output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[1] / "tests" / "gemm_configs.json"
BITS = (2, 3, 4, 5)


def kind(row: dict) -> tuple:
    """(sort key, label) of a configuration's kind, the same for every bit width."""
    tokens = row["mb"] * 8
    if row["ws_tokens"]:
        rows = f", {row['tile_rows']}-row tiles" if row["wgmma_tiles"] else ""
        return (3, tokens, row["wgmma_tiles"]), f"warp-specialized, {tokens} tokens per tile{rows}"
    if row["wgmma_tiles"]:
        return (2, tokens, row["wgmma_tiles"]), f"wgmma, {tokens} tokens, {128 * row['wgmma_tiles']}-row tiles"
    if row["k_split"] > 1:
        return (1, tokens), f"mma.sync k split, {tokens} tokens"
    return (0, tokens), f"mma.sync, {tokens} tokens"


def cell(row: dict) -> str:
    arch = "sm_80 on" if row["cc_major_min"] == 8 else "sm_90 on" if row["cc_major_max"] > 9 else "sm_90a"
    return f"{row['smem_bytes'] / 1024:g} KB, {arch}"


def table(rows: list) -> str:
    kinds: dict = {}
    for row in rows:
        key, label = kind(row)
        kinds.setdefault(key, [label, {}])[1][row["bits"]] = cell(row)
    lines = ["| configuration | " + " | ".join(f"k = {k}" for k in BITS) + " |", "|---" * (len(BITS) + 1) + "|"]
    for key in sorted(kinds):
        label, cells = kinds[key]
        lines.append(f"| {label} | " + " | ".join(cells.get(k, "not built") for k in BITS) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else DEFAULT).read_text())))
