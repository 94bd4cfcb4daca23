"""Compare two sides of an A/B of one benchmark (bench_gemm.py, bench_moe.py or planner_ab.py JSON files): per cell
new / old speed, the geometric mean, the cells below 0.95x and the worst cells.

    python benchmarks/compare_ab.py [--field kbit_us] [--worst 5] OLD.json [OLD2.json ...] -- NEW.json [NEW2.json ...]

A cell is one row's identity (shape or model, dtype, M or tokens, bits); speed is 1 / the row's ``--field``, the
fastest where a side's files hold the cell more than once (rounds of the same runs).
Where rows carry M or tokens, the geomean per token count follows; where they carry a ``plan``, the worst cells
show both sides' plans.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

KEYS = ("shape", "model", "dtype", "M", "tokens", "K", "k")
SLOW = 0.95
PLAN_OF = {"fused_us": "fused_plan"}  # the plan that ran a field's time where it is not the row's ``plan``


def cells(paths: list, field: str) -> dict:
    """cell -> (time, the plan that ran it or None); a cell in several files (rounds of one side) at its fastest."""
    found = {}
    for path in paths:
        for row in json.load(open(path))["rows"]:
            cell = tuple((k, row[k]) for k in KEYS if k in row)
            if row.get(field) and (cell not in found or row[field] < found[cell][0]):
                found[cell] = (row[field], row.get(PLAN_OF.get(field, "plan"), row.get("plan")))
    return found


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _plan(plan) -> str:
    if not plan:
        return ""
    shown = [str(v) for k, v in plan.items() if k != "path" and v not in (0, False, None)]
    return plan.get("path", "?") + (f"({','.join(shown)})" if shown else "")


def compare(old: dict, new: dict, worst: int) -> list:
    """The report's lines; [] where the sides share no cell."""
    common = sorted(set(old) & set(new), key=str)
    if not common:
        return []
    ratios = {c: old[c][0] / new[c][0] for c in common}  # > 1: the new side is faster
    slow = sum(r < SLOW for r in ratios.values())
    lines = [f"{len(common)} cells: geomean new/old speed {geomean(ratios.values()):.4f}x, {slow} below {SLOW}x"]
    by_tokens: dict = {}
    for cell, r in ratios.items():
        tokens = dict(cell).get("M", dict(cell).get("tokens"))
        if tokens is not None:
            by_tokens.setdefault(tokens, []).append(r)
    if by_tokens:
        lines.append("  per M: " + " ".join(f"{m}:{geomean(rs):.3f}" for m, rs in sorted(by_tokens.items())))
    for cell in sorted(ratios, key=ratios.get)[:worst]:
        (t_old, p_old), (t_new, p_new) = old[cell], new[cell]
        plans = f"  {_plan(p_old)} -> {_plan(p_new)}" if p_old or p_new else ""
        lines.append(f"  {ratios[cell]:.3f}x {dict(cell)} ({t_old:.1f} -> {t_new:.1f} us){plans}")
    return lines


def main(argv: list) -> int:
    if "--" not in argv:
        raise SystemExit(__doc__)
    split = argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--field", default="kbit_us")
    parser.add_argument("--worst", type=int, default=5)
    parser.add_argument("old", nargs="+")
    args = parser.parse_args(argv[:split])
    lines = compare(cells(args.old, args.field), cells(argv[split + 1:], args.field), args.worst)
    print("\n".join(lines) if lines else "no common cells")
    return 0 if lines else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
