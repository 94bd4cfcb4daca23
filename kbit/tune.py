"""``python -m kbit tune``: time every GEMM path on this GPU and fit the planner's coefficients to the times.

For each shape, bit width and token count, every fused path that runs here (the configuration and launch the planner
would run for it on that path) and dequantize + cuBLAS (what ``kbit.matmul`` does on that path for a weight holding
only its GEMM layout, as kbit's layers do: one pass from the layout to the 16-bit weight, then cuBLAS) are timed from
CUDA graphs on weight copies rotated past twice the L2 cache, so the weights stream from memory as in inference;
``--paths`` times only the paths it names (with ``--merge``, whose file keeps the others' times). A fused path whose
output disagrees with dequantize + cuBLAS's (the reference, computed whether or not that path is timed) is left out.
Each fused time is recorded with the launch that ran, which the fit takes as it is; beside the planned launch, the
configuration's other launches the planner weighs and, for mma.sync and the k split up to 16 tokens, a few launches
that sum each tile's parts in a thread-block cluster (``launches_to_time``; clusters on sm_90), whose times fit
``PathCost.cluster_us``.
``fit`` fits each path's ``kbit.planner.PathCost`` to its times (least squares in relative error, coefficients >=
0); the times and the coefficients go to the tuned cache (``kbit.tune_cache``), which ``kbit.matmul`` plans from
from then on.

``python -m kbit tune --fit MEASUREMENTS --configs REPORT --out FILE`` fits without a GPU, from a tune file
(``benchmarks/results/tune_<GPU>.json``) and the extension's configuration report (``tests/gemm_configs.json``): how the
shipped ``kbit/gpus/<GPU>.json`` are made. ``--merge FILE`` lays a measuring run (with ``--fit``, that tune file) over
such a tune file (a token count timed again replaces the old times) and fits to the whole: a region re-timed without
timing every shape and token count again, or chunks timed on two GPUs made one file. ``--in-step`` times each call
just after a kernel that writes its input, as a projection runs in a decoder step (``kbit.timing.in_step``); the file
says how its calls were timed, and one fit takes one timing. ``--decode FILE`` (with ``--fit``) fits such an in-step
file, the k split apart from mma.sync, as the decode step's own coefficients (``kbit.planner.Coefficients.decode``),
which plan the calls of up to 16 tokens; a measuring run's cache holds its own where it timed in step, else the
shipped file's.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from typing import NamedTuple, Optional

import torch

from .gemm_facts import FUSED_PATHS, Path

DEFAULT_SHAPES = ("8192->28672,28672->8192,14336->4096,4096->14336,11008->4096,4096->11008,4096->4096,2048->10240,"
                  "2048->1536")
DEFAULT_TOKENS = "1,8,16,32,64,128,192,256,384,512,768,1024,2048,4096"
# Weight copies per timing at most: 2048->1536 at 2 bits needs 144 to pass twice the H200's L2 (the cap was 64, so
# the small shapes' weights stayed in L2); a 256x256 weight would need thousands.
MAX_COPIES = 1024
AGREEMENT = 1e-2  # relative Frobenius error between a fused path's output and dequantize + cuBLAS's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    names = ",".join(path.value for path in Path)
    parser.add_argument("--bits", default="2,3,4,5", help="bit widths, comma-separated (default: 2,3,4,5)")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="in_features->out_features, comma-separated: the shapes timed for the fit "
                             "(default: the seeds' nine shapes)")
    parser.add_argument("--tokens", default=DEFAULT_TOKENS,
                        help=f"token counts M to time, comma-separated (default: {DEFAULT_TOKENS})")
    parser.add_argument("--paths", default=names,
                        help=f"the paths to time, comma-separated (default: all, {names}); with --merge, whose file "
                             "keeps the others' times for the fit")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="activation dtype (default: fp16)")
    parser.add_argument("--repeats", type=int, default=5, help="timed graph replays per measurement (default: 5)")
    parser.add_argument("--seconds", type=float, default=0.0,
                        help="start no further shape after this many seconds and fit what was measured; shapes are "
                             "timed in the order given, each at every bit width (default: 0, no limit)")
    parser.add_argument("--in-step", action="store_true",
                        help="time each call just after a kernel that writes its input, as a projection runs in a "
                             "decoder step (default: calls back to back, each starting under the last one's tail)")
    parser.add_argument("--merge", metavar="MEASUREMENTS",
                        help="lay this run's times (with --fit: that file's) over this tune file's (a token count "
                             "timed again replaces the old), rewrite it and fit the coefficients to the whole: how a "
                             "committed benchmarks/results/tune_<GPU>.json takes a re-timed region")
    parser.add_argument("--fit", metavar="MEASUREMENTS", help="fit the coefficients to this tune file, no GPU needed")
    parser.add_argument("--decode", metavar="MEASUREMENTS",
                        help="with --fit: an in-step tune file (--in-step) fitted as the decode step's own "
                             "coefficients, which plan the calls of up to 16 tokens")
    parser.add_argument("--configs", metavar="REPORT", help="with --fit: the configuration report (gemm_configs())")
    parser.add_argument("--out", metavar="FILE", help="with --fit: write the coefficients here (else print them)")


def _int_list(text: str, what: str) -> list:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise SystemExit(f"kbit tune: {what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"kbit tune: {what} must be positive integers, got {text!r}")
    return values


def _shapes(text: str) -> list:
    shapes = []
    for item in text.replace(" ", "").split(","):
        parts = item.replace("x", "->").split("->")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"kbit tune: a shape is in_features->out_features, e.g. 4096->14336; got {item!r}")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def _paths(text: str) -> tuple:
    """The paths named in ``text`` (comma-separated ``Path`` values), in ``Path``'s order."""
    names = {name for name in text.replace(" ", "").split(",") if name}
    unknown = sorted(names - {path.value for path in Path})
    if unknown or not names:
        raise SystemExit(f"kbit tune: --paths takes names among {', '.join(path.value for path in Path)}, got "
                         f"{', '.join(unknown) if unknown else 'none'}")
    return tuple(path for path in Path if path.value in names)


