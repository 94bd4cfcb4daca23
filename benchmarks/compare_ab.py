"""Compare two sides of an A/B of one benchmark (bench_gemm.py or bench_moe.py JSON files): per cell new / old speed,
the geometric mean and the worst cell.

    python benchmarks/compare_ab.py OLD.json [OLD2.json ...] -- NEW.json [NEW2.json ...]

A cell is one row's identity (shape or model, dtype, M or tokens, bits); speed is 1 / ``kbit_us``.
"""

from __future__ import annotations

import json
import math
import sys

KEYS = ("shape", "model", "dtype", "M", "tokens", "K", "k")


def cells(paths: list) -> dict:
    found = {}
    for path in paths:
        for row in json.load(open(path))["rows"]:
            if row.get("kbit_us"):
                found[tuple((k, row[k]) for k in KEYS if k in row)] = row["kbit_us"]
    return found


def main(argv: list) -> int:
    if "--" not in argv:
        raise SystemExit(__doc__)
    split = argv.index("--")
    old, new = cells(argv[:split]), cells(argv[split + 1:])
    common = sorted(set(old) & set(new), key=str)
    if not common:
        print("no common cells")
        return 1
    ratios = {c: old[c] / new[c] for c in common}  # > 1: the new plan is faster
    geomean = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
    worst = min(ratios, key=ratios.get)
    slow = sum(r < 0.95 for r in ratios.values())
    print(f"{len(common)} cells: geomean new/old speed {geomean:.4f}x, {slow} below 0.95x, worst {ratios[worst]:.3f}x "
          f"at {dict(worst)} ({old[worst]:.1f} -> {new[worst]:.1f} us)")
    for cell in sorted(ratios, key=ratios.get)[:5]:
        print(f"  {ratios[cell]:.3f}x {dict(cell)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
