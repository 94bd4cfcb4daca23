"""The tuned cache: the GEMM paths' times that ``python -m kbit tune`` measured on one GPU and the planner's
coefficients it fitted to them.

One JSON file per GPU name and kbit version, ``$KBIT_CACHE_DIR/tuned/<GPU>-kbit-<version>.json`` (default
``~/.cache/kbit``), as gemlite and Triton keep their autotuning results. ``kbit.planner`` reads its coefficients once
per process. A file that does not parse or does not describe this GPU and kbit version is ignored with a warning: a
bad cache never changes what runs. ``benchmarks/results/tune_<GPU>.json`` keeps a copy of each GPU's measurements
(``merge`` lays a re-timed region over them: ``kbit tune --merge``).

Format 1::

    {"format": 1, "kbit": "0.1.0", "device": "NVIDIA H200", "capability": [9, 0], "sms": 132, "date": "...",
     "clusters": [132, 66, 39, 30, ...], "coefficients": {...},
     "shapes": [{"bits": 4, "out_features": 28672, "in_features": 8192, "tokens": [1, 16, ...],
                 "us": {"mma_sync": [...], "wgmma": [...], "warp_specialized": [...], "dequantize_cublas": [...]},
                 "configs": {"mma_sync": [[4, 0, 0, 1], ...], ...},
                 "launches": {"warp_specialized": [[[132, 0, false, 41.0], [96, 2, false, 38.5]], ...],
                              "mma_sync": [[[132, 0, false, 11.9], [64, 4, false, 9.3]], ...], ...},
                 "unrepacked_first": true}]}

``tokens`` ascending; ``us[path][i]`` the microseconds per call of that path at ``tokens[i]``, null where it was not
timed (not runnable here, or its output disagreed with dequantize + cuBLAS); a path absent from ``us`` was not
timed at all (``kbit tune --paths``); ``configs[path][i]`` the configuration timed, (mb, wgmma_tiles, ws_tokens,
k_split), optional (measurements written before it say none).
``launches[path][i]``: the launches of that configuration timed, [grid, tile_parts, whole_tiles, us] each (the
planned one, whose time is ``us[path][i]``, and others: tile parts on mma.sync or the k split are summed in
thread-block clusters), or null; optional. ``clusters``: the clusters of 1..8 CTAs the GPU ran at once
(``gemm_facts.Device.clusters``), optional. ``unrepacked_first``: dequantize + cuBLAS was timed with an unrepack
before its dequantize (the GEMM layout read, the storage format written, then dequantized: how a weight holding only
its GEMM layout ran that path before ``ops.dequantize_layout``); optional, false (one dequantize pass) where absent.
``timing``: how each call was timed, ``"back_to_back"`` (a CUDA graph of calls, each starting under the last one's
tail; the default where absent) or ``"in_step"`` (each just after a kernel writing its input, as in a decoder step:
``kbit tune --in-step``); optional.
``coefficients``: ``kbit.planner.coefficients_to_json``'s, required in the cache.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import tempfile
import warnings
from pathlib import Path as FilePath
from typing import NamedTuple, Optional

from ._atomic import fsync_path
from ._build import cache_root
from ._version import __version__
from .formats import padded_in_features
from .gemm_facts import Device, Path

FORMAT = 1
BACK_TO_BACK, IN_STEP = "back_to_back", "in_step"  # how a file's calls were timed (``timing``)
TIMINGS = (BACK_TO_BACK, IN_STEP)


class TunedShape(NamedTuple):
    """One tuned shape: per path, its time at each token count (None: not timed) and the configuration timed."""

    tokens: tuple
    us: dict  # Path -> tuple of float or None
    configs: dict  # Path -> tuple of (mb, wgmma_tiles, ws_tokens, k_split) or None; {} where not recorded
    launches: dict  # Path -> tuple of (tuple of ((grid, tile_parts, whole_tiles), us)) or None; {} if not recorded
    unrepacked_first: bool  # dequantize + cuBLAS timed with an unrepack before its dequantize


def file_tag(device_name: str) -> str:
    """The GPU's name as a file name."""
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") or "unknown"


def cache_file(device_name: str) -> FilePath:
    return cache_root() / "tuned" / f"{file_tag(device_name)}-kbit-{__version__}.json"