def _rotation(first, nbytes: int, l2_bytes: int) -> list:
    """``first`` and clones of it: enough that one pass over them moves more than twice the L2 cache."""
    copies = max(2, min(MAX_COPIES, math.ceil(2 * l2_bytes / max(nbytes, 1)) + 1))
    return [first] + [tuple(t.clone() for t in first) for _ in range(copies - 1)]


def _time_us(call, operands, repeats: int, written=None) -> float:
    """Median microseconds per call of ``call`` over ``operands``, one CUDA graph calling it on each in turn; with
    ``written`` (the calls' input), each call just after a kernel writing it, as in a decoder step
    (``kbit.timing.in_step``: the pairs' time less the writes')."""
    from .timing import in_step, in_step_time

    calls = [lambda o=o: call(o) for o in operands]
    if written is None:
        return _graph_us(calls, repeats)
    pairs, writes = in_step(calls, written)
    return in_step_time(_graph_us(pairs, repeats), _graph_us(writes, repeats))


def _graph_us(calls, repeats: int) -> float:
    """Median microseconds per call of ``calls`` captured in one CUDA graph."""
    from .timing import capture_cuda_graph, replay_seconds

    graph = capture_cuda_graph(calls)
    return statistics.median(replay_seconds(graph, timings=repeats)) * 1e6 / len(calls)


