"""Time ``kbit.quantize_model`` per method on an 8B-shaped Llama with random weights, on one GPU.

    python benchmarks/bench_quantize_methods.py                       # 8 of 32 blocks, rtn/mse/gptq, x 4 for 8B
    python benchmarks/bench_quantize_methods.py --layers 32           # the whole 8B model (slower)
    python benchmarks/bench_quantize_methods.py --methods gptq+rotate --layers 2
    python benchmarks/bench_quantize_methods.py --methods gptq+rotate --layers 2 --bits 3.25 --tune-steps 64
    python benchmarks/bench_quantize_methods.py --tiny --device cpu   # a tiny config: checks the script runs

The model has Llama-3-8B's shapes (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocabulary 128256)
with random bf16 weights, built on the GPU; only its first ``--layers`` decoder blocks are built. Every decoder
Linear is quantized (``lm_head`` stays, as ``quantize_model``'s default). Calibration for ``gptq``: random token
ids, ``--calib-seqs`` x ``--calib-len`` (default 128 x 512), run block by block as ``quantize_model`` does.
``--bits`` is an int K or a float budget in average bits per weight (``kbit.bit_budget``: a gradient pass for the
Fisher weights, the input Hessians, per-layer sensitivities at K = 2..5, then the method at the chosen K's);
``--tune-steps N`` adds end-to-end tuning (``kbit.finetune``, one calibration sequence per step). Both use the
same calibration. Each row also gives the measured seconds of its phases: the budget's sensitivities and
allocation, the method's pass over the layers, and tuning with its reference outputs.

Blocks of one model are identical in shape and each method's work is per block (the calibration's embedding and
``lm_head`` passes are a small share), so the time for the whole model is reported as the measured time times
``32 / --layers``: the table says so in its header. The budget's gradient pass and tuning run the whole model, so
their ``lm_head`` and loss (vocabulary 128256) are counted ``32 / --layers`` times too: an overestimate. Times include
the CUDA synchronization at the end of each method, not building the model or the first call's CUDA compilation
(a warm-up quantizes a small model first). Targets: data-free methods <= 60 s, calibrated <= 600 s, a budget or
tuning <= 900 s (tuning included) for the 8B model on one H200.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kbit  # noqa: E402
import kbit.nn  # noqa: E402
from kbit.bit_budget import average_bits, check_bits_setting  # noqa: E402
from kbit.calibration import uses_calibration  # noqa: E402

FULL_LAYERS = 32
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
TINY = dict(hidden_size=128, intermediate_size=448, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
            max_position_embeddings=256)
TARGET_SECONDS = {"rtn": 60, "mse": 60, "gptq": 600}
BUDGET_TARGET_SECONDS = 900  # a bit budget or tuning, tuning included
# quantize_model's phases, timed where kbit.nn calls them: {phase: names in kbit.nn}
PHASES = {"sensitivities": ("choose_layer_bits",), "quantize": ("quantize_layers",),
          "tuning": ("reference_outputs", "tune_end_to_end")}


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


@contextlib.contextmanager
def phase_timers(device: str):
    """Yields {phase: seconds} (``PHASES``) filled while quantize_model runs inside the block."""
    seconds = {phase: 0.0 for phase in PHASES}
    saved = {}

    def timed(phase, fn):
        def wrapper(*args, **kwargs):
            _sync(device)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync(device)
                seconds[phase] += time.perf_counter() - t
        return wrapper

    for phase, names in PHASES.items():
        for name in names:
            saved[name] = getattr(kbit.nn, name)
            setattr(kbit.nn, name, timed(phase, saved[name]))
    try:
        yield seconds
    finally:
        for name, fn in saved.items():
            setattr(kbit.nn, name, fn)


def stored_average_bits(model) -> float:
    """Average bits per weight of the model's KbitLinear layers as stored (codes and E4M4 block scales), counted
    from each layer's K: a layer on the GPU holds its GEMM layout, not the storage tensors."""
    layers = [m for m in model.modules() if isinstance(m, kbit.KbitLinear)]
    return average_bits({i: (m.out_features, m.in_features) for i, m in enumerate(layers)},
                        {i: m.bits for i, m in enumerate(layers)})


