"""Tensor-parallel decode speed: TP=1 vs TP=2 greedy decode at batch 1, kbit vs 16-bit, on a Llama-3-70B-shaped
model (hidden 8192, intermediate 28672, 64 heads / 8 KV heads, vocab 128256; 4 layers by default). Run it with
torchrun, one process per GPU:

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py                       # H200 x2: fp16 and kbit K=4
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --mode graph          # CUDA graphs instead of compile
    KBIT_TP_ALL_REDUCE=symmetric torchrun --nproc-per-node 2 benchmarks/bench_tp.py   # decode sums: symmetric memory
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --quantize-lm-head 4  # kbit rows quantize the lm_head too
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --device cpu --layers 2 --hidden 256 --intermediate 512 \\
        --heads 4 --kv-heads 2 --vocab 1000 --new-tokens 4 --repeats 1 --no-write      # tiny gloo smoke run

Each format starts from the same seeded random model (``bench_e2e.build_model``: kbit rows quantize q/k/v/o and
gate/up/down with ``kbit.quantize_model``; embeddings and lm_head stay 16-bit, the lm_head quantized with
``--quantize-lm-head``). TP=1 runs on rank 0 alone (the
other ranks wait); TP=2 shards the model over every rank: kbit layers with ``kbit.tensor_parallel.shard_model``,
the 16-bit baseline's Linear layers with torch's own ``parallelize_module`` (``ColwiseParallel`` /
``RowwiseParallel``), both from the model's transformers ``tp_plan``: the 16-bit lm_head split by vocabulary with
its logits gathered on both sides, the embeddings replicated. A greedy divergence between TP=2 and TP=1 on random
weights comes from near-ties of the two best logits (all-reduces sum in another order);
``tests/test_tensor_parallel.py``'s NCCL test checks the margin at each divergence. Decoding is
``bench_e2e.GreedyDecoder`` (static KV cache; ``--mode compile``: torch.compile
reduce-overhead, CUDA graphs; ``graph``: one captured CUDA graph per step), the same on both sides. Throughput is
``new_tokens / time`` (median of ``--repeats``); the run also checks that TP=2's greedy tokens equal TP=1's
(``--check-tokens``) and reports the first divergence otherwise. Results: ``benchmarks/results/tp_<device>.md`` and
``.json``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from bench_e2e import (ATTENTIONS, PROFILE_HEADERS, GreedyDecoder, build_model, llama_config,  # noqa: E402
                       profile_cells, profile_steps)
from common import env_info, free_memory, markdown_table, write_outputs  # noqa: E402

from kbit import symmetric_all_reduce  # noqa: E402
from kbit import tensor_parallel as tp  # noqa: E402

SHAPE = dict(layers=4, hidden=8192, intermediate=28672, heads=64, kv_heads=8, vocab=128256)  # Llama-3-70B


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for k, v in SHAPE.items():
        p.add_argument("--" + k.replace("_", "-"), type=int, default=v)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--quantize-lm-head", type=int, default=0, metavar="BITS",
                   help="kbit rows quantize the lm_head too, to BITS (default: it stays 16-bit)")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    p.add_argument("--mode", default=None, choices=("compile", "graph", "eager"),
                   help="default: compile on CUDA, eager on CPU")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--check-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="on CUDA: each row's decode step by kernel group (kbit GEMM, cuBLAS, collectives, ...)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="with --profile: each rank's profiled steps of each row as a Chrome trace (CPU, CUDA) in DIR")
    p.add_argument("--formats", default="dense,kbit", help="which rows: dense, kbit or both (comma-separated)")
    p.add_argument("--attention", default="sdpa", choices=ATTENTIONS,
                   help="every row's attention, as bench_e2e.py --attention")
    return p.parse_args(argv)


def torch_tp_plan(model) -> dict:
    """The 16-bit baseline's plan for torch's ``parallelize_module``: every Linear the transformers plan shards (the
    lm_head by vocabulary, its logits gathered, as ``shard_model`` does)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate())}
    plan = tp.model_plan(model)
    out = {}
    for name, module in model.named_modules():
        style = next((s for key, s in plan.items() if tp._pattern(key).fullmatch(name)), None)
        if isinstance(module, torch.nn.Linear) and style in styles:
            out[name] = styles[style]()
    return out