def tune_shape(facts, bits: int, in_features: int, out_features: int, tokens: list, dtype, repeats: int, log,
               in_step: bool = False, paths: tuple = tuple(Path)) -> dict:
    """The cache entry of one shape: each of ``paths``' microseconds per call at each token count (None: not timed),
    the others absent; ``in_step``: each call timed just after a kernel writing its input (``_time_us``)."""
    from . import ops, planner
    from ._build import cuda_ext
    from .formats import padded_in_features
    from .weight import QuantizedWeight, quantize

    ext = cuda_ext()
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 0) or 50 * 2**20
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qw = quantize(torch.randn(out_features, in_features, device=device, dtype=dtype) * 0.02, bits)
    in_features_padded = padded_in_features(in_features)
    layout = qw.gemm_layout()
    layouts = _rotation(tuple(layout), sum(t.numel() * t.element_size() for t in layout), l2)
    # As a kbit layer holds its weight on CUDA: the GEMM layout alone, which dequantize + cuBLAS reads in one pass.
    weights = [QuantizedWeight.from_gemm_layout(b, a, qw.codebook, qw.scale, bits, qw.shape, dtype)
               for b, a in layouts]
    fused_paths = [path for path in FUSED_PATHS if path in paths]
    us = {path.value: [] for path in Path if path in paths}
    timed_configs = {path.value: [] for path in fused_paths}
    timed_launches = {path.value: [] for path in fused_paths}
    for M in tokens:
        x = torch.randn(M, in_features, device=device, dtype=dtype)
        written = x if in_step else None

        def dequantize_cublas(w, x=x):  # kbit.matmul's dequantize + cuBLAS path
            return torch.nn.functional.linear(x, w._dequantize(dtype))

        reference = dequantize_cublas(weights[0]).float()
        if Path.DEQUANTIZE_CUBLAS in paths:
            us[Path.DEQUANTIZE_CUBLAS.value].append(_time_us(dequantize_cublas, weights, repeats, written))
        for path in fused_paths:
            try:
                c = planner.plan(facts.device, facts.configs, facts.coefficients, out_features, in_features, M, bits,
                                 fused_only=True, force=frozenset({path}))
            except planner.NoFusedConfig:
                c = None
            config = c if c is not None and c.path is path else None
            measured_us, launches = None, []
            if config is not None:
                def fused(lay, launch, x=x, c=config):
                    return ext.gemm(x, lay[0], lay[1], qw.codebook, qw.scale, None, bits, out_features,
                                    in_features_padded, launch.grid, launch.tile_parts, launch.whole_tiles, c.mb,
                                    c.wgmma_tiles, c.k_split, c.ws_tokens, ops.weights_settled(*lay, qw.codebook))

                def error(launch):
                    return float((fused(layouts[0], launch).float() - reference).norm()
                                 / reference.norm().clamp_min(1e-30))

                planned = planner.Launch(config.grid, config.tile_parts, config.whole_tiles)
                if error(planned) <= AGREEMENT:
                    measured_us = _time_us(lambda lay: fused(lay, planned), layouts, repeats, written)
                    launches.append(list(planned) + [measured_us])
                    built = next(c for c in facts.configs if c.bits == bits and c.key == config.key)
                    shape = planner.Shape(out_features, in_features_padded, M, bits)
                    for launch in launches_to_time(built, shape, facts.device, facts.coefficients, planned):
                        if error(launch) <= AGREEMENT:
                            launches.append(list(launch) + [_time_us(lambda lay, lc=launch: fused(lay, lc), layouts,
                                                                     repeats, written)])
                        else:
                            log(f"  {path.value} at M = {M} on {launch}: output differs; left out")
                else:
                    log(f"  {path.value} at M = {M}: output differs from dequantize + cuBLAS by "
                        f"{error(planned):.2g}; left out")
            us[path.value].append(measured_us)
            timed_configs[path.value].append(list(config.key) if measured_us is not None else None)
            timed_launches[path.value].append(launches or None)
        timed = {name: times[-1] for name, times in us.items() if times[-1] is not None}
        fastest = min(timed, key=timed.get, default=None)
        log(f"  {bits} bits {in_features}->{out_features} M = {M}: "
            + (f"{fastest} {timed[fastest]:.1f} us" if fastest else "no path timed"))
    del layouts, weights, qw
    torch.cuda.empty_cache()
    return {"bits": bits, "out_features": out_features, "in_features": in_features, "tokens": list(tokens), "us": us,
            "configs": timed_configs, "launches": timed_launches}


def launches_to_time(config, shape, device, coefficients, planned) -> list:
    """The launches tune times beside ``planned``: the configuration's other launches the planner weighs
    (``planner.launches``: the k split's grid of a CTA per tile against its steps in one group), then a few that sum
    each tile's parts in a thread-block cluster (``clusters_to_time``). The fit sees each as it ran: on the H200 the
    k split at 16 tokens on 4096->1024 ran 5.56 us on a CTA per tile against the planned 6.53 in one group."""
    from . import planner

    others = [launch for launch in planner.launches(config, planner.steps_of(config, shape), device.sms)
              if launch != planned]
    return others + clusters_to_time(config, shape, device, coefficients, planned)