def save(device: Device, shapes: list, coefficients: dict, timing: str = BACK_TO_BACK) -> FilePath:
    """Write the measurements (``shapes``: the format's entries, timed as ``timing`` says) and the coefficients
    fitted to them for ``device``, atomically. Returns the file."""
    data = {"format": FORMAT, "kbit": __version__, "device": device.name, "capability": list(device.capability),
            "sms": device.sms, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "clusters": list(device.clusters), "timing": timing, "coefficients": coefficients, "shapes": shapes}
    _check_cache(data, device.name)  # never write what load would refuse
    path = cache_file(device.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, data)
    return path


def write_json(path: FilePath, data: dict) -> None:
    """``data`` as ``path``'s JSON, atomically: the old file or the new one, never part of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())  # else a power loss after the rename can leave an empty file
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        os.unlink(tmp)
        raise


def load(device_name: str) -> Optional[dict]:
    """The coefficients in this GPU's cache file (``kbit.planner.coefficients_from_json`` reads and checks them), or
    None when there is none or it is unusable (then with a warning saying why)."""
    path = cache_file(device_name)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        warnings.warn(f"kbit: ignoring the tuned cache {path}: {e}", stacklevel=2)
        return None
    try:
        data = json.loads(text)
        _check_cache(data, device_name)
    except (ValueError, TypeError, KeyError) as e:
        warnings.warn(f"kbit: ignoring the tuned cache {path}: {e}; run `python -m kbit tune` again", stacklevel=2)
        return None
    return data["coefficients"]


def _check_cache(data, device_name: str) -> None:
    """ValueError naming what makes ``data`` no cache of this GPU and kbit version."""
    parse(data)
    if data.get("kbit") != __version__:
        raise ValueError(f"written by kbit {data.get('kbit')!r}, this is {__version__}")
    if data.get("device") != device_name:
        raise ValueError(f"measured on {data.get('device')!r}, this GPU is {device_name!r}")
    if not isinstance(data.get("coefficients"), dict):
        raise ValueError("'coefficients' must be an object")  # their contents: kbit.planner checks them


def _int(value, what: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
    return value


def _is_launch(value) -> bool:
    """[grid, tile_parts, whole_tiles, us]: integers >= 1 and >= 0, a bool, a positive time."""
    return (isinstance(value, list) and len(value) == 4 and all(type(v) is int for v in value[:2])
            and value[0] >= 1 and value[1] >= 0 and isinstance(value[2], bool)
            and type(value[3]) in (int, float) and math.isfinite(value[3]) and value[3] > 0)


def parse(data) -> dict:
    """The measurements of a cache or results file, checked (ValueError naming what is wrong):
    {(bits, out_features, in_features padded to 32): TunedShape}."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if data.get("format") != FORMAT:
        raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
    if timing_of(data) not in TIMINGS:
        raise ValueError(f"timing must be one of {', '.join(TIMINGS)}, got {data.get('timing')!r}")
    clusters = data.get("clusters", [])
    if not isinstance(clusters, list) or len(clusters) > 8 or not all(type(c) is int and c >= 0 for c in clusters):
        raise ValueError(f"clusters must be a list of at most 8 integers >= 0, got {clusters!r}")
    shapes = data.get("shapes")
    if not isinstance(shapes, list):
        raise ValueError("'shapes' must be a list")
    tuned = {}
    for n, entry in enumerate(shapes):
        where = f"shapes[{n}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be an object")
        bits = _int(entry.get("bits"), f"{where}.bits", 2)
        if bits > 5:
            raise ValueError(f"{where}.bits must be 2..5, got {bits}")
        out_features = _int(entry.get("out_features"), f"{where}.out_features", 1)
        in_features = _int(entry.get("in_features"), f"{where}.in_features", 1)
        tokens = entry.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ValueError(f"{where}.tokens must be a non-empty list")
        tokens = tuple(_int(t, f"{where}.tokens", 1) for t in tokens)
        if any(a >= b for a, b in zip(tokens, tokens[1:])):
            raise ValueError(f"{where}.tokens must be ascending")
        us = entry.get("us")
        if not isinstance(us, dict) or not us:
            raise ValueError(f"{where}.us must be a non-empty object")
        times = {}
        for name, values in us.items():
            path = Path(name)  # ValueError for a name that is no path
            if not isinstance(values, list) or len(values) != len(tokens):
                raise ValueError(f"{where}.us.{name} must hold one time per token count")
            for v in values:
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                      or v <= 0):
                    raise ValueError(f"{where}.us.{name} holds {v!r}, not a positive time or null")
            times[path] = tuple(None if v is None else float(v) for v in values)
        configs = {}
        for name, values in (entry.get("configs") or {}).items():
            if not isinstance(values, list) or len(values) != len(tokens) or not all(
                    v is None or (isinstance(v, list) and len(v) == 4 and all(isinstance(i, int) for i in v))
                    for v in values):
                raise ValueError(f"{where}.configs.{name} must hold one [mb, wgmma_tiles, ws_tokens, k_split] or "
                                 "null per token count")
            configs[Path(name)] = tuple(None if v is None else tuple(v) for v in values)
        launches = {}
        for name, values in (entry.get("launches") or {}).items():
            if not isinstance(values, list) or len(values) != len(tokens) or not all(
                    v is None or (isinstance(v, list) and all(_is_launch(t) for t in v)) for v in values):
                raise ValueError(f"{where}.launches.{name} must hold one list of [grid, tile_parts, whole_tiles, us] "
                                 "or null per token count")
            launches[Path(name)] = tuple(None if v is None else tuple(((t[0], t[1], t[2]), float(t[3])) for t in v)
                                         for v in values)
        unrepacked_first = entry.get("unrepacked_first", False)
        if not isinstance(unrepacked_first, bool):
            raise ValueError(f"{where}.unrepacked_first must be true or false, got {unrepacked_first!r}")
        tuned[(bits, out_features, padded_in_features(in_features))] = TunedShape(tokens, times, configs, launches,
                                                                                  unrepacked_first)
    return tuned


