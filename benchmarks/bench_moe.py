"""Benchmark a mixture-of-experts layer: kbit's grouped fused GEMM against the same layer in bf16.

    python benchmarks/bench_moe.py              # the four models' layers, decode 1-16 tokens, prefill 512 and 4096
    python benchmarks/bench_moe.py --quick      # 1, 16 and 512 tokens
    python benchmarks/bench_moe.py --models qwen3-30b-a3b --tokens 1,16 --k 2,4

One forward of a layer's routed experts (hidden states [T, H], top-k ids and weights in, [T, H] out), per
(layer, tokens), timed as a CUDA graph of ``--calls`` forwards (common.time_graph), each with its own routing
(softmax top-k of random router logits), so that a call reads other experts than those the previous one left
in L2:

  bf16      transformers' experts module in bf16 (Qwen3MoeExperts: the families compute the same), with its
            grouped_mm implementation (torch._grouped_mm / F.grouped_mm) where that exists, else its per-expert
            loop ("eager")
  kbit Kk   kbit.KbitExperts: moe_route, the grouped GEMM for gate/up (SiLU epilogue) and down (routing
            weights in the epilogue), moe_combine
  deq+bf16  every expert dequantized to bf16 each call (one kbit dequantize launch per projection and a
            per-expert scale), then the bf16 module on those weights

floor: the kbit bytes of the experts a forward reads (mean distinct experts of its routings) at the device's
copy bandwidth. Targets: decode (<= 16 tokens) >= 3x bf16, prefill >= 1x. Writes
``moe_<device>.md`` / ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402  (benchmarks/common.py; puts the repo root on sys.path)
    copy_bandwidth, device_tag, env_info, floor_us, fmt_pct, fmt_ratio, fmt_us, free_memory, markdown_table,
    out_dir_default, parse_int_list, require_cuda, text_table, time_graph, write_outputs,
)

import kbit  # noqa: E402
from kbit import ops  # noqa: E402
from kbit.formats import padded_in_features  # noqa: E402

# name: (experts E, hidden H, expert intermediate I, top-k)
MODELS = {
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "deepseek-v2-lite": (64, 2048, 1408, 6),
    "glm-4.7-flash": (64, 2048, 1536, 4),
    "mixtral-8x7b": (8, 4096, 14336, 2),
}
DECODE = (1, 2, 4, 8, 16)
PREFILL = (512, 4096)
DECODE_TARGET, PREFILL_TARGET = 3.0, 1.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--tokens", default=",".join(map(str, DECODE + PREFILL)), help="comma-separated token counts")
    p.add_argument("--k", default="4", help="comma-separated bit widths in 2..5 (default 4)")
    p.add_argument("--quick", action="store_true", help="tokens 1, 16 and 512 only")
    p.add_argument("--calls", type=int, default=32, help="forwards (routings) per CUDA graph at <= 16 tokens")
    p.add_argument("--prefill-calls", type=int, default=6, help="forwards per CUDA graph above 16 tokens")
    p.add_argument("--replays", type=int, default=7, help="graph replays; the median is reported")
    p.add_argument("--out", default=None, help="output folder (default: benchmarks/results or $KBIT_BENCH_OUT)")
    return p.parse_args(argv)


def bf16_experts(E: int, H: int, I: int):
    """(module, implementation): transformers' Qwen3MoeExperts in bf16 on the GPU, random N(0, 0.02) weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, hidden_act="silu")
    grouped = hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")
    config._experts_implementation = "grouped_mm" if grouped else "eager"
    with torch.device("cuda"):
        module = Qwen3MoeExperts(config).to(torch.bfloat16)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, 0.02)
        module.down_proj.normal_(0, 0.02)
    return module.eval(), config._experts_implementation


def routings(T: int, top_k: int, E: int, n: int, seed: int) -> list:
    """n routings of T tokens: softmax top-k of N(0, 1) router logits, weights renormalized (fp32, int64 ids)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(n):
        w, idx = torch.topk(torch.softmax(torch.randn(T, E, generator=g, device="cuda"), dim=-1), top_k)
        out.append((idx, w / w.sum(-1, keepdim=True)))
    return out


def dequantized(experts: kbit.KbitExperts, proj: str, packed: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """Every expert of ``proj`` in bf16, [E, N, K], from its storage tensors ``packed`` / ``absmax``: one dequantize
    launch at unit scale, then each expert's scale."""
    (N, K), E = experts.shapes()[proj], experts.num_experts
    in_features_padded = padded_in_features(K)
    one = torch.ones((), device=packed.device)
    flat = ops.dequantize(packed.view(-1), absmax.view(-1), experts.codebook, experts.bits,
                          E * N * in_features_padded, torch.bfloat16, one)
    scale = getattr(experts, f"{proj}_scale").to(torch.bfloat16)[:, None, None]
    return flat.view(E, N, in_features_padded)[:, :, :K] * scale


def time_calls(fn, inputs, replays: int) -> float:
    with torch.no_grad():
        return time_graph([lambda a=a: fn(*a) for a in inputs], replays=replays)["us"]