def clusters_to_time(config, shape, device, coefficients, planned) -> list:
    """The launches summing tiles' parts in thread-block clusters that tune times beside ``planned``, a few per cell:
    where the coefficients price clusters, the size the model ranks first and the sizes next to it; else 2, 4 and the
    largest that runs (``planner.cluster_launches``)."""
    from . import planner

    found = [launch for launch in planner.cluster_launches(config, planner.steps_of(config, shape), device)
             if launch != planned]
    cost = coefficients.paths.get(config.path)
    if not found:
        return []
    if cost is not None and cost.cluster_us is not None:
        predicted = [planner.predict(cost, planner.fused_features(config, shape, launch, coefficients.cut,
                                                                  sms=device.sms)) for launch in found]
        best = predicted.index(min(predicted))
        return found[max(0, best - 1):best + 2]
    return [launch for launch in found if launch.tile_parts in (2, 4) or launch == found[-1]]


def main(args: argparse.Namespace) -> int:
    from . import planner, tune_cache

    if args.fit:
        if args.in_step or _paths(args.paths) != tuple(Path):
            raise SystemExit("kbit tune: --in-step and --paths are a measuring run's; --fit measures nothing")
        return _fit_file(args)
    if args.decode:
        raise SystemExit("kbit tune: --decode goes with --fit (the decode step's coefficients beside a fit's)")
    if not torch.cuda.is_available():
        print("kbit tune: no CUDA device is visible; the planner's coefficients are measured on the GPU that runs "
              "them (--fit fits them from a tune file without one)", file=sys.stderr)
        return 2
    bits_list = _int_list(args.bits, "--bits")
    if any(b not in (2, 3, 4, 5) for b in bits_list):
        raise SystemExit(f"kbit tune: --bits must be among 2, 3, 4, 5, got {args.bits!r}")
    shapes = _shapes(args.shapes)
    tokens = sorted(set(_int_list(args.tokens, "--tokens")))
    paths = _paths(args.paths)
    if paths != tuple(Path) and not args.merge:  # else the coefficients fitted would price those paths alone
        raise SystemExit("kbit tune: --paths leaves paths untimed: give --merge MEASUREMENTS, a tune file whose times "
                         "of the others the fit takes")
    dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
    facts = planner.device_facts(torch.device("cuda"))
    timing = tune_cache.IN_STEP if args.in_step else tune_cache.BACK_TO_BACK
    base = _tune_file_to_merge(args.merge, facts.device, timing) if args.merge else None

    def log(line: str) -> None:
        print(line, flush=True)

    log(f"kbit tune: {facts.device.name}, {len(bits_list)} bit widths x {len(shapes)} shapes x {len(tokens)} token "
        f"counts")
    entries = []
    start = time.monotonic()
    for n, (k_in, n_out) in enumerate(shapes):
        if args.seconds and n and time.monotonic() - start > args.seconds:
            log(f"kbit tune: {args.seconds:g} s passed: {n} of {len(shapes)} shapes timed, the rest left out")
            break
        entries += [tune_shape(facts, bits, k_in, n_out, tokens, dtype, args.repeats, log, in_step=args.in_step,
                               paths=paths) for bits in bits_list]
        log(f"kbit tune: {k_in}->{n_out} done at {time.monotonic() - start:.0f} s")
    if args.merge:
        entries = _merge_into(args.merge, base, facts.device, entries, timing)
        log(f"kbit tune: merged into {args.merge}: {len(entries)} shapes and bit widths")
    measured = tune_cache.parse({"format": tune_cache.FORMAT, "shapes": entries})
    coefficients = fit(measured, facts.device, facts.configs, facts.coefficients.cut, "python -m kbit tune")
    # The decode step's own: this run's, where it timed its calls in step; else the shipped file's (calls timed back
    # to back say nothing of one that follows a norm or attention).
    coefficients = coefficients._replace(decode=fit(
        measured, facts.device, facts.configs, facts.coefficients.cut, "python -m kbit tune --in-step",
        own_k_split=True) if args.in_step else planner.shipped_coefficients(facts.device.name).decode)
    path = tune_cache.save(facts.device, entries, planner.coefficients_to_json(coefficients), timing)
    planner.forget()
    log(f"kbit tune: wrote {path}")
    _report(facts.device, facts.configs, coefficients, measured, log)
    return 0