def time_method(spec: str, shape: dict, layers: int, device: str, dtype: torch.dtype, bits, calibration,
                tune_steps: int = 0) -> dict:
    """{"seconds", "layers", "average_bits", "phases"} of quantizing with ``spec`` (``<method>`` or
    ``<method>+rotate``) at ``bits`` (an int K or a float budget), then ``tune_steps`` of tuning."""
    method, _, option = spec.partition("+")
    model = build_model(shape, layers, device, dtype)
    calibrated = uses_calibration(method, bits, tune_steps)
    _sync(device)
    with phase_timers(device) as phases:
        t = time.perf_counter()
        kbit.quantize_model(model, bits=bits, method=method, calibration=calibration if calibrated else None,
                            rotate=option == "rotate", tune_steps=tune_steps, progress=False)
        _sync(device)
        seconds = time.perf_counter() - t
    result = {"seconds": seconds, "layers": sum(isinstance(m, kbit.KbitLinear) for m in model.modules()),
              "average_bits": stored_average_bits(model), "phases": dict(phases)}
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def bits_argument(text: str):
    """``--bits``: an int K (2..5) or a float budget in average bits per weight (2.25 .. 5.25)."""
    try:
        value = int(text) if text.strip().lstrip("+-").isdigit() else float(text)
        return check_bits_setting(value)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"--bits must be an int K or a float budget: {e}") from None


def nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8, help=f"decoder blocks to build (of {FULL_LAYERS})")
    p.add_argument("--methods", default="rtn,mse,gptq", help="comma-separated; <method>+rotate for the rotation")
    p.add_argument("--bits", type=bits_argument, default=4,
                   help="an int K, or a float budget in average bits per weight (per-layer K, kbit.bit_budget)")
    p.add_argument("--tune-steps", type=nonnegative_int, default=0, help="end-to-end tuning steps after quantizing")
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
        time_method(spec, TINY, 2, args.device, dtype, args.bits, calibration[:2, :64] % TINY["vocab_size"],
                    min(args.tune_steps, 1))

    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    label = "tiny Llama" if args.tiny else "Llama-3-8B shapes"
    budget = isinstance(args.bits, float)
    setting = (f"a budget of {args.bits} bits per weight" if budget else f"K={args.bits}") + (
        f", {args.tune_steps} tuning steps" if args.tune_steps else "")
    print(f"kbit.quantize_model on {device_name}, {label}, {args.layers} of {FULL_LAYERS} decoder blocks built, "
          f"{setting}, random bf16 weights; calibration {args.calib_seqs} x {args.calib_len} random tokens")
    print(f"'32 blocks (s)' = measured time x {factor:g} (blocks are identical; see the docstring)\n")
    print("| method | layers | avg bits | measured (s) | per block (s) | 32 blocks (s) | target (s) | met |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    rows = []
    for spec in args.methods.split(","):
        r = time_method(spec, shape, args.layers, args.device, dtype, args.bits, calibration, args.tune_steps)
        seconds = r["seconds"]
        target = BUDGET_TARGET_SECONDS if budget or args.tune_steps else TARGET_SECONDS.get(spec.partition("+")[0])
        full = seconds * factor
        row = {"method": spec, "bits": args.bits, "tune_steps": args.tune_steps, "layers": r["layers"],
               "blocks": args.layers, "average_bits": r["average_bits"], "seconds": seconds,
               "per_block_seconds": seconds / args.layers, "full_model_seconds": full, "target_seconds": target,
               "phase_seconds": r["phases"]}
        rows.append(row)
        met = "" if target is None or args.tiny else ("yes" if full <= target else "no")
        print(f"| {spec} | {r['layers']} | {r['average_bits']:.4f} | {seconds:.1f} | {seconds / args.layers:.2f} | "
              f"{full:.0f} | {target} | {met} |", flush=True)
    for row in rows:
        print(f"{row['method']} phases, measured: " + ", ".join(
            f"{phase} {s:.1f} s (x {factor:g}: {s * factor:.0f} s)" for phase, s in row["phase_seconds"].items()))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": device_name, "shape": label, "bits": args.bits,
                                              "calibration": [args.calib_seqs, args.calib_len], "rows": rows},
                                             indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