def bench_layer(name: str, T: int, bits: list, args, bandwidth: float) -> list:
    E, H, I, top_k = MODELS[name]
    bf16, impl = bf16_experts(E, H, I)
    n = args.calls if T <= 16 else args.prefill_calls
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    inputs = [(x, idx, w) for idx, w in routings(T, top_k, E, n, seed=T * 7919 + E)]
    distinct = sum(int(idx.unique().numel()) for _, idx, _ in inputs) / n
    bf16_us = time_calls(bf16, inputs, args.replays)
    rows = []
    for k in bits:
        experts, _ = kbit.KbitExperts.from_weights(bf16.gate_up_proj.detach(), bf16.down_proj.detach(), bits=k)

        # the peer holds the storage format and dequantizes it each call; on the GPU the layer holds its GEMM
        # layouts, so the storage tensors are derived once, outside the timed calls
        storage = {proj: experts.storage(proj) for proj in ("gate_up", "down")}

        def deq_bf16(x, idx, w, experts=experts, storage=storage):
            params = {f"{proj}_proj": dequantized(experts, proj, *storage[proj]) for proj in ("gate_up", "down")}
            return torch.func.functional_call(bf16, params, (x, idx, w))

        with torch.no_grad():
            got, want = experts(*inputs[0]).float(), deq_bf16(*inputs[0]).float()
        rel_err = float((got - want).norm() / want.norm())
        kbit_us = time_calls(experts, inputs, args.replays)
        deq_us = time_calls(deq_bf16, inputs, args.replays)
        weight_bytes = distinct * 3 * H * I * (k / 8 + 1 / 32)
        target = DECODE_TARGET if T <= 16 else PREFILL_TARGET
        rows.append(dict(model=name, tokens=T, k=k, experts=E, hidden=H, intermediate=I, top_k=top_k,
                         distinct_experts=distinct, bf16_impl=impl, bf16_us=bf16_us, kbit_us=kbit_us, deq_us=deq_us,
                         speedup=bf16_us / kbit_us, speedup_vs_deq=deq_us / kbit_us,
                         floor_us=floor_us(weight_bytes, bandwidth), rel_err_vs_deq=rel_err, target=target,
                         meets_target=bf16_us / kbit_us >= target))
        del experts, storage
        free_memory()
    del bf16
    free_memory()
    return rows


def render(rows: list, info: dict) -> tuple:
    """(markdown report, terminal table)."""
    headers = ["layer", "tokens", "K", "bf16 µs", "kbit µs", "vs bf16", "deq+bf16 µs", "vs deq", "floor µs",
               "% floor", "target", "rel err"]
    table = [[r["model"], r["tokens"], r["k"], fmt_us(r["bf16_us"]), fmt_us(r["kbit_us"]), fmt_ratio(r["speedup"]),
              fmt_us(r["deq_us"]), fmt_ratio(r["speedup_vs_deq"]), fmt_us(r["floor_us"]),
              fmt_pct(100 * r["floor_us"] / r["kbit_us"]), ("met " if r["meets_target"] else "MISS ") +
              fmt_ratio(r["target"]), f"{r['rel_err_vs_deq']:.1e}"] for r in rows]
    impl = sorted({r["bf16_impl"] for r in rows})
    head = (f"# MoE layer: kbit grouped GEMM vs bf16 ({info.get('device', '?')}, commit {info.get('commit', '?')}, "
            f"{info.get('date', '?')})\n\nbf16 experts implementation: {', '.join(impl)}. Per forward of the routed "
            "experts; CUDA graphs, a different routing per call. rel err: kbit vs dequantize + bf16 (same "
            "weights).\n\n")
    return head + markdown_table(headers, table) + "\n", text_table(headers, table)


def main(argv=None) -> int:
    args = parse_args(argv)
    require_cuda("bench_moe.py")
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"unknown --models {unknown}; known: {list(MODELS)}")
    tokens = [1, 16, 512] if args.quick else parse_int_list(args.tokens, "--tokens")
    bits = parse_int_list(args.k, "--k", allowed=(2, 3, 4, 5))
    info = env_info()
    bandwidth = copy_bandwidth()
    rows = []
    for name in models:
        for T in tokens:
            rows.extend(bench_layer(name, T, bits, args, bandwidth))
            r = rows[-1]
            print(f"{name:18s} T={T:5d} K={r['k']}: bf16 {fmt_us(r['bf16_us'])} us, kbit {fmt_us(r['kbit_us'])} us "
                  f"({fmt_ratio(r['speedup'])}), deq+bf16 {fmt_us(r['deq_us'])} us", flush=True)
    markdown, text = render(rows, info)
    print(text)
    out = Path(args.out) if args.out else out_dir_default()
    md, js = write_outputs(out, f"moe_{device_tag(info.get('device', 'gpu'))}", markdown,
                           dict(env=info, bandwidth=bandwidth, rows=rows))
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