def _tune_file_to_merge(name: str, device, timing: str) -> dict:
    """The tune file ``name``, checked before anything is timed: a file this run cannot be laid over fails now."""
    import json
    from pathlib import Path as FilePath

    from . import tune_cache

    try:
        data = json.loads(FilePath(name).read_text())
        tune_cache.check_tune_file(data, device, timing)
    except (OSError, ValueError) as e:
        raise SystemExit(f"kbit tune: --merge {name}: {e}") from None
    return data


def _merge_into(name: str, base: dict, device, entries: list, timing: str, date=None) -> list:
    """``entries`` laid over ``base`` (``tune_cache.merge``), written to ``name`` atomically: the whole."""
    from pathlib import Path as FilePath

    from . import tune_cache

    merged = tune_cache.merge(base, device, entries, timing, date)
    tune_cache.write_json(FilePath(name), merged)
    return merged["shapes"]


def _fit_file(args: argparse.Namespace) -> int:
    """--fit: the coefficients of a tune file's GPU, fitted to its measurements; with --merge BASE, that file's
    measurements laid over BASE's first (BASE rewritten) and the fit to the whole: chunks timed apart (on two GPUs of
    one kind, or in several calls) become one file."""
    import json
    from pathlib import Path as FilePath

    from . import planner, tune_cache
    from .gemm_facts import Device, parse_configs

    if not args.configs:
        raise SystemExit("kbit tune: --fit needs --configs (the extension's gemm_configs() report as JSON)")
    data = json.loads(FilePath(args.fit).read_text())
    measured = tune_cache.parse(data)
    # The measurements ran on this GPU: every configuration they name fits its shared memory.
    device = Device(data["device"], tuple(data["capability"]), int(data["sms"]), 1 << 30,
                    tuple(data.get("clusters", ())))
    if args.merge:
        timing = tune_cache.timing_of(data)
        base = _tune_file_to_merge(args.merge, device, timing)
        entries = _merge_into(args.merge, base, device, data["shapes"], timing, data.get("date"))
        measured = tune_cache.parse({"format": tune_cache.FORMAT, "shapes": entries})
    configs = parse_configs(FilePath(args.configs).read_text())
    coefficients = fit(measured, device, configs, planner.DEFAULT_CUT,
                       f"python -m kbit tune --fit {args.fit}" + (f" --merge {args.merge}" if args.merge else "")
                       + (f" --decode {args.decode}" if args.decode else ""))
    if args.decode:
        coefficients = coefficients._replace(decode=_decode_fit(args.decode, device, configs))
    text = json.dumps(planner.coefficients_to_json(coefficients), indent=1) + "\n"
    if args.out:
        FilePath(args.out).write_text(text)
    else:
        print(text, end="")
    _report(device, configs, coefficients, measured, lambda line: print(line, file=sys.stderr))
    return 0


def _decode_fit(name: str, device, configs):
    """The decode step's coefficients: fitted to an in-step tune file of ``device`` (every call it timed: the counts
    past ``planner.DECODE_TOKENS`` constrain the rates too), planning the calls of up to that many tokens."""
    import json
    from pathlib import Path as FilePath

    from . import planner, tune_cache

    data = json.loads(FilePath(name).read_text())
    try:
        tune_cache.check_tune_file(data, device, tune_cache.IN_STEP)  # the decode step's calls follow other kernels
    except ValueError as e:
        raise SystemExit(f"kbit tune: --decode {name}: {e} (kbit tune --in-step)") from None
    measured = tune_cache.parse(data)
    if not any(M <= planner.DECODE_TOKENS for shape in measured.values() for M in shape.tokens):
        raise SystemExit(f"kbit tune: --decode {name} timed no call of {planner.DECODE_TOKENS} tokens or fewer")
    return fit(measured, device, configs, planner.DEFAULT_CUT, name, own_k_split=True)


