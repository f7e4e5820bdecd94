"""The layers of the code stay layers: what includes or imports what.

C (csrc/): only the binding includes Python.h; the ring protocol and DLPack export reach a
GPU only through the device interface (ts_device.h), never the CUDA backend (ts_gpu.c) or
its driver table (ts_cuda.h), and the backend never calls back into the ring; no two
modules include each other, directly or through others. Python: the library modules do
not import the command line."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
PACKAGE = ROOT / "tensorsocket"

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)
BINDING = re.compile(r"^ts_(module\.c|py(_\w+)?\.[ch])$")  # ts_module.c, ts_py.h, ts_py_*.c
CLI_MODULES = {"status", "top", "clean", "__main__"}


def _sources() -> dict[str, str]:
    """Every file of the core (csrc/ts_*.c and .h, not the C tests): name -> text."""
    files = sorted(CSRC.glob("ts_*.[ch]"))
    assert files, "no sources under csrc/"
    return {p.name: p.read_text() for p in files}


def _includes(text: str) -> tuple[set[str], set[str]]:
    """The "local" and <system> headers a file includes."""
    local, system = set(), set()
    for kind, name in INCLUDE.findall(text):
        (local if kind == '"' else system).add(name)
    return local, system


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every node reachable from start (not start itself unless on a cycle)."""
    seen: set[str] = set()
    todo = list(graph.get(start, ()))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def _header_graph() -> dict[str, set[str]]:
    return {name: _includes(text)[0] for name, text in _sources().items()}


def test_only_the_binding_includes_python_h():
    """Python.h is included by the binding's files alone (and every binding .c file
    reaches it), and no file of the core includes a binding header."""
    sources = _sources()
    graph = _header_graph()
    binding = {name for name in sources if BINDING.match(name)}
    assert {"ts_module.c", "ts_py.h"} <= binding
    for name, text in sources.items():
        local, system = _includes(text)
        if name not in binding:
            assert "Python.h" not in system | local, f"{name} includes Python.h"
            assert not local & binding, f"{name} includes the binding: {local & binding}"
        elif name.endswith(".c"):
            reached = _reach(graph, name) | {name}
            assert any("Python.h" in _includes(sources[f])[1]
                       for f in reached if f in sources), f"{name} does not reach Python.h"


@pytest.mark.parametrize("name", ["ts_ring.c", "ts_ring.h", "ts_export.c", "ts_export.h"])
def test_ring_and_export_reach_the_gpu_only_through_ts_device(name):
    """Neither the ring protocol nor DLPack export includes the CUDA backend or its driver
    table, directly or through another header; they include ts_device.h."""
    graph = _header_graph()
    reached = _reach(graph, name)
    assert not reached & {"ts_gpu.h", "ts_cuda.h"}, f"{name} reaches {reached}"
    assert "ts_device.h" in reached | graph[name]


@pytest.mark.parametrize("name", ["ts_gpu.c", "ts_cuda.c", "ts_cuda.h", "ts_device.h",
                                  "ts_device.c"])
def test_the_device_layer_does_not_know_the_ring(name):
    """The device interface and the CUDA backend see the ring only through what
    ts_device.h hands them: they include neither ts_ring.h nor ts_export.h."""
    reached = _reach(_header_graph(), name)
    assert not reached & {"ts_ring.h", "ts_export.h"}, f"{name} reaches {reached}"


def test_only_the_cuda_backend_includes_the_driver_table():
    """ts_cuda.h (the CUDA driver API) is included by the CUDA backend's own files only."""
    users = {name for name, local in _header_graph().items() if "ts_cuda.h" in local}
    assert users <= {"ts_cuda.c", "ts_gpu.c"}, users


def test_no_include_cycle_between_modules():
    """Modules (ts_x.c with ts_x.h) form no cycle: if one includes another's header,
    directly or through others, the other never includes the first's."""
    modules: dict[str, set[str]] = {}
    for name, local in _header_graph().items():
        stem = name.rsplit(".", 1)[0]
        modules.setdefault(stem, set()).update(h.rsplit(".", 1)[0] for h in local)
    for stem in modules:
        modules[stem].discard(stem)
    cycles = sorted(stem for stem in modules if stem in _reach(modules, stem))
    assert cycles == [], f"modules on an include cycle: {cycles}"


def _imports(module: str) -> set[str]:
    """The tensorsocket modules one module imports (at any level: inside functions too)."""
    path = PACKAGE / f"{module}.py"
    if not path.is_file():
        return set()  # the C extension, or a package outside ours
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module is None:
                out.update(alias.name for alias in node.names)
            elif node.level == 1:
                out.add(node.module.split(".")[0])
            elif node.level == 0 and node.module == "tensorsocket":
                out.update(alias.name for alias in node.names)
            elif node.level == 0 and node.module and node.module.startswith("tensorsocket."):
                out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out.update(alias.name.split(".")[1] for alias in node.names
                       if alias.name.startswith("tensorsocket."))
    return out


def _imports_reached(module: str) -> set[str]:
    seen: set[str] = set()
    todo = [module]
    while todo:
        for dep in _imports(todo.pop()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


LIBRARY = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in CLI_MODULES)


@pytest.mark.parametrize("module", LIBRARY)
def test_library_modules_do_not_import_the_command_line(module):
    """No library module (producer, consumer, control plane, share() and what they use)
    imports a module of the command line, directly or through another module."""
    assert {"producer", "consumer", "control", "share", "segments"} <= set(LIBRARY)
    reached = _imports_reached(module)
    assert not reached & CLI_MODULES, f"tensorsocket.{module} reaches {reached & CLI_MODULES}"


def test_producer_and_consumer_import_something():
    """The import walk sees imports at all (else the test above could not fail)."""
    assert {"config", "control"} <= _imports_reached("producer")
    assert {"config", "delivery"} <= _imports_reached("consumer")


def test_the_cli_uses_the_library_segment_scan():
    """status and clean list segments through tensorsocket.segments, as the producer does."""
    for cli in ("status", "clean"):
        assert "segments" in _imports(cli)
    assert "segments" in _imports("producer_files")


def test_benchmarks_import_no_cycle():
    """The benchmark scripts share code through a module that imports neither of them."""
    bench = ROOT / "benchmarks"
    graph = {}
    for path in bench.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps.add(node.module.split(".")[0])
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[0] for a in node.names)
        graph[path.stem] = deps & {p.stem for p in bench.glob("*.py")}
    assert "handoff_common" in graph.get("handoff", set())
    for a, deps in graph.items():
        for b in deps:
            assert a not in _closure(graph, b), f"benchmarks/{a}.py and {b}.py import each other"


def _closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen
