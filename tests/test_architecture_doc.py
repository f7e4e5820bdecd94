"""docs/architecture.md stays true to the tree: its file map lists every module, and what
it cites exists.

The file map is the "## File map" section: tables whose rows start with one path in
backticks (``| `tensorsocket/errors.py` | its job |``). The checks:

- every module of tensorsocket/ (any .py, recursively) and every file of the _core
  extension's sources (csrc/, less the C tests) has a row, and tools/harness.py too;
- every path in the map is a file of the checkout, listed once;
- every file the doc names anywhere (in backticks, or as a link) exists: a full path, or a
  file name or tail (`ts_ring.c`, `cli/status.py`) that some file of the checkout ends with;
- every test the doc cites exists: `tests/test_x.py`, `tests/test_x.py::test_y`, or a
  bare test function name `test_y`;
- every C name it writes in backticks (`ts_ring_publish`, `TS_SLICE_NS`) occurs in csrc/,
  every method of the extension's types (`Ring.publish`) is in tensorsocket/_core.pyi, and
  every `module.name` / `Class.name` of tensorsocket/ it writes is defined there;
- every `architecture.md#anchor` link of the other docs names a heading of the doc.
"""

from __future__ import annotations

import ast
import os
import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "tensorsocket"
CSRC = ROOT / "csrc"
STUBS = PACKAGE / "_core.pyi"

MAP_HEADING = "## File map"
ALSO_MAPPED = ("tools/harness.py",)  # outside the package, mapped all the same
FILE_EXTENSIONS = ("py", "pyi", "c", "h", "md", "toml", "cfg", "txt", "json", "yml", "yaml")
PATH_TOKEN = re.compile(rf"^[\w./-]+\.(?:{'|'.join(FILE_EXTENSIONS)})$")
FENCE = re.compile(r"^```.*?^```[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
TEST_CITATION = re.compile(r"\btests/(test_\w+\.py)(?:::(\w+))?")
C_NAME = re.compile(r"\b(?:ts|TS)_\w+")
TYPE_METHOD = re.compile(r"\b(Ring|Slot|SlotView)\.(\w+)")
CORE_NAME = re.compile(r"\b_core\.(\w+)")
DOTTED = re.compile(r"\b([A-Za-z_]\w*)\.([A-Za-z_]\w*)\b")
SYSTEM_HEADER = re.compile(r"^(?!ts_)[A-Za-z]\w*\.h$")  # Python.h, cuda.h: not files of ours
SKIPPED_DIRS = {".git", "__pycache__", "build", "dist", "node_modules", ".venv", "venv"}


# -- reading the doc ---------------------------------------------------------------------


def map_section(text: str) -> str:
    """The text of the file map: from its heading to the next heading of its level."""
    start = text.find("\n" + MAP_HEADING + "\n")
    assert start >= 0, f"{DOC.name} has no {MAP_HEADING!r} section"
    rest = text[start + len(MAP_HEADING) + 2:]
    end = re.search(r"^## ", rest, re.MULTILINE)
    return rest if end is None else rest[:end.start()]


def map_paths(text: str) -> list[str]:
    """The paths of the file map's table rows, in order (a row's first cell must be one
    path in backticks; header and rule rows are passed by)."""
    paths = []
    for line in map_section(text).splitlines():
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        first = line.split("|")[1].strip()
        if first == "path":
            continue
        cell = re.fullmatch(r"`([^`]+)`", first)
        assert cell, f"a file map row's first cell is not one path in backticks: {line!r}"
        paths.append(cell.group(1))
    return paths


def prose(text: str) -> str:
    """The doc without its fenced blocks (pictures are not checked for names)."""
    return FENCE.sub("", text)


def code_spans(text: str) -> list[str]:
    """What the doc writes in backticks outside fenced blocks."""
    return INLINE_CODE.findall(prose(text))


def cited_files(text: str) -> set[str]:
    """Files the doc names: path-like spans in backticks, and link targets that are files
    (relative to docs/; anchors and web addresses left out)."""
    named = {span for span in code_spans(text) if PATH_TOKEN.match(span)}
    for target in LINK.findall(prose(text)):
        target = target.split("#")[0]
        if target and "://" not in target and not target.startswith("mailto:"):
            named.add(os.path.normpath(os.path.join("docs", target)))
    return named


# -- the checkout --------------------------------------------------------------------------


@lru_cache(maxsize=1)
def checkout_files() -> frozenset[str]:
    """Every file of the checkout, relative to its root (build outputs and caches left
    out)."""
    found: set[str] = set()
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS and not d.startswith(".")
                   and not d.endswith(".egg-info")]
        rel = Path(top).relative_to(ROOT)
        found.update(str(rel / f) if str(rel) != "." else f for f in files)
    return frozenset(found)