# ---------------------------------------------------------------------------------------------- the fit
def measured_config(configs, path: Path, bits: int, tokens: int, recorded=None):
    """The configuration a measurement of ``path`` at ``tokens`` ran: as recorded, else (files that do not record
    it) the one the planner ran when they were measured: the smallest pass that holds the tokens (the largest past
    them), wgmma's 128-row tiles where built, the warp-specialized kernel's 128-token tiles past 64 tokens."""
    same = [c for c in configs if c.bits == bits and c.path is path]
    if recorded is not None:
        return next((c for c in same if c.key == tuple(recorded)), None)
    if path is Path.WARP_SPECIALIZED:
        same = [c for c in same if c.tokens <= 128]
    if not same:
        return None
    holding = [c for c in same if c.tokens >= tokens]
    tokens_per_pass = min(c.tokens for c in holding) if holding else max(c.tokens for c in same)
    return min((c for c in same if c.tokens == tokens_per_pass), key=lambda c: (c.tile_rows != 128, c.tile_rows))


class Cell(NamedTuple):
    """One measurement as the fit sees it: what ran (the configuration, None for dequantize + cuBLAS, and whether
    that path ran an unrepack before its dequantize; the launch where it was recorded) and its time."""

    shape: object  # planner.Shape
    config: object  # GemmConfig or None
    unrepacked_first: bool
    us: float
    launch: object = None  # planner.Launch; None: the one the model fitted so far ranks first


def _features(device, cut, path: Path, cell: Cell, cost=None):
    from . import planner

    if path is Path.DEQUANTIZE_CUBLAS:
        return planner.cublas_features(cell.shape, device.sms, cell.unrepacked_first)
    launch = cell.launch or planner.best_launch(cell.config, cell.shape, cut, device.sms, cost)
    return planner.fused_features(cell.config, cell.shape, launch, cut, sms=device.sms)


