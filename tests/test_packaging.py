"""What an installation brings: the license, the base dependencies, ``python -m kbit --version``, the CUDA
extension's sources."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import kbit

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "Copyright the kbit authors" in text
    project = _pyproject()
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]


def test_base_dependencies():
    """safetensors: kbit folders' weights; numpy: without it torch prints "Failed to initialize NumPy" on import."""
    project = _pyproject()
    names = {dep.split(">")[0].split("=")[0].split("<")[0].strip() for dep in project["dependencies"]}
    assert {"torch", "numpy", "safetensors"} <= names
    assert project["version"] == kbit.__version__


def test_python_m_kbit_version():
    proc = subprocess.run([sys.executable, "-m", "kbit", "--version"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == f"kbit {kbit.__version__}", proc
    assert "NumPy" not in proc.stderr, proc.stderr


def test_build_spec_names_every_source():
    """kbit/_build_spec.py, which the JIT build and scripts/compile_check.sh both read, lists every translation unit
    in kbit/csrc once: a .cu file left out would build in neither."""
    from kbit import _build_spec

    listed = [_build_spec.BINDING, *_build_spec.CUDA_SOURCES]
    present = sorted(f.name for f in (ROOT / "kbit" / "csrc").iterdir() if f.suffix in (".cu", ".cpp"))
    assert sorted(listed) == present and len(set(listed)) == len(listed), (listed, present)


def test_every_subpackage_is_packaged():
    """setuptools installs only the packages pyproject.toml names: a subpackage left out (kbit.hf) would be missing
    from an installed kbit."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    present = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kbit").rglob("__init__.py")}
    assert packages == present, (sorted(packages), sorted(present))
