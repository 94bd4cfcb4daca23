"""Loading one of the repository's scripts (benchmarks/, scripts/) as a module, for tests of its functions."""

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str) -> ModuleType:
    """The script at ``relative_path`` (from the repository root), executed as a fresh module named after its file."""
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(f"kbit_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