def nonnegative_least_squares(rows: list, targets: list) -> list:
    """min |A c - b| over c >= 0 (Lawson and Hanson's active set; A is a few columns)."""
    import numpy as np

    a, b = np.asarray(rows, dtype=np.float64), np.asarray(targets, dtype=np.float64)
    n = a.shape[1]
    passive = np.zeros(n, dtype=bool)
    c = np.zeros(n)
    for _ in range(3 * n):
        gradient = a.T @ (b - a @ c)
        free = ~passive & (gradient > 1e-12 * max(1.0, float(np.abs(gradient).max())))
        if not free.any():
            break
        passive[np.argmax(np.where(free, gradient, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                c = z
                break
            negative = passive & (z <= 0)
            alpha = min(c[i] / (c[i] - z[i]) for i in np.flatnonzero(negative))
            c = c + alpha * (z - c)
            passive &= c > 1e-15
    return [float(v) for v in c]


CLASSIC = frozenset({Path.MMA_SYNC, Path.K_SPLIT, Path.WGMMA})  # gemm.cuh's kernel: also the MoE's
CONTENDER = 1.25  # a path's times are fitted where it is within this of the fastest path (of gemm.cuh's, for those
# paths): where plans are decided


def fit(measured: dict, device, configs, cut, source: str, rounds: int = 6, own_k_split: bool = False):
    """Each measured path's coefficients fitted to ``measured`` (``tune_cache.parse``'s), in relative error, on the
    cells where it contends (all of them where too few do); the k split shares mma.sync's unless ``own_k_split``
    (the decode step's fit: in step its warps' sums through shared memory and its one step per CTA price otherwise
    than mma.sync's rates say, 4096->4096 at one token 8.7 us priced that way against 6.9 timed). A path with no
    measurements gets none: the planner leaves it out unless ``KBIT_GEMM_PATH`` forces it; likewise ``cluster_us``
    stays None where no clustered launch was timed, and ``full_grid_us`` where no ``planner.slack_launch``."""
    from . import planner

    paths: dict = {path: [] for path in Path}  # path -> [(Cell, whether it contends)]
    for (bits, out_features, in_features), shape in measured.items():
        def fastest(i: int, among) -> Optional[float]:
            return min((t[i] for p, t in shape.us.items() if p in among and t[i] is not None), default=None)

        for path, times in shape.us.items():
            rivals = [frozenset(Path)] + ([CLASSIC] if path in CLASSIC else [])  # the MoE picks among gemm.cuh's
            recorded = shape.configs.get(path)
            launched = shape.launches.get(path)
            for i, (M, us) in enumerate(zip(shape.tokens, times)):
                config = None if path is Path.DEQUANTIZE_CUBLAS else measured_config(
                    configs, path, bits, M, recorded[i] if recorded else None)
                if us is None or (config is None and path is not Path.DEQUANTIZE_CUBLAS):
                    continue
                cell = Cell(planner.Shape(out_features, in_features, M, bits), config, shape.unrepacked_first, us)
                # each launch timed, where recorded (the planned one among them), else the one the model ranks first
                found = ([cell._replace(launch=planner.Launch(*launch), us=t) for launch, t in launched[i]]
                         if launched and launched[i] else [cell])
                for one in found:
                    paths[path].append((one, any(one.us <= CONTENDER * fastest(i, among) for among in rivals)))
    # The k split is mma.sync's kernel with the warps splitting k: its features differ, not its rates, unless
    # ``own_k_split`` fits it its own.
    if not own_k_split:
        paths[Path.MMA_SYNC] += paths.pop(Path.K_SPLIT)
    fitted = {}
    for path, cells in paths.items():
        contenders = [cell for cell, contends in cells if contends]
        if cells:  # where too few contend, all (a fit of 7 or 8 coefficients wants several cells each)
            wanted = 3 * (len(planner.FEATURES) - len(planner.OPTIONAL_FEATURES))
            chosen = contenders if len(contenders) >= wanted else [cell for cell, _ in cells]
            fitted[path] = _fit_cells(path, chosen, device, cut, rounds)
    tokens: dict = {}  # configuration -> (fewest, most) tokens measured
    for cells in paths.values():
        for cell, _ in cells:
            if cell.config is not None:
                key = (cell.config.bits,) + cell.config.key
                low, high = tokens.get(key, (cell.shape.tokens, cell.shape.tokens))
                tokens[key] = (min(low, cell.shape.tokens), max(high, cell.shape.tokens))
    if Path.MMA_SYNC in fitted and not own_k_split:
        fitted[Path.K_SPLIT] = fitted[Path.MMA_SYNC]
    return planner.Coefficients(device.name, fitted, tokens, cut, source)


def _fit_cells(path: Path, cells: list, device, cut, rounds: int):
    """One PathCost fitted to ``cells`` ([Cell]). The model's max (loads against lookups and MMAs) is fitted by
    turns: each measurement counts the side the coefficients fitted so far say is the longer (at first both), and is
    taken as the launch the planner runs (at first the one of fewest steps). The full grid's cost is fitted only
    where a launch leaving SMs free (``planner.slack_launch``) was timed: without one it is the fixed cost again."""
    from . import planner

    cluster, full_grid = planner.FEATURES.index("cluster_us"), planner.FEATURES.index("full_grid_us")
    slack_timed = any(cell.launch is not None and cell.config is not None and cell.launch == planner.slack_launch(
        cell.config, planner.steps_of(cell.config, cell.shape), device.sms) for cell in cells)
    cost = None
    for _ in range(rounds):
        rows = []
        for cell in cells:
            features = list(_features(device, cut, path, cell, cost))
            if cost is not None:  # only the longer side of the max counts
                loading, computing, _ = planner.terms(cost, features)
                for i in ((2, 3) if loading >= computing else (1,)):
                    features[i] = 0.0
            if not slack_timed:
                features[full_grid] = 0.0
            rows.append([f / cell.us for f in features])
        cost = planner.PathCost(*nonnegative_least_squares(rows, [1.0] * len(rows)))
    if not any(row[cluster] for row in rows):  # no clustered launch timed: no value, none planned
        cost = cost._replace(cluster_us=None)
    return cost if slack_timed else cost._replace(full_grid_us=None)


def _report(device, configs, coefficients, measured: dict, log) -> None:
    """Per shape and token count measured: the fastest path against the path the fitted planner picks."""
    from . import planner

    for (bits, out_features, in_features), shape in measured.items():
        for i, M in enumerate(shape.tokens):
            times = {path: t[i] for path, t in shape.us.items() if t[i] is not None}
            if not times:
                continue
            fastest = min(times, key=times.get)
            chosen = planner.plan(device, configs, coefficients, out_features, in_features, M, bits)
            slower = times.get(chosen.path, math.inf) / times[fastest]
            note = f" (planned {chosen.path.value}: {slower:.2f}x)" if slower > 1 else ""
            log(f"  {bits} bits {in_features}->{out_features} M = {M:>5}: {fastest.value} {times[fastest]:.1f} us"
                f"{note}")
