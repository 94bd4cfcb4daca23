"""Print docs/PERFORMANCE.md's GEMM tables of one device from its committed bench_gemm.py results
(benchmarks/results/gemm_<device>.json):

    python scripts/gemm_tables.py decode NVIDIA_H200    up to 16 tokens: M = 1 / M = 16 per cell, every shape measured
    python scripts/gemm_tables.py batch NVIDIA_H200     32 to 4096 tokens, k = 4: the fused op over cuBLAS

tests/test_docs.py checks that PERFORMANCE.md holds exactly this output for each table it shows.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
MOE_EXPERT_SHAPES = ("2048->1408", "2048->768")  # bench_moe.py's expert projections, timed as plain GEMMs here


def load(device: str) -> list[dict]:
    return json.loads((RESULTS / f"gemm_{device}.json").read_text())["rows"]


def _cells(rows: list[dict], dtype: str = "fp16") -> dict:
    return {(r["shape"], r["M"], r["K"]): r for r in rows if r["dtype"] == dtype}


def _shapes(cells: dict, ms) -> list[str]:
    """The shapes measured at every M of ``ms``, largest weight first (a shape and its transpose in the results'
    order)."""
    seen = [s for s in dict.fromkeys(shape for shape, _, _ in cells) if all((s, m, 4) in cells for m in ms)]
    return sorted(seen, key=lambda s: -math.prod(map(int, s.split("->"))))


def _us(value: float) -> str:
    return f"{value:.1f}" if value >= 1 else f"{value:.2f}"


def _label(shape: str) -> str:
    return shape.replace("->", "→") + (" (MoE expert)" if shape in MOE_EXPERT_SHAPES else "")


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def decode_table(rows: list[dict]) -> str:
    """One row per shape, each cell M = 1 / M = 16: cuBLAS µs, floor µs at k = 4, speedup over cuBLAS fp16 (% of
    floor) per k, a copy of the k = 4 bytes as % of floor, torch int4 over cuBLAS; geomeans after the table."""
    cells = _cells(rows)
    ends = (1, 16)
    bits = sorted({k for _, _, k in cells})
    shapes = _shapes(cells, ends)
    with_int4 = any(cells[(s, m, 4)].get("int4_us") for s in shapes for m in ends)  # a peer of the run, or not
    lines = ["| shape | cuBLAS µs | floor µs (k=4) | " + " | ".join(f"k={k}" for k in bits) + " | copy % |" +
             (" torch int4 |" if with_int4 else ""),
             "|---|---:|---:|" + "---|" * len(bits) + "---:|" + ("---:|" if with_int4 else "")]
    for shape in shapes:
        at = {m: cells[(shape, m, 4)] for m in ends}
        speed = [" / ".join(f"{cells[(shape, m, k)]['speedup']:.2f}x" for m in ends) + " (" +
                 " / ".join(f"{cells[(shape, m, k)]['roofline_pct']:.0f}" for m in ends) + "%)" for k in bits]
        int4 = " / ".join(f"{at[m]['cublas_us'] / at[m]['int4_us']:.2f}x" if at[m].get("int4_us") else "n/a"
                          for m in ends)
        lines.append(f"| {_label(shape)} | " + " / ".join(_us(at[m]["cublas_us"]) for m in ends) + " | " +
                     " / ".join(_us(at[m]["floor_us"]) for m in ends) + " | " + " | ".join(speed) + " | " +
                     " / ".join(f"{at[m]['copy_roofline_pct']:.0f}" for m in ends) + "% |" +
                     (f" {int4} |" if with_int4 else ""))
    m1 = " / ".join(f"{_geomean(cells[(s, 1, k)]['speedup'] for s in shapes):.2f}x" for k in bits)
    upto16 = " / ".join(f"{_geomean(r['speedup'] for (s, m, kk), r in cells.items() if kk == k and m <= 16):.2f}x"
                        for k in bits)
    bf16 = _cells(rows, "bf16")
    ratios = sorted(bf16[key]["kbit_us"] / cells[key]["kbit_us"] for key in cells if key[1] <= 16 and key in bf16)
    lines += ["", f"Geomean over the {len(shapes)} shapes, k = {bits[0]}..{bits[-1]}: M = 1 {m1}; M ≤ 16 {upto16}."]
    if ratios:
        lines[-1] += f" bf16 {ratios[0]:.2f}-{ratios[-1]:.2f}x fp16's time."
    return "\n".join(lines)


def batch_table(rows: list[dict]) -> str:
    """k = 4, fp16: the fused op's speedup over cuBLAS fp16, one row per shape, one column per M from 32 tokens; where
    the planner runs dequantize + cuBLAS instead (``planned_path``, runs that recorded it), that path's too."""
    cells = _cells(rows)
    ms = sorted({m for _, m, k in cells if m >= 32 and k == 4})

    def cell(r: dict) -> str:
        if r.get("planned_path") != "dequantize_cublas":
            return f"{r['speedup']:.2f}x"
        return f"{r['speedup']:.2f}x (dq {r['cublas_us'] / r['planned_us']:.2f}x)"

    lines = ["| k = 4, fused | " + " | ".join(f"M = {m}" if i == 0 else str(m) for i, m in enumerate(ms)) + " |",
             "|---|" + "---|" * len(ms)]
    for shape in _shapes(cells, ms):
        lines.append(f"| {_label(shape)} | " + " | ".join(cell(cells[(shape, m, 4)]) for m in ms) + " |")
    return "\n".join(lines)


TABLES = {"decode": decode_table, "batch": batch_table}

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in TABLES:
        sys.exit(__doc__)
    print(TABLES[sys.argv[1]](load(sys.argv[2])))