def shard(model, quantized: bool, device) -> None:
    if not quantized:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = DeviceMesh.from_group(dist.group.WORLD, device.type)
        parallelize_module(model, mesh, torch_tp_plan(model))
    else:
        tp.shard_model(model)


def resident_bytes(model) -> int:
    """Weight bytes this rank holds: kbit storage plus every parameter's local part."""
    params = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                 for p in model.parameters())
    return tp.kbit_bytes(model) + params


def measure(model, prompt, args, mode, fmt: str, sharded: bool) -> dict:
    """Every rank of the row calls this (their steps meet in the collectives); ``profile`` is this rank's."""
    dec = GreedyDecoder(model, 1, args.prompt_len + max(args.new_tokens, args.check_tokens) + 8, mode).prepare(prompt)
    seconds = dec.time_decode(prompt, args.new_tokens, args.repeats)
    tokens = dec.generate(prompt, args.check_tokens)[0].tolist()
    row = {"tokens_per_s": args.new_tokens / seconds, "tokens": tokens, "bytes": resident_bytes(model)}
    if mode == "compile":
        row["compile"] = dec.compile_report()  # bench_e2e.ONE_CUDA_GRAPH where the step stayed one CUDA graph
    if args.profile and prompt.is_cuda:
        trace = args.trace and str(Path(args.trace) / f"{fmt}_tp{dist.get_world_size() if sharded else 1}_rank"
                                                       f"{dist.get_rank()}.json")
        row["profile"] = profile_steps(dec, prompt, trace=trace)
    return row


