"""Time ``kbit.quantize_model`` per method on an 8B-shaped Llama with random weights, on one GPU.

    python benchmarks/bench_quantize_methods.py                       # 8 of 32 blocks, rtn/mse/gptq, x 4 for 8B
    python benchmarks/bench_quantize_methods.py --layers 32           # the whole 8B model (slower)
    python benchmarks/bench_quantize_methods.py --methods gptq+rotate --layers 2
    python benchmarks/bench_quantize_methods.py --tiny --device cpu   # a tiny config: checks the script runs

The model has Llama-3-8B's shapes (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocabulary 128256)
with random bf16 weights, built on the GPU; only its first ``--layers`` decoder blocks are built. Every decoder
Linear is quantized (``lm_head`` stays, as ``quantize_model``'s default). Calibration for ``gptq``: random token
ids, ``--calib-seqs`` x ``--calib-len`` (default 128 x 512), run block by block as ``quantize_model`` does.

Blocks of one model are identical in shape and each method's work is per block (the calibration's embedding and
``lm_head`` passes are a small share), so the time for the whole model is reported as the measured time times
``32 / --layers``: the table says so in its header. Times include the CUDA synchronization at the end of each
method, not building the model or the first call's CUDA compilation (a warm-up quantizes a small model first).
Targets: data-free methods <= 60 s, calibrated <= 600 s for the 8B model on one H200.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kbit  # noqa: E402

FULL_LAYERS = 32
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(hidden_size=128, intermediate_size=448, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
            max_position_embeddings=256)
TARGET_SECONDS = {"rtn": 60, "mse": 60, "gptq": 600}


def build_model(shape: dict, layers: int, device: str, dtype: torch.dtype, seed: int = 0):
    """A randomly initialized Llama of ``shape`` with ``layers`` decoder blocks, on ``device`` in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kbit.hf import from_config

    torch.manual_seed(seed)
    config = LlamaConfig(**shape, num_hidden_layers=layers, tie_word_embeddings=False)
    with torch.device(device):
        model = from_config(LlamaForCausalLM, config, dtype=dtype)
    return model.eval()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_method(spec: str, shape: dict, layers: int, device: str, dtype: torch.dtype, bits: int, calibration):
    """(seconds to quantize, number of layers quantized) for ``spec`` (``<method>`` or ``<method>+rotate``)."""
    method, _, option = spec.partition("+")
    model = build_model(shape, layers, device, dtype)
    _sync(device)
    t = time.perf_counter()
    kbit.quantize_model(model, bits=bits, method=method, calibration=calibration if method == "gptq" else None,
                        rotate=option == "rotate", progress=False)
    _sync(device)
    seconds = time.perf_counter() - t
    count = sum(isinstance(m, kbit.KbitLinear) for m in model.modules())
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return seconds, count


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8, help=f"decoder blocks to build (of {FULL_LAYERS})")
    p.add_argument("--methods", default="rtn,mse,gptq", help="comma-separated; <method>+rotate for the rotation")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--calib-seqs", type=int, default=128)
    p.add_argument("--calib-len", type=int, default=512)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama instead of the 8B shapes (to test the script)")
    p.add_argument("--out", default=None, help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("no CUDA device: use --device cpu (with --tiny)")
    shape = TINY if args.tiny else LLAMA3_8B
    dtype = torch.bfloat16
    factor = FULL_LAYERS / args.layers
    g = torch.Generator().manual_seed(0)
    calibration = torch.randint(0, shape["vocab_size"], (args.calib_seqs, args.calib_len), generator=g)

    # warm-up: load (or build) the CUDA extension and run every method once on a small model
    for spec in args.methods.split(","):
        time_method(spec, TINY, 2, args.device, dtype, args.bits, calibration[:2, :64] % TINY["vocab_size"])

    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    label = "tiny Llama" if args.tiny else "Llama-3-8B shapes"
    print(f"kbit.quantize_model on {device_name}, {label}, {args.layers} of {FULL_LAYERS} decoder blocks built, "
          f"K={args.bits}, random bf16 weights; gptq calibration {args.calib_seqs} x {args.calib_len} random tokens")
    print(f"'32 blocks (s)' = measured time x {factor:g} (blocks are identical; see the docstring)\n")
    print("| method | layers | measured (s) | per block (s) | 32 blocks (s) | target (s) | met |")
    print("|---|---:|---:|---:|---:|---:|---|")
    rows = []
    for spec in args.methods.split(","):
        seconds, count = time_method(spec, shape, args.layers, args.device, dtype, args.bits, calibration)
        target = TARGET_SECONDS.get(spec.partition("+")[0])
        full = seconds * factor
        row = {"method": spec, "layers": count, "blocks": args.layers, "seconds": seconds,
               "per_block_seconds": seconds / args.layers, "full_model_seconds": full, "target_seconds": target}
        rows.append(row)
        met = "" if target is None or args.tiny else ("yes" if full <= target else "no")
        print(f"| {spec} | {count} | {seconds:.1f} | {seconds / args.layers:.2f} | {full:.0f} | {target} | {met} |",
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": device_name, "shape": label, "bits": args.bits,
                                              "calibration": [args.calib_seqs, args.calib_len], "rows": rows},
                                             indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
