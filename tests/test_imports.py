"""kbit's import graph, built from the source: no cycle, and no module imports one in a higher layer than its own
(the layers: docs/DESIGN.md, "Import layers").

Every import statement counts, at module level or inside a function, and so does ``importlib.import_module`` of a
literal name: a deferred import hides a cycle from Python's import machinery, not from the design. Not counted: the
package ``__init__`` that Python runs before any of its modules, which is no import statement.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kbit"


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict:
    """{module: the kbit modules it imports}, from every import statement of every module under kbit/."""
    files = {_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                # `from package import module` imports the module; `from module import name`, the module
                targets.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                               for alias in node.names)
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args
                  and isinstance(node.args[0], ast.Constant)):  # importlib.import_module("name" or ".name", package)
                targets.add(importlib.util.resolve_name(node.args[0].value, package))
        graph[module] = {t for t in targets if t in files and t != module}
    return graph


def find_cycle(graph: dict):
    """One cycle of ``graph`` as a list of nodes (first == last), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def design_layers() -> dict:
    """{layer name as DESIGN.md writes it: its layer number}."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    block = re.search(r"<!-- import layers -->\n(.*?)\n<!-- end import layers -->", text, re.S)
    assert block, "docs/DESIGN.md: no import layers block"
    layers = {}
    for line in block.group(1).splitlines():
        number, names = line.split(".", 1)
        for name in re.findall(r"`([\w.]+)`", names):
            assert name not in layers, f"docs/DESIGN.md lists {name} in two layers"
            layers[name] = int(number)
    return layers


def layer_of(module: str, layers: dict):
    """A module's layer: its own entry (kbit itself is `__init__`), else its subpackage's."""
    rel = module.split(".", 1)[1] if "." in module else "__init__"
    return layers.get(rel, layers.get(rel.split(".")[0]))


def test_cycle_finder_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_graph_sees_deferred_and_relative_imports():
    graph = import_graph()
    assert "kbit.hf.quantizer" in graph["kbit.hf.hook"]  # inside a function, `from . import quantizer`
    assert "kbit.nn" in graph["kbit.hf.folder"]  # `from ..nn import KbitLinear`
    assert "kbit.tensor_parallel" in graph["kbit.hf.tensor_parallel"]  # `from .. import tensor_parallel as tp`
    assert "kbit.lora" in graph["kbit"]  # importlib.import_module(".lora", __name__), on first use of kbit.lora


def test_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "kbit's imports go round: " + " -> ".join(cycle)


def test_no_module_imports_a_higher_layer():
    layers, graph = design_layers(), import_graph()
    unlisted = sorted(m for m in graph if layer_of(m, layers) is None)
    assert not unlisted, f"docs/DESIGN.md's import layers do not place {unlisted}"
    upward = sorted(f"{m} (layer {layer_of(m, layers)}) imports {t} (layer {layer_of(t, layers)})"
                    for m, targets in graph.items() for t in targets if layer_of(t, layers) > layer_of(m, layers))
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)