def first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def run(args):
    """Every format at TP=1 (rank 0) and TP=world; the results on rank 0, None on the others."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mode = args.mode or ("compile" if device.type == "cuda" else "eager")
    dtype = getattr(torch, args.dtype)
    config = llama_config(**{k: getattr(args, k) for k in SHAPE})
    torch.manual_seed(args.seed)
    prompt = torch.randint(0, args.vocab, (1, args.prompt_len), device=device)
    rows = {}
    dense = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}[args.dtype]
    kinds = set(args.formats.split(","))
    if not kinds or not kinds <= {"dense", "kbit"}:
        raise SystemExit(f"--formats: dense, kbit or both, not {args.formats!r}")
    kbit_fmt = f"kbit{args.bits}" + (f" + lm_head K={args.quantize_lm_head}" if args.quantize_lm_head else "")
    for fmt in [f for kind, f in (("dense", dense), ("kbit", kbit_fmt)) if kind in kinds]:
        bits = None if fmt == dense else args.bits
        lm_head_bits = None if fmt == dense else args.quantize_lm_head or None

        def build():
            return build_model(config, device, dtype, args.seed, bits=bits, lm_head_bits=lm_head_bits,
                               attention=args.attention)

        if rank == 0:  # TP=1 on one GPU; the others wait
            model = build()
            rows[(fmt, 1)] = measure(model, prompt, args, mode, fmt, sharded=False)
            del model
            free_memory()
        dist.barrier()
        model = build()
        shard(model, bits is not None, device)
        rows[(fmt, world)] = measure(model, prompt, args, mode, fmt, sharded=True)
        del model
        free_memory()
        dist.barrier()
    if rank != 0:
        return None
    info = env_info()
    info.update(world=world, mode=mode, dtype=args.dtype, bits=args.bits, lm_head_bits=args.quantize_lm_head or None,
                shape={k: getattr(args, k) for k in SHAPE},
                prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats,
                backend=dist.get_backend(), transformers=__import__("transformers").__version__,
                all_reduce=symmetric_all_reduce.mode(), attention=args.attention)
    results = []
    for (fmt, size), r in rows.items():
        one = rows[(fmt, 1)]
        results.append(dict(format=fmt, tp=size, tokens_per_s=r["tokens_per_s"], bytes_per_rank=r["bytes"],
                            speedup_vs_tp1=r["tokens_per_s"] / one["tokens_per_s"],
                            tokens_equal_tp1=r["tokens"] == one["tokens"],
                            first_divergence=first_divergence(r["tokens"], one["tokens"])))
        results[-1].update({key: r[key] for key in ("compile", "profile") if key in r})
    summary = {}
    kbit_tp = rows.get((kbit_fmt, world))
    if kbit_tp is not None:
        summary["kbit_tp_speedup"] = kbit_tp["tokens_per_s"] / rows[(kbit_fmt, 1)]["tokens_per_s"]
        if (dense, world) in rows:
            summary["kbit_vs_fp16_at_tp"] = kbit_tp["tokens_per_s"] / rows[(dense, world)]["tokens_per_s"]
    return {"env": info, "results": results, "summary": summary}


def markdown(result: dict) -> str:
    env, s = result["env"], result["summary"]
    shape = env["shape"]
    head = (f"# Tensor-parallel decode, batch 1\n\nLlama-3-70B-shaped model ({shape['layers']} layers, hidden "
            f"{shape['hidden']}, intermediate {shape['intermediate']}, {shape['heads']} heads / {shape['kv_heads']} "
            f"KV heads, vocab {shape['vocab']}), random weights, {env['dtype']}, greedy decode with a static KV "
            f"cache, mode `{env['mode']}`, prompt {env['prompt_len']}, {env['new_tokens']} timed tokens, median of "
            f"{env['repeats']}; {env.get('device', 'cpu')} x{env['world']} ({env['backend']}; kbit's decode sums: "
            f"{env.get('all_reduce', 'collective')}; attention {env.get('attention', 'sdpa')}), torch {env['torch']}, "
            f"transformers {env['transformers']}, commit {env['commit']}, {env['date']}.\n\n")
    rows = [[r["format"], r["tp"], f"{r['tokens_per_s']:.1f}", f"{r['bytes_per_rank'] / 2**30:.2f}",
             f"{r['speedup_vs_tp1']:.2f}x", "yes" if r["tokens_equal_tp1"] else f"no (from {r['first_divergence']})"]
            for r in result["results"]]
    table = markdown_table(["weights", "TP", "tokens/s", "GiB per rank", "vs TP=1", "greedy tokens == TP=1"], rows)
    lines = []
    if "kbit_tp_speedup" in s:
        lines.append(f"kbit TP={env['world']} vs TP=1: {s['kbit_tp_speedup']:.2f}x (target >= 1.6x)")
    if "kbit_vs_fp16_at_tp" in s:
        lines.append(f"kbit vs {env['dtype']} at TP={env['world']}: {s['kbit_vs_fp16_at_tp']:.2f}x (target >= 2x)")
    return head + table + "\n\n" + "".join(line + ".\n" for line in lines) + profile_table(result["results"])


def profile_table(results: list) -> str:
    """Where rank 0's decode step goes per row (torch profiler, GPU kernel µs; idle = step time minus kernel time:
    launch gaps, host work, and waits the collectives do not show as kernel time)."""
    cells = [[r["format"], r["tp"]] + profile_cells(1e6 / r["tokens_per_s"], r["profile"])
             for r in results if "profile" in r]
    if not cells:
        return ""
    return ("\nWhere rank 0's decode step goes (torch profiler, GPU kernel µs; idle = step time minus kernel "
            "time):\n\n" + markdown_table(["weights", "TP"] + PROFILE_HEADERS, cells) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    backend, device_id = "gloo", None
    if args.device == "cuda":  # this rank's GPU named up front: NCCL's barrier then need not guess it from the rank
        backend, device_id = "nccl", torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    # TP=1 compiles while the others wait
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30), device_id=device_id)
    if dist.get_world_size() < 2:
        raise SystemExit("run with torchrun --nproc-per-node 2 (or more)")
    result = run(args)
    if dist.get_rank() == 0:
        md = markdown(result)
        print(md)
        if not args.no_write:
            tag = "cpu" if args.device != "cuda" else env_info().get("device", "gpu").split()[-1].lower()
            for path in write_outputs(Path(args.out_dir), f"tp_{tag}", md, result):
                print("wrote", path)
    dist.barrier()  # rank 0 writes while the others wait; then every rank ends (below)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The results are written: end without destroy_process_group or interpreter shutdown, either of which hangs for
    # minutes on torch 2.11 after CUDA-graphed NCCL collectives (H200 x2); the process's end frees what NCCL holds.
    os._exit(code)
