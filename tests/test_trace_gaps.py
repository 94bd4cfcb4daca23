"""benchmarks/trace_gaps.py: idle spans between kernels of a Chrome trace (all streams merged), grouped by the
kernels on either side, with the host calls that overlap them."""

import json

from repo_script import load_script


def _event(cat, name, ts, dur, tid=7):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def test_gaps_merge_streams_and_name_the_host_calls_through_them(tmp_path, capsys):
    tg = load_script("benchmarks/trace_gaps.py")
    trace = {"traceEvents": [
        _event("kernel", "void kbit::gemm_kernel<4>", 100.0, 10.0),
        _event("kernel", "ncclDevKernel_AllReduce_Sum_f16_RING_LL", 105.0, 20.0, tid=9),  # overlaps: no gap
        _event("kernel", "triton_red_fused_add_gemm_mean_rsqrt_3", 140.0, 5.0),  # 15 us after the NCCL kernel
        _event("kernel", "void kbit::gemm_kernel<4>", 146.0, 4.0),  # 1 us: below --min-us, counted in idle only
        _event("kernel", "nvjet_sm90_hsh_256x8", 200.0, 30.0),  # 50 us gap
        _event("cuda_runtime", "cudaGraphLaunch", 190.0, 15.0),
        _event("cuda_runtime", "cudaStreamWaitEvent", 10.0, 1.0),  # before every gap: not listed
        _event("cpu_op", "aten::mm", 150.0, 40.0),  # not a runtime call: not listed
        {"ph": "i", "name": "marker", "ts": 0.0},
    ]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    kernels, host = tg.load_events(path)
    assert [k[2] for k in kernels][:2] == ["void kbit::gemm_kernel<4>", "ncclDevKernel_AllReduce_Sum_f16_RING_LL"]
    assert [h[2] for h in host] == ["cudaStreamWaitEvent", "cudaGraphLaunch"]
    s = tg.summarize(kernels, host, min_us=2.0, top=5)
    assert s["span_us"] == 130.0 and s["idle_us"] == 66.0 and s["busy_us"] == 64.0
    assert s["by_groups"] == {"kbit GEMM -> cuBLAS GEMM": 50.0, "collectives -> Triton (inductor)": 15.0}
    assert [g["us"] for g in s["largest"]] == [50.0, 15.0]
    assert s["largest"][0]["host_calls"] == ["cudaGraphLaunch"] and s["largest"][1]["host_calls"] == []
    assert tg.summarize([], []) == {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "by_groups": {}, "largest": []}
    assert tg.main([str(path)]) == 0
    printed = capsys.readouterr().out
    assert "span 130 us, kernels 64, idle 66" in printed and "host: cudaGraphLaunch" in printed
