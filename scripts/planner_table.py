"""Print docs/PERFORMANCE.md's table of the planner's shipped coefficients (kbit/gpus/*.json): one row per
coefficient, one column per GPU and path.

    python scripts/planner_table.py

tests/test_docs.py checks that PERFORMANCE.md holds exactly this output.
"""

from __future__ import annotations

import json
from pathlib import Path

GPU_DIR = Path(__file__).resolve().parents[1] / "kbit" / "gpus"
ROWS = (("fixed_us", "fixed, µs"), ("load_us", "µs per MiB loaded"), ("lookup_us", "µs per Mi lookups"),
        ("mma_us", "µs per Gi MACs"), ("tile_us", "µs per tile"), ("handoff_us", "µs per MiB handed off"),
        ("memory_us", "µs per MiB moved"))
PATHS = (("mma_sync", "mma.sync"), ("wgmma", "wgmma"), ("warp_specialized", "ws"),
         ("warp_specialized_128_rows", "ws 128"), ("dequantize_cublas", "cuBLAS"))
# The k split shares mma.sync's coefficients (kbit/tune.py, fit).


def table(files) -> str:
    columns = []  # (title, coefficients)
    for path in sorted(files):
        data = json.loads(Path(path).read_text())
        gpu = data["device"].replace("NVIDIA ", "").split(" ")[0]
        columns += [(f"{gpu} {title}", data["paths"][name]) for name, title in PATHS if name in data["paths"]]
    lines = ["| coefficient | " + " | ".join(title for title, _ in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    lines += [f"| {title} | " + " | ".join(f"{cost[key]:.3g}" for _, cost in columns) + " |" for key, title in ROWS]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(GPU_DIR.glob("*.json")))