def required_paths() -> set[str]:
    """What the map must list: every .py of tensorsocket/, every file of the _core
    extension's sources (csrc/ less csrc/tests/), and ALSO_MAPPED."""
    modules = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
               if "__pycache__" not in p.parts}
    core = {str(p.relative_to(ROOT)) for p in CSRC.rglob("*")
            if p.is_file() and p.relative_to(CSRC).parts[0] != "tests"}
    return modules | core | set(ALSO_MAPPED)


def missing_from_map(text: str) -> list[str]:
    return sorted(required_paths() - set(map_paths(text)))


def map_paths_not_found(text: str) -> list[str]:
    return sorted(p for p in map_paths(text) if not (ROOT / p).is_file())


def files_not_found(text: str) -> list[str]:
    """Cited files that are no file of the checkout: a full path, or the tail of one."""
    files = checkout_files()
    return sorted(name for name in cited_files(text)
                  if name not in files and not any(f.endswith("/" + name) for f in files)
                  and not SYSTEM_HEADER.match(name))


@lru_cache(maxsize=None)
def _test_functions(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text())
    return frozenset(n.name for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def cited_tests_not_found(text: str) -> list[str]:
    """Cited test files and functions that do not exist."""
    bad = []
    tests = ROOT / "tests"
    for file, function in TEST_CITATION.findall(prose(text)):
        path = tests / file
        if not path.is_file():
            bad.append(f"tests/{file}")
        elif function and function not in _test_functions(path):
            bad.append(f"tests/{file}::{function}")
    everywhere = set().union(*(_test_functions(p) for p in tests.glob("test_*.py")))
    for span in code_spans(text):
        if re.fullmatch(r"test_\w+", span) and span not in everywhere:
            bad.append(span)
    return sorted(set(bad))


# -- names -------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _c_words() -> frozenset[str]:
    """Every word of csrc/'s sources."""
    return frozenset(re.findall(r"\w+", "\n".join(p.read_text() for p in CSRC.rglob("*.[ch]"))))


def c_names_not_found(text: str) -> list[str]:
    """ts_* / TS_* names in backticks that csrc/ does not have (a name ending in "_" is
    a prefix, as in `ts_fault_fork_*`)."""
    words = _c_words()
    bad = set()
    for span in code_spans(text):
        if PATH_TOKEN.match(span):
            continue
        for name in C_NAME.findall(span):
            found = any(w.startswith(name) for w in words) if name.endswith("_") else \
                name in words
            if not found:
                bad.add(name)
    return sorted(bad)


def core_names_not_found(text: str) -> list[str]:
    """Methods of Ring / Slot / SlotView and names of _core, in backticks, that the
    extension's stubs do not declare."""
    stubs = STUBS.read_text()
    bad = set()
    for span in code_spans(text):
        if PATH_TOKEN.match(span):
            continue
        for cls, method in TYPE_METHOD.findall(span):
            if not re.search(rf"^\s+def {method}\(", stubs, re.MULTILINE):
                bad.add(f"{cls}.{method}")
        for name in CORE_NAME.findall(span):
            if not re.search(rf"^(?:def |class )?{name}\b", stubs, re.MULTILINE):
                bad.add(f"_core.{name}")
    return sorted(bad)


def _bound(body: list[ast.stmt]) -> set[str]:
    """Names a block of statements binds at its own level (defs, classes, assignments,
    imports; inside if / try / with blocks too)."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody"):
                names |= _bound(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                names |= _bound(handler.body)
    return names


def _members(cls: ast.ClassDef) -> set[str]:
    """What a class defines: its body's names, and attributes its methods set on self."""
    names = _bound(cls.body)
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
    return names


@lru_cache(maxsize=1)
def _python_definitions() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module stem -> names it defines at its top level, class -> names it defines),
    over tensorsocket/ and tools/."""
    modules: dict[str, set[str]] = {}
    classes: dict[str, set[str]] = {}
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "tools").glob("*.py")]:
        tree = ast.parse(path.read_text())
        modules.setdefault(path.stem, set()).update(_bound(tree.body))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, set()).update(_members(node))
    return modules, classes


def python_names_not_found(text: str) -> list[str]:
    """`module.name` and `Class.name` spans, for modules and classes of tensorsocket/
    and tools/, whose name is not defined there."""
    modules, classes = _python_definitions()
    bad = set()
    for span in code_spans(text):
        if PATH_TOKEN.match(span) or TYPE_METHOD.search(span) or "<" in span or "/" in span:
            continue  # a path, a pattern of file names, or the extension's types (above)
        for owner, name in DOTTED.findall(span):
            if owner in classes:
                if name not in classes[owner]:
                    bad.add(f"{owner}.{name}")
            elif owner in modules and name not in modules[owner]:
                bad.add(f"{owner}.{name}")
    return sorted(bad)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def broken_anchors() -> list[str]:
    """Links of the other docs into architecture.md whose anchor is no heading of it."""
    anchors = {_anchor(m) for m in re.findall(r"^#+ (.+)$", prose(DOC.read_text()),
                                              re.MULTILINE)}
    bad = []
    for doc in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        if not doc.is_file():
            continue
        for anchor in re.findall(r"architecture\.md#([\w-]+)", doc.read_text()):
            if anchor not in anchors:
                bad.append(f"{doc.relative_to(ROOT)}: #{anchor}")
    return bad


# -- the tests -----------------------------------------------------------------------------


def doc() -> str:
    return DOC.read_text()


def test_every_module_is_in_the_file_map():
    """Each .py of tensorsocket/ (recursively), each file of the _core sources and
    tools/harness.py has a row in the file map."""
    missing = missing_from_map(doc())
    assert not missing, f"docs/architecture.md's file map lacks {missing}: add a row each"


def test_the_file_map_names_only_files_that_exist():
    text = doc()
    gone = map_paths_not_found(text)
    assert not gone, f"docs/architecture.md's file map names files that do not exist: {gone}"
    paths = map_paths(text)
    twice = sorted({p for p in paths if paths.count(p) > 1})
    assert not twice, f"listed more than once in the file map: {twice}"


def test_every_file_the_doc_cites_exists():
    gone = files_not_found(doc())
    assert not gone, f"docs/architecture.md cites files that do not exist: {gone}"


def test_every_test_the_doc_cites_exists():
    gone = cited_tests_not_found(doc())
    assert not gone, f"docs/architecture.md cites tests that do not exist: {gone}"


def test_every_name_the_doc_writes_is_in_the_code():
    text = doc()
    gone = c_names_not_found(text) + core_names_not_found(text) + python_names_not_found(text)
    assert not gone, f"docs/architecture.md names what the code does not have: {gone}"


def test_links_into_the_doc_find_their_heading():
    bad = broken_anchors()
    assert not bad, f"links to headings docs/architecture.md does not have: {bad}"


def test_the_checks_can_fail():
    """Each check above reports a doctored doc (else they could pass whatever the doc
    says)."""
    text = doc()
    paths = map_paths(text)
    assert "tensorsocket/producer/tensor_producer.py" in paths and "csrc/ring/ts_ring.c" in paths
    assert "tensorsocket/control/protocol.py" in required_paths()
    assert "csrc/binding/ts_py.h" in required_paths()

    without = "\n".join(line for line in text.splitlines()
                        if "`tensorsocket/control/protocol.py`" not in line)
    assert missing_from_map(without) == ["tensorsocket/control/protocol.py"]

    row = "| `tensorsocket/no_such_module.py` | nothing |\n"
    extra = text.replace("| `tensorsocket/errors.py` |", row + "| `tensorsocket/errors.py` |", 1)
    assert map_paths_not_found(extra) == ["tensorsocket/no_such_module.py"]

    cites = text + "\nSee `tests/test_imports.py`, `_shared_producer.py` and `ts_ring.c`.\n"
    assert files_not_found(cites) == ["_shared_producer.py", "tests/test_imports.py"]
    assert files_not_found("`Python.h` and `ts_no_such_header.h`") == ["ts_no_such_header.h"]
    assert _anchor("Who may attach") == "who-may-attach" and _anchor("share()") == "share"
    assert cited_tests_not_found(cites) == ["tests/test_imports.py"]
    assert cited_tests_not_found("tests/test_layering.py::test_no_such_thing") == \
        ["tests/test_layering.py::test_no_such_thing"]
    assert cited_tests_not_found("tests/test_layering.py::test_no_import_cycle") == []

    names = ("`ts_device_fence` `ts_ring_publish` `ts_fault_fork_*` `Ring.fence` "
             "`Ring.publish` `protocol.message` `protocol.Hello` "
             "`RingSizing.shape` `TensorProducer.no_such_method`")
    assert c_names_not_found(names) == ["ts_device_fence"]
    assert core_names_not_found(names) == ["Ring.fence"]
    assert python_names_not_found(names) == ["TensorProducer.no_such_method",
                                             "protocol.message"]
