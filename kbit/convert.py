"""``python -m kbit quantize <model-dir> --bits 4 --out <dir>``: a transformers model directory to a kbit folder.

A thin wrapper over transformers: ``from_pretrained(<model-dir>, quantization_config=kbit.KbitConfig(...))``
quantizes each layer as it is read (host memory peaks near the quantized model plus one layer in full precision,
not at the full-precision model's size), then ``save_pretrained`` writes ``<dir>`` atomically, together with the
source's tokenizer and other small files, its README.md starting with how to load the folder (``kbit.model_card``),
once the written folder has loaded back (``kbit.hf.check_loads``); a failed write (a full disk, say) is a
one-line error and leaves ``<dir>`` as it was.
``AutoModelForCausalLM.from_pretrained(<dir>)`` (after ``import kbit``) and ``AutoTokenizer.from_pretrained(<dir>)``
load the result.

Progress: transformers' bars on a terminal; in a log (stderr not a terminal), one line per tenth of the layers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from ._progress import is_terminal

__all__ = ["cli_quantize", "quantize_directory", "ConversionError"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".ggml", ".onnx")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_WRITTEN = ("config.json", "generation_config.json")  # save_pretrained writes these (and the weights)
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
    qc = raw.get("quantization_config")
    if qc:
        method = qc.get("quant_method", "unknown") if isinstance(qc, dict) else "unknown"
        if method == "kbit":
            raise ConversionError(f"{model_dir} is already a kbit checkpoint")
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
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            return auto._model_mapping[type(config)]
        except KeyError:
            continue
    raise ConversionError(
        f"unsupported architecture {', '.join(archs) or raw['model_type']!r}: transformers "
        f"{transformers.__version__} has no model class for it"
    )


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


@contextlib.contextmanager
def _progress_output(enabled: bool):
    """transformers' bars on a terminal; in a log, kbit's lines (its logger) instead of redrawn bars."""
    from transformers.utils import logging as hf_logging

    lines = enabled and not is_terminal(sys.stderr)
    bars_were_on = hf_logging.is_progress_bar_enabled()
    kbit_logger = logging.getLogger("kbit")
    handler, level = logging.StreamHandler(sys.stderr), kbit_logger.level
    handler.setFormatter(logging.Formatter("%(message)s"))
    if not enabled or lines:
        hf_logging.disable_progress_bar()
    if lines:
        kbit_logger.addHandler(handler)
        kbit_logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        if lines:
            kbit_logger.removeHandler(handler)
            kbit_logger.setLevel(level)
        if bars_were_on:
            hf_logging.enable_progress_bar()


# ---------------------------------------------------------------------- conversion
def quantize_directory(
    model_dir,
    out_dir,
    bits=4,
    skip: Optional[Sequence[str]] = None,
    min_features: Optional[int] = None,
    dtype: str = "auto",
    device: str = "cpu",
    trust_remote_code: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = print,
    method: str = "rtn",
    calibration: Optional[str] = None,
    rotate: bool = False,
    tune_steps: int = 0,
    fp_targets: bool = False,
    block_tune_steps: int = 0,
) -> dict:
    """Quantize the transformers model in ``model_dir`` while loading it and save it to ``out_dir``.

    ``method``, ``rotate``, ``tune_steps``, ``fp_targets``, ``block_tune_steps``: as ``kbit.KbitConfig``;
    ``calibration``: a text file for ``method="gptq"`` and tuning, tokenized with the model's tokenizer
    (``calibration_ids``; tuning without it uses kbit's built-in text). Raises ``ConversionError`` (with the
    reason) for directories it cannot convert. Returns a summary dict (layer count, share of the weights
    quantized, sizes, output path).
    """
    from ._atomic import atomic_directory
    from .bit_budget import check_bits_setting
    from .calibration import check_gptq_refinements, uses_calibration
    from .finetune import check_tune_steps
    from .model_card import README, write_model_card
    from .nn import KbitLinear, quantized_fraction

    try:
        bits = check_bits_setting(bits)
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
        tune_steps = check_tune_steps(tune_steps)
        fp_targets, block_tune_steps = check_gptq_refinements(method, fp_targets, block_tune_steps)
    except (TypeError, ValueError) as e:
        raise ConversionError(str(e)) from None
    if calibration is not None and not uses_calibration(method, bits, tune_steps):
        raise ConversionError(f"--calibration is used by --method gptq, a bits budget and --tune-steps only, got "
                              f"--method {method}, --bits {bits} and --tune-steps {tune_steps}")

    try:
        import transformers
    except ImportError:
        raise ConversionError("converting a transformers model needs transformers: pip install transformers") from None
    from safetensors import SafetensorError  # transformers' weights writer

    from .hf import check_loads, dtype_kwarg
    from .hf.quantizer import KbitConfig

    try:
        config = transformers.AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except (ValueError, KeyError) as e:
        raise ConversionError(
            f"unsupported architecture: transformers {transformers.__version__} cannot read model_type "
            f"{raw['model_type']!r} ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        ) from None
    cls = _resolve_class(transformers, config, raw, trust_remote_code)
    if calibration is not None:
        calibration = calibration_ids(model_dir, Path(calibration), trust_remote_code)
    qconfig = KbitConfig(bits=bits, skip=skip, method=method, calibration=calibration, rotate=rotate,
                         tune_steps=tune_steps, fp_targets=fp_targets, block_tune_steps=block_tune_steps,
                         **({} if min_features is None else {"min_features": min_features}))
    saved = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if dtype == "auto" and saved != str(torch_dtype).replace("torch.", ""):
        log(f"kbit: {saved} checkpoint: its layers kept in full precision become float16, the dtype the kbit "
            "kernels compute in (--dtype float32 or bfloat16 to choose)")

    how = [method] + [said for said, on in (("rotated", rotate), ("fp targets", fp_targets),
                                            (f"{block_tune_steps} block tuning steps", block_tune_steps),
                                            (f"{tune_steps} tuning steps", tune_steps)) if on]
    log(f"kbit: loading {getattr(cls, '__name__', cls)} from {model_dir} ({str(torch_dtype).replace('torch.', '')}) "
        f"and quantizing its layers to {bits} bits ({', '.join(how)})")
    t0 = time.perf_counter()
    kwargs = {dtype_kwarg(): torch_dtype, "quantization_config": qconfig, "device_map": device}
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    with _progress_output(progress):
        try:
            model = cls.from_pretrained(str(model_dir), **kwargs)
        except Exception as e:  # corrupt or mismatched weights, missing shards, ...
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConversionError(f"transformers could not load {model_dir}: {msg}") from e
        layers = [m for m in model.modules() if isinstance(m, KbitLinear)]
        if not layers:
            raise ConversionError(
                "no layer was eligible for quantization (all skipped or smaller than min_features); nothing to write"
            )
        try:
            with atomic_directory(out_dir) as tmp:
                model.save_pretrained(tmp)
                check_loads(model, tmp)
                copied = _copy_side_files(model_dir, tmp)
                write_model_card(tmp, previous=out_dir / README)
        except (OSError, ValueError, SafetensorError) as e:  # a full disk, a write-protected --out, ...
            lines = str(e).strip().splitlines()
            raise ConversionError(f"could not write {out_dir} ({lines[0] if lines else type(e).__name__}); "
                                  f"{out_dir} was left as it was") from e

    fp_bytes = sum(m.in_features * m.out_features for m in layers) * torch.finfo(torch_dtype).bits // 8
    q_bytes = sum(m.qweight.nbytes for m in layers)
    total = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    fraction = quantized_fraction(model)
    log(
        f"kbit: quantized {len(layers)} layers, {100 * fraction:.1f}% of the model's weights "
        f"({_gb(fp_bytes)} -> {_gb(q_bytes)}) in {time.perf_counter() - t0:.1f} s; wrote {out_dir} ({_gb(total)}"
        + (f", copied {len(copied)} tokenizer/config files" if copied else "") + ")"
    )
    return {"out_dir": str(out_dir), "layers": len(layers), "bits": bits, "quantized_fraction": fraction,
            "linear_bytes_before": fp_bytes, "linear_bytes_after": q_bytes, "total_bytes": total, "copied": copied}


def calibration_ids(model_dir: Path, text_file: Path, trust_remote_code: bool = False) -> torch.Tensor:
    """Token ids [n_seq, seq_len] for calibration: ``text_file`` tokenized with the model's tokenizer, with kbit's
    built-in text beside it (``kbit.calibration_text.calibration_tokens``)."""
    import transformers

    from .calibration_text import calibration_tokens

    try:
        text = text_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConversionError(f"--calibration {text_file}: cannot read it as UTF-8 text ({e})") from None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConversionError(f"--calibration needs the model's tokenizer in {model_dir}: {e}") from None
    if not tokenizer(text)["input_ids"]:
        raise ConversionError(f"--calibration {text_file} holds no text")
    return calibration_tokens(tokenizer, text)


# ---------------------------------------------------------------------- CLI
def _bits(text: str):
    """--bits: "3" is K = 3 on every layer, "3.25" (a decimal point) an average-bits budget."""
    from .bit_budget import check_bits_setting

    try:
        return check_bits_setting(float(text) if "." in text else int(text))
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _name_list(text: str) -> list:
    return [name for name in text.split(",") if name]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kbit quantize",
        description="Quantize the linear layers of a local transformers model directory to 2..5 bits per weight while "
                    "loading it, and save it as a kbit folder (load it with from_pretrained after import kbit).",
    )
    p.add_argument("model_dir", help="directory with config.json and safetensors / pytorch_model.bin weights")
    p.add_argument("--bits", "-b", type=_bits, default=4, metavar="K|BUDGET",
                   help="bits per weight: an int K = 2..5 for every layer (default 4), or average bits per weight "
                        "with a decimal point (2.25 .. 5.25, block scales counted), K chosen per layer from kbit's "
                        "built-in calibration text")
    p.add_argument("--out", "-o", required=True, help="output directory")
    # One value per flag (comma-separated, repeatable): a list taking several values would also take model_dir.
    p.add_argument("--skip", type=_name_list, action="extend", default=None, metavar="NAME[,NAME...]",
                   help="module names, name suffixes or fnmatch patterns to keep in high precision, comma-separated; "
                        "repeatable (default: lm_head, the output embeddings and tied weights)")
    p.add_argument("--min-features", type=int, default=None,
                   help="leave layers with min(in, out) below this in high precision (default: kbit's)")
    p.add_argument("--method", default="rtn", choices=("rtn", "mse", "gptq"),
                   help="rtn (default, each layer quantized as it is read), mse (data-free, fitted codebooks) or gptq "
                        "(calibrated on --calibration or kbit's built-in text; the most accurate with --rotate, docs/QUALITY.md)")
    p.add_argument("--calibration", metavar="FILE", default=None,
                   help="gptq's and --tune-steps' calibration text (UTF-8), tokenized with the model's tokenizer "
                        "(up to 8192 tokens), with kbit's built-in text beside it (3072 tokens)")
    p.add_argument("--rotate", action="store_true",
                   help="quantize each layer in a rotated basis of its inputs (lower error, a small extra cost)")
    p.add_argument("--tune-steps", type=int, default=0, metavar="N",
                   help="after quantizing, tune the codebooks and block scales end to end for N steps on the "
                        "calibration text (--calibration, else kbit's built-in text); default 0: no tuning")
    p.add_argument("--fp-targets", action="store_true",
                   help="with --method gptq: fit each layer to the unquantized model's outputs, so that it also "
                        "corrects the error of the quantized layers before it (about twice the calibration passes)")
    p.add_argument("--block-tune-steps", type=int, default=0, metavar="N",
                   help="with --method gptq: tune each transformer block's codebooks and block scales for N steps to "
                        "the unquantized block's outputs before the next block is calibrated; default 0: none")
    p.add_argument("--dtype", default="auto", choices=("auto", *_DTYPES),
                   help="dtype of the layers kept in high precision (default: the checkpoint's if fp16/bf16, else fp16)")
    p.add_argument("--device", default="cpu", help="device to quantize on, e.g. cuda (default cpu)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow models whose code lives in the directory")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    p.add_argument("--no-progress", action="store_true", help="no progress output")
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
            overwrite=args.overwrite, progress=not args.no_progress, method=args.method,
            calibration=args.calibration, rotate=args.rotate, tune_steps=args.tune_steps,
            fp_targets=args.fp_targets, block_tune_steps=args.block_tune_steps,
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
