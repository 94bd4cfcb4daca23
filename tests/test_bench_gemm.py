"""benchmarks/bench_gemm.py's derived columns (the limit of a call and its share), re-rendering saved results and
merging runs measured apart into one result."""

import json

import pytest

from repo_script import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_gemm.py")


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


def _env(device="GPU", commit="abc", date="today"):
    return {"device": device, "date": date, "torch": "2", "torch_cuda": "13", "commit": commit, "sm": "9.0",
            "num_sms": 132, "l2_bytes": 2**20}


def _run_file(path, rows, env, copy_bandwidth=4e12, m=None):
    """A results JSON as a sweep writes it (``runs``, rows naming run 0); without ``m``, the layout written before
    runs were listed (its one run's provenance at the top level)."""
    if m is None:
        data = {"env": env, "copy_bandwidth": copy_bandwidth, "args": {"calls": 20, "replays": 7}, "rows": rows,
                "errors": [], "peer_notes": []}
    else:
        run = {"env": env, "copy_bandwidth": copy_bandwidth, "l2_bytes": 2**20, "elapsed_s": 1.0,
               "args": {"shapes": ["4096->4096"], "m": m, "k": [2, 4], "dtypes": ["fp16"], "calls": 20, "replays": 7,
                        "peers": []}}
        data = {"runs": [run], "rows": [dict(r, run=0) for r in rows], "errors": [], "peer_notes": []}
    path.write_text(json.dumps(data))
    return path


def test_render_writes_the_share_table_only_with_dense_rates(bench, tmp_path, capsys):
    env = _env()
    with_rate = [_row("4096->4096", m, k, 10.0 * m / 64 + 5, 1.0 + m / 100, 8.0 * m / 64 + 4)
                 for m in (64, 256, 4096) for k in (2, 4)]
    for rows, shown in ((with_rate, True), ([r for r in with_rate if r["M"] != 4096], False)):
        path = _run_file(tmp_path / "gemm_GPU.json", rows, env)
        assert bench.main(["--render", str(path)]) == 0
        md, saved = (tmp_path / "gemm_GPU.md").read_text(), json.loads(path.read_text())
        assert ("## Share of the limit" in md) == shown and ("% of the limit" in capsys.readouterr().out) == shown
        assert all(r["limit_us"] >= r["floor_us"] for r in saved["rows"])
        assert "| 4096->4096 | fp16 | 64 |" in md


def test_render_merges_a_decode_and_a_prefill_run_into_one_set_keeping_each_run_s_provenance(bench, tmp_path, capsys):
    decode = [_row("4096->4096", m, k, 5.0 + m, 2.0, 8.0 + m) for k in (2, 4) for m in (1, 16)]
    prefill = [_row("4096->4096", m, k, 10.0 * m / 64 + 5, 1.0 + m / 100, 8.0 * m / 64 + 4)
               for k in (2, 4) for m in (64, 4096)]
    a = _run_file(tmp_path / "gemm_GPU_decode.json", decode, _env(commit="aaa1111", date="day 1"), 4.2e12)
    b = _run_file(tmp_path / "gemm_GPU_prefill.json", prefill, _env(commit="bbb2222", date="day 2"), 4.1e12,
                  m=[64, 4096])
    out = tmp_path / "merged"
    assert bench.main(["--render", str(a), str(b), "--out", str(out)]) == 0
    saved = json.loads((out / "gemm_GPU.json").read_text())
    assert [(run["env"]["commit"], run["env"]["date"], run["copy_bandwidth"]) for run in saved["runs"]] == [
        ("aaa1111", "day 1", 4.2e12), ("bbb2222", "day 2", 4.1e12)]
    assert saved["runs"][1]["args"]["m"] == [64, 4096]
    # every measured row once, naming its run, in a sweep's order (K, then M); the measurements untouched
    assert [(r["K"], r["M"], r["run"]) for r in saved["rows"]] == [
        (k, m, 0 if m <= 16 else 1) for k in (2, 4) for m in (1, 16, 64, 4096)]
    by_cell = {(r["M"], r["K"]): r for r in saved["rows"]}
    assert all(by_cell[(r["M"], r["K"])]["kbit_us"] == r["kbit_us"] for r in decode + prefill)
    # the prefill run's 4096-token cuBLAS time gives the decode rows their limit too
    assert by_cell[(16, 4)]["limit_us"] == pytest.approx(max(2.0, (8.0 * 4096 / 64 + 4) * 16 / 4096))
    md = (out / "gemm_GPU.md").read_text()
    assert "| 0 | day 1 | aaa1111 |" in md and "| 4.20 |" in md and "| 1 | day 2 | bbb2222 |" in md
    assert "| 4096->4096 | fp16 | 1 |" in md and "| 4096->4096 | fp16 | 4096 |" in md and "## Share of the limit" in md
    assert "M<=16: K=2" in md and "M>=32: K=2" in md
    assert "copy 4.20 / 4.10 TB/s" in capsys.readouterr().out
    # merging the merged set with a further run of its own cells is refused, and so is another device's run
    again = _run_file(tmp_path / "gemm_GPU_again.json", decode[:1], _env(), m=[1])
    assert bench.main(["--render", str(out / "gemm_GPU.json"), str(again)]) == 2
    assert "4096->4096 fp16 M=1 K=2 is measured in both" in capsys.readouterr().err
    other = _run_file(tmp_path / "gemm_other.json", [_row("4096->4096", 32, 4, 9.0, 2.0, 9.0)], _env("GPU2"), m=[32])
    assert bench.main(["--render", str(a), str(other)]) == 2
    assert "different devices" in capsys.readouterr().err
    with pytest.raises(ValueError, match="GPU2"):
        bench.merge_results([("a", bench.load_results(a)), ("other", bench.load_results(other))])


@pytest.mark.parametrize("k_in", (512, 1000))
def test_dequant_cublas_runs_what_a_gpu_layer_runs_from_the_gemm_layout(bench, k_in):
    """The dequantize + cuBLAS peer rotates the GEMM layout (as the fused peer does) and dequantizes straight from it,
    as a layer holding only its layout does (``QuantizedWeight._dequantize``): the same product, a padded k sliced."""
    import torch

    import kbit

    dq = bench.DequantCublas(torch.float16, 4)
    layout = dq.prepare((torch.randn(64, k_in) * 0.02).to(torch.float16))
    assert [t.data_ptr() for t in layout] == [t.data_ptr() for t in dq.qw.gemm_layout()]
    x = torch.randn(3, k_in).to(torch.float16)
    resident = dq.qw.gemm_resident()
    expected = torch.nn.functional.linear(x, resident._dequantize(torch.float16))
    assert torch.equal(dq.call(x, dq.clone(layout)), expected)


def test_the_full_table_shows_the_planned_paths_time(bench, tmp_path):
    rows = [dict(_row("4096->4096", 1, 4, 5.0, 2.0, 8.0), planned_path="dequantize_cublas", planned_us=6.25),
            dict(_row("4096->4096", 16, 4, 7.0, 2.0, 9.0), planned_path="fused", planned_us=7.0)]
    path = _run_file(tmp_path / "gemm_GPU.json", rows, _env(), m=[1, 16])
    assert bench.main(["--render", str(path)]) == 0
    table = (tmp_path / "gemm_GPU.md").read_text().split("## All measurements")[1]
    header = next(line for line in table.splitlines() if line.startswith("| shape"))
    column = header.split("|").index(" planned us ")
    cells = [line.split("|")[column].strip() for line in table.splitlines() if line.startswith("| 4096->4096")]
    assert cells == ["6.25", "7.00"]
