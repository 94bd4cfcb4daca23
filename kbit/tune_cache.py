"""The tuned dispatch cache: the GEMM paths' times that ``python -m kbit tune`` measured on one GPU.

One JSON file per GPU name and kbit version, ``$KBIT_CACHE_DIR/tuned/<GPU>-kbit-<version>.json`` (default
``~/.cache/kbit``), as gemlite and Triton keep their autotuning results. ``kbit.dispatch`` reads it once per process
and plans the shapes it holds from it (the crossover table plans the others). A file that does not parse or does
not describe this GPU and kbit version is ignored with a warning: a bad cache never changes what runs.

Format 1::

    {"format": 1, "kbit": "0.1.0", "device": "NVIDIA H200", "capability": [9, 0], "sms": 132, "date": "...",
     "shapes": [{"bits": 4, "out_features": 28672, "in_features": 8192, "tokens": [1, 16, ...],
                 "us": {"mma_sync": [...], "wgmma": [...], "warp_specialized": [...], "dequantize_cublas": [...]}}]}

``tokens`` ascending; ``us[path][i]`` the microseconds per call of that path at ``tokens[i]``, null where it was not
timed (not runnable here, or its output disagreed with dequantize + cuBLAS).
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
from .gemm_facts import Device, Path
from .formats import padded_in_features

FORMAT = 1


class TunedShape(NamedTuple):
    """One tuned shape: per path, its time at each token count (None: not timed)."""

    tokens: tuple
    us: dict  # Path -> tuple of float or None


def cache_file(device_name: str) -> FilePath:
    tag = re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") or "unknown"
    return cache_root() / "tuned" / f"{tag}-kbit-{__version__}.json"


def save(device: Device, shapes: list) -> FilePath:
    """Write the measurements (``shapes``: the format's entries) for ``device``, atomically. Returns the file."""
    data = {"format": FORMAT, "kbit": __version__, "device": device.name, "capability": list(device.capability),
            "sms": device.sms, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "shapes": shapes}
    parse(data, device)  # never write what load would refuse
    path = cache_file(device.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())  # else a power loss after the rename can leave an empty file
        os.replace(tmp, path)
        fsync_path(path.parent)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def load(device: Device) -> Optional[dict]:
    """{(bits, out_features, in_features padded to 32): TunedShape} from this GPU's cache file, or None when there is
    none or it is unusable (then with a warning saying why)."""
    path = cache_file(device.name)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        warnings.warn(f"kbit: ignoring the tuned dispatch cache {path}: {e}", stacklevel=2)
        return None
    try:
        return parse(json.loads(text), device)
    except (ValueError, TypeError, KeyError) as e:
        warnings.warn(f"kbit: ignoring the tuned dispatch cache {path}: {e}; run `python -m kbit tune` again",
                      stacklevel=2)
        return None


def _int(value, what: str, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {value!r}")
    return value


def parse(data, device: Device) -> dict:
    """The cache's contents, checked (ValueError naming what is wrong)."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if data.get("format") != FORMAT:
        raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
    if data.get("kbit") != __version__:
        raise ValueError(f"written by kbit {data.get('kbit')!r}, this is {__version__}")
    if data.get("device") != device.name:
        raise ValueError(f"measured on {data.get('device')!r}, this GPU is {device.name!r}")
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
        tuned[(bits, out_features, padded_in_features(in_features))] = TunedShape(tokens, times)
    return tuned
