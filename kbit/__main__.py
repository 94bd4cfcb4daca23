"""Command line: ``python -m kbit {demo,info,build,tune,quantize} ...``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def _cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.main(args)


def _cmd_info(args: argparse.Namespace) -> int:
    import platform

    import torch

    import kbit
    from kbit import _build

    info = {"kbit": kbit.__version__, "python": platform.python_version()}
    info.update(_build.build_info())
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["compute_capability"] = "%d.%d" % torch.cuda.get_device_capability()
        info["cuda_extension_built"] = bool(info.get("built"))
    else:
        info["device"] = "cpu (no CUDA device visible: kbit uses its pure-PyTorch reference path)"
        info["cuda_extension_built"] = False
    info["csrc"] = str(_build.CSRC)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        width = max(len(key) for key in info)
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0


def _cmd_build(args: argparse.Namespace) -> int:
    import torch

    from kbit import _build

    if not torch.cuda.is_available():
        print("kbit build: no CUDA device is visible, so there is nothing to build for "
              f"(torch {torch.__version__}, CUDA {torch.version.cuda}). The CPU reference path needs no build.",
              file=sys.stderr)
        return 2
    _build.cuda_ext()
    info = _build.build_info()
    print(f"kbit: CUDA extension ready in {info.get('build_dir')} (archs {info.get('archs')})")
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from . import tune

    return tune.main(args)


def _cmd_quantize(argv: List[str]) -> int:
    try:
        from kbit.convert import cli_quantize
    except ImportError as e:
        # Only a missing kbit.convert itself is "not available"; errors inside it must surface.
        if getattr(e, "name", None) not in ("kbit.convert", "kbit") and "kbit.convert" not in str(e):
            raise
        print("kbit quantize: model conversion is not available in this installation "
              f"(kbit.convert could not be imported: {e}).", file=sys.stderr)
        return 2
    return int(cli_quantize(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__, demo

    parser = argparse.ArgumentParser(prog="python -m kbit", description="kbit: 2- to 5-bit weight quantization.")
    parser.add_argument("--version", action="version", version=f"kbit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,info,build,tune,quantize}")

    p = sub.add_parser("demo", help="quantize a synthetic Llama-shaped stack at 2..5 bits and print a table",
                       description=(demo.__doc__ or "").split("\n\n")[0])
    demo.add_arguments(p)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("info", help="print build and device information")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("build", help="compile the CUDA extension ahead of time (needs CUDA)")
    p.set_defaults(func=_cmd_build)

    from . import tune

    p = sub.add_parser("tune", help="time the GEMM paths on this GPU and fit the planner to them (needs CUDA)",
                       description=(tune.__doc__ or "").split("\n\n")[0])
    tune.add_arguments(p)
    p.set_defaults(func=_cmd_tune)

    # Parsed by kbit.convert.cli_quantize; listed here for --help.
    sub.add_parser("quantize", help="quantize a model directory: quantize <model-dir> --bits 4 --out <dir>",
                   add_help=False)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "quantize":
        return _cmd_quantize(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