def timing_of(data: dict) -> str:
    """How a tune file's calls were timed (``TIMINGS``)."""
    return data.get("timing", BACK_TO_BACK)


def check_tune_file(data: dict, device: Device, timing: str = BACK_TO_BACK) -> None:
    """ValueError (``parse``'s, or another GPU's file, or times taken otherwise than ``timing``) where ``data`` is no
    tune file of ``device`` whose calls were timed ``timing``: one that ``merge`` lays such times over, or that the
    decode step's fit takes."""
    parse(data)
    if data.get("device") != device.name:
        raise ValueError(f"measured on {data.get('device')!r}, not {device.name!r}")
    if timing_of(data) != timing:
        raise ValueError(f"its calls were timed {timing_of(data)}, not {timing}: one fit takes one timing")


def merge(base: dict, device: Device, shapes: list, timing: str = BACK_TO_BACK, date: Optional[str] = None) -> dict:
    """``base`` (a tune file's contents, of ``device``) with ``shapes`` (the format's entries, measured later on the
    same GPU) laid over it: per bit width and shape, a token count measured again takes the new time, configuration
    and launches of every path it timed; the others, and the paths it did not time, keep theirs; a new shape is
    added. ``unrepacked_first`` is the entry's, not a time's: where the new entry timed dequantize + cuBLAS, the merged
    entry takes its flag and drops the old dequantize + cuBLAS times if they were measured the other way; where it
    did not, the old flag and times stay. ``clusters`` become ``device``'s, ``date`` the new measurements' (default:
    now).
    ValueError where ``base`` is no tune file to lay them over (``check_tune_file``)."""
    check_tune_file(base, device, timing)
    merged = {key: value for key, value in base.items() if key != "coefficients"}
    entries = {(e["bits"], e["out_features"], e["in_features"]): e for e in base["shapes"]}
    for new in shapes:
        key = (new["bits"], new["out_features"], new["in_features"])
        entries[key] = _merged_entry(entries[key], new) if key in entries else new
    merged.update(shapes=list(entries.values()), clusters=list(device.clusters), timing=timing,
                  date=date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    parse(merged)
    return merged


def _merged_entry(old: dict, new: dict) -> dict:
    tokens = sorted(set(old["tokens"]) | set(new["tokens"]))
    was_unrepacked = old.get("unrepacked_first", False)
    retimed = Path.DEQUANTIZE_CUBLAS.value in (new.get("us") or {})
    unrepacked = new.get("unrepacked_first", False) if retimed else was_unrepacked
    entry = {"bits": old["bits"], "out_features": old["out_features"], "in_features": old["in_features"],
             "tokens": tokens, **({"unrepacked_first": True} if unrepacked else {})}
    for field in ("us", "configs", "launches"):
        columns = {}
        for path in Path:
            before = dict(zip(old["tokens"], (old.get(field) or {}).get(path.value) or ()))
            after = dict(zip(new["tokens"], (new.get(field) or {}).get(path.value) or ()))
            if path is Path.DEQUANTIZE_CUBLAS and unrepacked != was_unrepacked:
                before = {}  # measured the other way: one entry's times are all one way
            # a token count measured again takes the new value, None included (not timed this time)
            row = [after[t] if t in after else before.get(t) for t in tokens]
            if before or after:
                columns[path.value] = row
        if columns or field == "us":
            entry[field] = columns
    return entry
