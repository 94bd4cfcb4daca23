"""Chart of a bench_gemm.py result: speedup over cuBLAS vs M, one panel per shape, one line per K.

    python benchmarks/plot.py benchmarks/results/gemm_NVIDIA_H200.json [-o out.png]

Needs matplotlib (``plot_gemm`` returns None without it, so the benchmark can run anywhere).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_gemm(data: dict, path) -> "Path | None":
    """Write the chart to ``path``; returns the path, or None when matplotlib is missing."""
    if not _have_matplotlib():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    rows = data["rows"]
    dtypes = sorted({r["dtype"] for r in rows})
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    ks = sorted({r["K"] for r in rows})
    ncol = min(3, len(shapes))
    nrow = math.ceil(len(shapes) / ncol)
    path = Path(path)
    fig, axes = plt.subplots(nrow * len(dtypes), ncol, figsize=(5 * ncol, 3.6 * nrow * len(dtypes)), squeeze=False)
    colors = {2: "tab:red", 3: "tab:orange", 4: "tab:blue", 5: "tab:green"}
    for di, dt in enumerate(dtypes):
        for si, shape in enumerate(shapes):
            ax = axes[di * nrow + si // ncol][si % ncol]
            sel = [r for r in rows if r["dtype"] == dt and r["shape"] == shape]
            ms = sorted({r["M"] for r in sel})
            for k in ks:
                by_k = [r for r in sorted(sel, key=lambda r: r["M"]) if r["K"] == k]
                pts = [(r["M"], r["speedup"]) for r in by_k if r["speedup"]]
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=3, color=colors.get(k), label=f"kbit K={k}")
                fl = [(r["M"], r["floor_speedup"]) for r in by_k if r.get("floor_speedup")]
                if fl and k == 4:
                    ax.plot(*zip(*fl), ls=":", color=colors.get(k), alpha=0.6, label="K=4 floor")
            by_m = {r["M"]: r for r in sel}
            i4 = [(m, by_m[m]["cublas_us"] / by_m[m]["int4_us"]) for m in ms
                  if by_m[m].get("int4_us") and by_m[m].get("cublas_us")]
            if i4:
                ax.plot(*zip(*i4), ls="--", color="black", lw=1, label="torch int4")
            dq = [(r["M"], r["cublas_us"] / r["dequant_cublas_us"]) for r in sorted(sel, key=lambda r: r["M"])
                  if r["K"] == 4 and r.get("dequant_cublas_us") and r.get("cublas_us")]
            if dq:
                ax.plot(*zip(*dq), ls="-.", color="gray", lw=1, label="K=4 dequant+cuBLAS")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.set_title(f"{shape} ({dt})", fontsize=10)
            ax.set_xlabel("M")
            ax.set_ylabel("speedup over cuBLAS")
            ax.grid(True, which="both", alpha=0.3)
            if di == 0 and si == 0:
                ax.legend(fontsize=7)
        for si in range(len(shapes), nrow * ncol):
            axes[di * nrow + si // ncol][si % ncol].axis("off")
    runs = data.get("runs", [data])  # a JSON written before runs were listed is its one run
    fig.suptitle(f"kbit fused GEMM vs cuBLAS on {runs[0]['env'].get('device', '?')} (" + "; ".join(
        f"copy {run['copy_bandwidth'] / 1e12:.2f} TB/s, commit {run['env'].get('commit', '?')}" for run in runs) + ")")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Plot a bench_gemm.py JSON result.")
    p.add_argument("json", help="gemm_<device>.json written by bench_gemm.py")
    p.add_argument("-o", "--output", help="PNG path (default: next to the JSON)")
    args = p.parse_args(argv)
    data = json.loads(Path(args.json).read_text())
    out = Path(args.output) if args.output else Path(args.json).with_suffix(".png")
    written = plot_gemm(data, out)
    if written is None:
        print("matplotlib is not installed", file=sys.stderr)
        return 1
    print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
