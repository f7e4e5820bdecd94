"""The layers of the code stay layers, by folder: what includes or imports what.

C (csrc/), from the bottom up: base/ (errors, clock, futex, segment, proc, copy, fault,
the DLPack header), device/ (the device interface ts_device, the CUDA backend
ts_device_cuda.c over the dlopen'ed driver table ts_cuda_api), ring/ (the ring protocol
and DLPack export), binding/ (the Python module: the only files that include Python.h).
A file includes headers of its own folder or of a lower one; no include cycle.

Python (tensorsocket/), from the bottom up: the leaves (_core, ring (the one face over
_core: no other module but errors imports _core), errors, validation, config), data/, control/, loader/, augment/ (a consumer's per-sample transforms), the public face (producer, consumer, surface),
sharing/ (share()), cli/, then __init__ and __main__. A module imports modules of its own
layer or of a lower one (at any level: inside functions and under TYPE_CHECKING too); no
import cycle. Long functions say why at their top.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
PACKAGE = ROOT / "tensorsocket"

C_LAYERS = ["base", "device", "ring", "store", "binding"]
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)

# Python layers, bottom up: a top-level module by name, a subpackage by its folder.
PY_LAYERS = [
    {"_core", "ring", "errors", "validation", "config"},
    {"data"},
    {"control"},
    {"loader"},
    {"augment"},
    {"producer", "consumer", "surface"},
    {"sharing", "store"},
    {"cli"},
    {"__init__", "__main__"},
]
LONG_FUNCTION = 80  # lines; a longer function says why at its top ("Long: ...")


# -- C -----------------------------------------------------------------------------------


def _c_sources() -> dict[str, str]:
    """Every file of the C extension (csrc/<layer>/ts_*.[ch], not the C tests): its path
    relative to csrc/ (e.g. "ring/ts_ring.c") -> text."""
    files = sorted(p for layer in C_LAYERS for p in (CSRC / layer).glob("ts_*.[ch]"))
    assert files, "no sources under csrc/<layer>/"
    stray = sorted(p.name for p in CSRC.glob("ts_*.[ch]"))
    assert not stray, f"C files outside the layer folders: {stray}"
    return {str(p.relative_to(CSRC)): p.read_text() for p in files}


def _includes(text: str) -> tuple[set[str], set[str]]:
    """The "local" (as written: "ring/ts_ring.h") and <system> headers a file includes."""
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
    return {name: _includes(text)[0] for name, text in _c_sources().items()}


def _c_layer(path: str) -> int:
    return C_LAYERS.index(path.split("/")[0])


@pytest.mark.parametrize("name", sorted(_c_sources()))
def test_c_files_include_their_own_layer_or_lower(name):
    """A file of csrc/ring includes headers of ring/, device/ and base/, never of the
    binding; device/ never the ring; base/ only base/. Every local include names an
    existing file by its folder."""
    sources = _c_sources()
    for header in _includes(sources[name])[0]:
        assert header in sources, f"{name} includes {header!r}, not a csrc/<layer>/ file"
        assert _c_layer(header) <= _c_layer(name), \
            f"{name} ({C_LAYERS[_c_layer(name)]}) includes {header} of a higher layer"


def test_only_the_binding_includes_python_h():
    """Python.h is included by the binding's files alone, and every binding .c file
    reaches it."""
    sources = _c_sources()
    graph = _header_graph()
    binding = {name for name in sources if name.startswith("binding/")}
    assert {"binding/ts_module.c", "binding/ts_py.h"} <= binding
    for name, text in sources.items():
        local, system = _includes(text)
        if name not in binding:
            assert "Python.h" not in system | local, f"{name} includes Python.h"
        elif name.endswith(".c"):
            reached = _reach(graph, name) | {name}
            assert any("Python.h" in _includes(sources[f])[1] for f in reached),  \
                f"{name} does not reach Python.h"


@pytest.mark.parametrize("name", ["ring/ts_ring.c", "ring/ts_ring.h", "ring/ts_export.c",
                                  "ring/ts_export.h"])
def test_ring_and_export_reach_the_gpu_only_through_ts_device(name):
    """Neither the ring protocol nor DLPack export includes the CUDA driver table,
    directly or through another header; they include device/ts_device.h."""
    graph = _header_graph()
    reached = _reach(graph, name)
    assert "device/ts_cuda_api.h" not in reached, f"{name} reaches {reached}"
    assert "device/ts_device.h" in reached | graph[name]


def test_only_the_cuda_backend_includes_the_driver_table():
    """device/ts_cuda_api.h (the CUDA driver API, dlopen'ed) is included by the CUDA
    backend (ts_device_cuda.c and its release queue, ts_cuda_release.[ch]) and the table
    itself (ts_cuda_api.c) only."""
    users = {name for name, local in _header_graph().items()
             if "device/ts_cuda_api.h" in local}
    assert users == {"device/ts_cuda_api.c", "device/ts_device_cuda.c",
                     "device/ts_cuda_release.h"}, users


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


# -- Python ------------------------------------------------------------------------------


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name below tensorsocket ("data.rebatch",
    "consumer", "_core" for the extension) -> its file (None for the extension)."""
    out: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, node: ast.ImportFrom | ast.Import) -> set[str]:
    """The package modules an import statement in `module` names (dotted, below
    tensorsocket)."""
    known = _modules()
    known_or_core = set(known) | {"_core"}
    targets: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.startswith("tensorsocket."):
                targets.add(alias.name[len("tensorsocket."):])
        return targets & known_or_core
    if node.level == 0:
        if node.module is None or not (node.module == "tensorsocket"
                                       or node.module.startswith("tensorsocket.")):
            return set()
        base = node.module[len("tensorsocket"):].lstrip(".")
    else:
        here = module.split(".")
        is_package = (_modules()[module].name == "__init__.py")
        package = here if is_package else here[:-1]
        package = package[:len(package) - (node.level - 1)]
        base = ".".join(package + ([node.module] if node.module else []))
    for alias in node.names:
        sub = f"{base}.{alias.name}" if base else alias.name
        targets.add(sub if sub in known_or_core else base)
    return {t for t in targets if t in known_or_core}


def _imports(module: str) -> set[str]:
    """The package modules `module` imports, at any level (functions, TYPE_CHECKING)."""
    path = _modules()[module]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= _resolve(module, node)
    out.discard(module)
    return out


def _py_layer(module: str) -> int:
    top = module.split(".")[0] if module else "__init__"
    for i, layer in enumerate(PY_LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"tensorsocket.{module} is in no layer of test_layering.PY_LAYERS")


@pytest.mark.parametrize("module", sorted(_modules()))
def test_python_modules_import_their_own_layer_or_lower(module):
    """No module imports one of a higher layer: data/ never control/ or the consumer,
    the consumer never share() or the CLI, and so on (PY_LAYERS)."""
    mine = _py_layer(module)
    higher = {m for m in _imports(module) if _py_layer(m) > mine}
    assert not higher, f"tensorsocket.{module} imports higher layers: {sorted(higher)}"


def test_no_import_cycle():
    """No module reaches itself through the modules it imports."""
    graph = {m: _imports(m) for m in _modules()}
    cycles = sorted(m for m in graph if m in _reach(graph, m))
    assert cycles == [], f"modules on an import cycle: {cycles}"


# The modules that import the compiled core: its face (tensorsocket/ring.py) and the
# exceptions it raises (errors.py); everything else reaches it through the face, as
# pyzmq's sugar reaches its backend.
CORE_IMPORTERS = {"ring", "errors"}


def test_only_the_face_imports_the_core():
    """No module imports tensorsocket._core but the face and errors.py (CORE_IMPORTERS)."""
    importers = {m for m in _modules() if "_core" in _imports(m)}
    assert importers == CORE_IMPORTERS, \
        f"import tensorsocket._core through tensorsocket.ring: {sorted(importers - CORE_IMPORTERS)}"


def test_the_import_walk_sees_imports():
    """The walk resolves relative imports of every form (else the tests above could
    not fail)."""
    assert _imports("producer") == {"producer.tensor_producer"}  # a package's __init__
    assert "config" in _imports("producer.settings")  # from .. import config
    assert "control.server" in _imports("producer.lifecycle")
    assert "data.structure" in _imports("producer.publisher")
    assert {"data.delivery", "data.epoch_cursor"} <= _imports("consumer.place")
    assert {"consumer.options", "consumer.tensor_consumer"} <= _imports("consumer")
    assert "consumer" in _imports("sharing.share")
    assert "cli.main" in _imports("__main__")
    assert "_core" in _imports("ring")  # from . import _core


def test_the_cli_uses_the_library_segment_scan():
    """status and clean list segments through data/segments, as the producer does."""
    for cli in ("cli.status", "cli.clean"):
        assert "data.segments" in _imports(cli)
    assert "data.segments" in _imports("control.producer_files")


def test_harness_is_not_installed():
    """The child-process harness of tests, benchmarks and examples lives in tools/, out of
    the package."""
    assert not (PACKAGE / "harness.py").exists()
    assert (ROOT / "tools" / "harness.py").is_file()


# -- function length ---------------------------------------------------------------------


def _long_python_functions() -> list[str]:
    out = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                doc = ast.get_docstring(node) or ""
                if length > LONG_FUNCTION and "Long:" not in doc:
                    out.append(f"tensorsocket.{module}.{node.name} ({length} lines)")
    return out


def _long_c_functions() -> list[str]:
    """C functions over LONG_FUNCTION lines (a body from a `{` at column 0 to the next `}`
    at column 0) whose comment above does not say "Long:"."""
    out = []
    for name, text in _c_sources().items():
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line != "{" or i == 0:
                continue
            end = next(k for k in range(i + 1, len(lines)) if lines[k] == "}")
            if end - i + 1 <= LONG_FUNCTION:
                continue
            above = "\n".join(lines[max(0, i - 12):i])
            if "Long:" not in above:
                out.append(f"csrc/{name}: {lines[i - 1].strip()[:60]} ({end - i + 1} lines)")
    return out


def test_long_functions_say_why():
    """No function of the library or the C core is over 80 lines unless a "Long:" line at
    its top (docstring, or the comment above a C function) says why."""
    assert _long_python_functions() == []
    assert _long_c_functions() == []


def test_benchmarks_import_no_cycle():
    """The benchmark scripts share code through modules that import none of them."""
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
    assert graph, "no benchmark scripts"
    for a in graph:
        assert a not in _reach(graph, a), f"benchmarks/{a}.py is on an import cycle"
