"""benchmarks/bench_gemm.py's derived columns: the limit of a call and its share, and re-rendering saved results."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("kbit_bench_gemm", ROOT / "benchmarks" / "bench_gemm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(shape, m, k, kbit_us, floor_us, cublas_us):
    k_in, n_out = (int(v) for v in shape.split("->"))
    return {"shape": shape, "k_in": k_in, "n_out": n_out, "dtype": "fp16", "M": m, "K": k, "kbit_us": kbit_us,
            "floor_us": floor_us, "roofline_pct": 100 * floor_us / kbit_us, "copy_us": floor_us * 1.2,
            "copy_roofline_pct": 100 / 1.2, "cublas_us": cublas_us, "speedup": cublas_us / kbit_us,
            "cublas_roofline_pct": 50.0, "floor_speedup": cublas_us / floor_us, "dequant_cublas_us": None,
            "int4_us": None, "bnb_us": None, "gemlite_us": None, "err_ratio": 1.0, "finite": True}


def test_the_limit_is_the_floor_or_the_flops_at_cublas_rate_at_4096_tokens(bench):
    # 4096 -> 4096 at 4096 tokens in 200 us: 687 TFLOP/s dense; at 256 tokens the FLOPs take 12.5 us, over the floor
    rows = [_row("4096->4096", 4096, 4, 210.0, 60.0, 200.0), _row("4096->4096", 256, 4, 25.0, 5.0, 20.0),
            _row("4096->4096", 1, 4, 6.0, 2.5, 8.0), _row("2048->1536", 256, 4, 13.5, 0.7, 6.8)]
    bench.add_limits(rows)
    assert rows[0]["limit_us"] == pytest.approx(200.0)  # cuBLAS's own time at the rate's token count
    assert rows[1]["limit_us"] == pytest.approx(200.0 * 256 / 4096) and rows[1]["limit_pct"] == pytest.approx(50.0)
    assert rows[2]["limit_us"] == 2.5 and rows[2]["limit_pct"] == pytest.approx(100 * 2.5 / 6.0)  # bytes bound
    assert rows[3]["limit_us"] == 0.7  # no 4096-token time of its own shape: the floor


def test_render_writes_the_share_table_only_with_dense_rates(bench, tmp_path, capsys):
    env = {"device": "GPU", "date": "today", "torch": "2", "torch_cuda": "13", "commit": "abc", "sm": "9.0",
           "num_sms": 132, "l2_bytes": 2**20}
    with_rate = [_row("4096->4096", m, k, 10.0 * m / 64 + 5, 1.0 + m / 100, 8.0 * m / 64 + 4)
                 for m in (64, 256, 4096) for k in (2, 4)]
    for rows, shown in ((with_rate, True), ([r for r in with_rate if r["M"] != 4096], False)):
        path = tmp_path / "gemm_GPU.json"
        path.write_text(json.dumps({"env": env, "copy_bandwidth": 4e12, "args": {"calls": 20, "replays": 7},
                                    "rows": rows, "errors": [], "peer_notes": []}))
        assert bench.main(["--render", str(path)]) == 0
        md, saved = (tmp_path / "gemm_GPU.md").read_text(), json.loads(path.read_text())
        assert ("## Share of the limit" in md) == shown and ("% of the limit" in capsys.readouterr().out) == shown
        assert all(r["limit_us"] >= r["floor_us"] for r in saved["rows"])
        assert "| 4096->4096 | fp16 | 64 |" in md
