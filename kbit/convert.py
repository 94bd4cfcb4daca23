"""Convert a local Hugging Face ``transformers`` model directory to a kbit checkpoint.

    python -m kbit quantize <model-dir> --bits 4 --out <dir>

``<model-dir>`` is what ``save_pretrained`` writes (``config.json`` plus ``*.safetensors`` or
``pytorch_model*.bin`` weights). The model is loaded with ``from_pretrained`` (so peak CPU memory
is about the size of the checkpoint in ``--dtype``), every eligible ``nn.Linear`` is replaced by a
``KbitLinear`` (``kbit.quantize_model``, with a progress bar), and the result is written with
``kbit.save_quantized``; tokenizer and other small files are copied along, so
``kbit.load_quantized(<dir>)`` plus ``AutoTokenizer.from_pretrained(<dir>)`` is all a user needs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
from torch import nn

__all__ = ["cli_quantize", "quantize_directory", "ConversionError"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".ggml", ".onnx")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_WRITTEN = ("config.json", "generation_config.json", "kbit_config.json", "model.safetensors")
_MAX_COPY_BYTES = 64 << 20  # tokenizer files and the like; anything bigger is not copied
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class ConversionError(Exception):
    """A model directory kbit cannot convert (the message says why)."""


# ---------------------------------------------------------------------- inspection
def _find_weights(model_dir: Path) -> list:
    files = sorted(p.name for p in model_dir.iterdir() if p.is_file())
    torch_weights = [f for f in files if f.endswith(".safetensors") or
                     (f.endswith(".bin") and f.startswith("pytorch_model"))]
    if torch_weights:
        return torch_weights
    others = [f for f in files if f.endswith((".h5", ".msgpack", ".gguf", ".ggml", ".onnx"))]
    if others:
        raise ConversionError(
            f"{model_dir} holds no PyTorch weights (found {', '.join(others[:3])}); kbit converts "
            "safetensors or pytorch_model*.bin checkpoints"
        )
    raise ConversionError(
        f"{model_dir} holds no weights (expected model.safetensors, model-0000x-of-0000y.safetensors "
        "or pytorch_model.bin)"
    )


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        hint = ""
        if any(p.suffix == ".gguf" for p in model_dir.iterdir()):
            hint = " (GGUF files are not supported)"
        raise ConversionError(f"{model_dir} has no config.json: not a transformers model directory{hint}")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ConversionError(f"{path} has no 'model_type': not a transformers model config")
    if (model_dir / "kbit_config.json").is_file():
        raise ConversionError(f"{model_dir} is already a kbit checkpoint (it has kbit_config.json)")
    qc = raw.get("quantization_config")
    if qc:
        method = qc.get("quant_method", "unknown") if isinstance(qc, dict) else "unknown"
        raise ConversionError(
            f"{model_dir} is already quantized ({method}); kbit converts fp16/bf16/fp32 checkpoints only"
        )
    return raw


def _pick_dtype(name: str, raw: dict) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    saved = raw.get("dtype") or raw.get("torch_dtype")
    if saved in ("float16", "bfloat16"):
        return _DTYPES[saved]
    return torch.float16  # fp32 checkpoints: the GEMM computes in fp16/bf16


def _resolve_class(transformers, config, raw: dict, trust_remote_code: bool):
    from .hf import resolve_model_class

    archs = list(getattr(config, "architectures", None) or [])
    for name in archs:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type):
            return cls
    if raw.get("auto_map"):
        if not trust_remote_code:
            raise ConversionError(
                f"the model's code is not part of transformers (config.json has auto_map for "
                f"{', '.join(archs) or raw['model_type']}); pass --trust-remote-code if you trust it"
            )
        return transformers.AutoModelForCausalLM if "AutoModelForCausalLM" in raw["auto_map"] else transformers.AutoModel
    cls = resolve_model_class(config)
    if cls is None:
        raise ConversionError(
            f"unsupported architecture {', '.join(archs) or raw['model_type']!r}: transformers "
            f"{transformers.__version__} has no model class for it"
        )
    return cls


def _copy_side_files(src: Path, dst: Path) -> list:
    copied = []
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if not p.is_file() or any(part.startswith(".") for part in rel.parts):
            continue
        if p.name.endswith(_WEIGHT_SUFFIXES) or p.name in _WEIGHT_INDEXES:
            continue
        if len(rel.parts) == 1 and p.name in _WRITTEN:
            continue
        if p.stat().st_size > _MAX_COPY_BYTES:
            continue
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, target)
        copied.append(str(rel))
    return copied


def _check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConversionError(f"--device {device!r} is not a device (use cpu, cuda or cuda:<index>)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"a CPU-only build of torch {torch.__version__}" if torch.version.cuda is None else "no visible GPU"
            raise ConversionError(f"--device {device}: CUDA is not available here ({build}); "
                                  "quantize with --device cpu, or install a CUDA build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConversionError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif dev.type != "cpu":
        raise ConversionError(f"--device {device}: kbit quantizes on cpu or cuda")


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


# ---------------------------------------------------------------------- conversion
def quantize_directory(
    model_dir,
    out_dir,
    bits: int = 4,
    skip: Optional[Sequence[str]] = None,
    min_features: Optional[int] = None,
    dtype: str = "auto",
    device: str = "cpu",
    trust_remote_code: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Quantize the transformers model in ``model_dir`` and save it to ``out_dir``.

    Raises ``ConversionError`` (with the reason) for directories it cannot convert. Returns a
    summary dict (layer count, sizes, output path).
    """
    from ._validate import check_bits
    from .hf import default_skip, dtype_kwarg, save_quantized
    from .nn import KbitLinear, quantize_model

    try:
        check_bits(bits)
    except (TypeError, ValueError) as e:
        raise ConversionError(str(e)) from None
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not model_dir.exists():
        raise ConversionError(f"{model_dir} does not exist")
    if not model_dir.is_dir():
        raise ConversionError(f"{model_dir} is not a directory (pass the folder that holds config.json)")
    raw = _read_config(model_dir)
    _find_weights(model_dir)
    if out_dir.exists():
        if not out_dir.is_dir():
            raise ConversionError(f"--out {out_dir} exists and is not a directory")
        if out_dir.resolve() == model_dir.resolve():
            raise ConversionError("--out must differ from the model directory")
        if any(out_dir.iterdir()) and not overwrite:
            raise ConversionError(f"--out {out_dir} is not empty (pass --overwrite to write into it)")
    _check_device(device)
    if dtype not in _DTYPES and dtype != "auto":
        raise ConversionError(f"dtype must be auto, float16, bfloat16 or float32, got {dtype!r}")
    torch_dtype = _pick_dtype(dtype, raw)

    try:
        import transformers
    except ImportError:
        raise ConversionError("converting a transformers model needs transformers: pip install transformers") from None
    try:
        config = transformers.AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except (ValueError, KeyError) as e:
        raise ConversionError(
            f"unsupported architecture: transformers {transformers.__version__} cannot read model_type "
            f"{raw['model_type']!r} ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        ) from None
    cls = _resolve_class(transformers, config, raw, trust_remote_code)

    log(f"kbit: loading {getattr(cls, '__name__', cls)} from {model_dir} ({str(torch_dtype).replace('torch.', '')})")
    t0 = time.perf_counter()
    kwargs = {dtype_kwarg(): torch_dtype}
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    try:
        model = cls.from_pretrained(str(model_dir), **kwargs)
    except Exception as e:  # corrupt or mismatched weights, missing shards, ...
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConversionError(f"transformers could not load {model_dir}: {msg}") from e
    model.eval()
    if device != "cpu":
        model.to(device)

    linears = {id(m): m for m in model.modules() if isinstance(m, nn.Linear)}
    if not linears:
        kinds = sorted({type(m).__name__ for m in model.modules() if type(m).__name__ in ("Conv1D", "Conv1d")})
        extra = f" (it uses {', '.join(kinds)})" if kinds else ""
        raise ConversionError(
            f"unsupported architecture {type(model).__name__}: it has no nn.Linear layers to quantize{extra}"
        )
    skip = list(default_skip(model) if skip is None else skip)
    qkw = {} if min_features is None else {"min_features": min_features}
    before = {id(m): m.weight.numel() * m.weight.element_size() for m in linears.values()}
    log(f"kbit: quantizing nn.Linear layers to {bits} bits (skipping {', '.join(skip) or 'nothing'})")
    with torch.no_grad():
        quantize_model(model, k=bits, skip=skip, progress=progress, **qkw)
    qlayers = {id(m): m for m in model.modules() if isinstance(m, KbitLinear)}
    if not qlayers:
        raise ConversionError(
            "no nn.Linear layer was eligible for quantization (all skipped or smaller than min_features); "
            "nothing to write"
        )
    remaining = {id(m) for m in model.modules() if isinstance(m, nn.Linear)}
    fp_bytes = sum(b for i, b in before.items() if i not in remaining)
    q_bytes = sum(m.qweight.nbytes for m in qlayers.values())

    save_quantized(
        model, out_dir,
        extra_config={"source": str(model_dir), "skip": skip, "bits_per_weight": round(8 * q_bytes / max(
            1, sum(m.in_features * m.out_features for m in qlayers.values())), 4)},
    )
    copied = _copy_side_files(model_dir, out_dir)
    total = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    log(
        f"kbit: quantized {len(qlayers)} layers ({_gb(fp_bytes)} -> {_gb(q_bytes)}) in "
        f"{time.perf_counter() - t0:.1f} s; wrote {out_dir} ({_gb(total)}"
        + (f", copied {len(copied)} tokenizer/config files" if copied else "") + ")"
    )
    return {"out_dir": str(out_dir), "layers": len(qlayers), "bits": bits, "linear_bytes_before": fp_bytes,
            "linear_bytes_after": q_bytes, "total_bytes": total, "copied": copied}


# ---------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kbit quantize",
        description="Quantize the nn.Linear layers of a local transformers model directory to k bits and save "
                    "it as a kbit checkpoint (load it with kbit.load_quantized).",
    )
    p.add_argument("model_dir", help="directory with config.json and safetensors / pytorch_model.bin weights")
    p.add_argument("--bits", "-k", type=int, default=4, choices=(2, 3, 4, 5), help="bits per weight (default 4)")
    p.add_argument("--out", "-o", required=True, help="output directory")
    p.add_argument("--skip", nargs="*", default=None, metavar="NAME",
                   help="module names, name suffixes or fnmatch patterns to keep in high precision "
                        "(default: lm_head and the output embedding)")
    p.add_argument("--min-features", type=int, default=None,
                   help="leave Linear layers with min(in, out) below this in high precision (default: kbit's)")
    p.add_argument("--dtype", default="auto", choices=("auto", *_DTYPES),
                   help="dtype of the layers kept in high precision (default: the checkpoint's if fp16/bf16, else fp16)")
    p.add_argument("--device", default="cpu", help="device to quantize on, e.g. cuda (default cpu)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow models whose code lives in the directory")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def cli_quantize(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m kbit quantize``; returns the exit code (0 ok, 1 failed, 2 usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # --help (0) or a usage error (2): argparse already printed
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        quantize_directory(
            args.model_dir, args.out, bits=args.bits, skip=args.skip, min_features=args.min_features,
            dtype=args.dtype, device=args.device, trust_remote_code=args.trust_remote_code,
            overwrite=args.overwrite, progress=not args.no_progress,
            log=lambda msg: print(msg, file=sys.stderr, flush=True),
        )
    except ConversionError as e:
        print(f"kbit quantize: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kbit quantize: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(cli_quantize())
