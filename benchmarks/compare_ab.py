"""Compare two runs of the same benchmark (bench_gemm.py or bench_moe.py JSON): per cell new / old speed, the
geometric mean and the worst cell.

    python benchmarks/compare_ab.py OLD.json NEW.json

A cell is one row's identity (shape or layer, M or tokens, K, dtype); speed is 1 / ``kbit_us``.
"""

from __future__ import annotations

import json
import math
import sys

KEYS = ("shape", "layer", "model", "dtype", "M", "tokens", "K", "k")


def cells(path: str) -> dict:
    rows = json.load(open(path))["rows"]
    return {tuple((k, r[k]) for k in KEYS if k in r): r["kbit_us"] for r in rows if r.get("kbit_us")}


def main(old_path: str, new_path: str) -> int:
    old, new = cells(old_path), cells(new_path)
    common = sorted(set(old) & set(new), key=str)
    if not common:
        print("no common cells")
        return 1
    ratios = {c: old[c] / new[c] for c in common}  # > 1: the new plan is faster
    geomean = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
    worst = min(ratios, key=ratios.get)
    slow = sum(r < 0.95 for r in ratios.values())
    print(f"{new_path}: {len(common)} cells, geomean new/old speed {geomean:.4f}x, {slow} cells below 0.95x, "
          f"worst {ratios[worst]:.3f}x at {dict(worst)} ({old[worst]:.1f} -> {new[worst]:.1f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
