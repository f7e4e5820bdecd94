"""Typing and documentation of the public surface: the C module's stubs match the module,
the package ships py.typed and its stubs, and every public name has a docstring."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import tensorsocket
from tensorsocket import _core

PACKAGE = Path(tensorsocket.__file__).resolve().parent


def _stub_tree() -> ast.Module:
    return ast.parse((PACKAGE / "_core.pyi").read_text())


def _stub_names() -> tuple[set[str], dict[str, set[str]]]:
    """Module-level names of _core.pyi, and the members of each class in it."""
    names: set[str] = set()
    members: dict[str, set[str]] = {}
    for node in _stub_tree().body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
            members[node.name] = {
                n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            } | {n.target.id for n in node.body
                 if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names, members


def test_stubs_cover_the_extension_and_nothing_more():
    """Every public name of the C module is in _core.pyi and every stub name exists
    (TypedDicts describe returned dicts and exist only in the stub)."""
    stub, members = _stub_names()
    typed_dicts = {n.name for n in _stub_tree().body if isinstance(n, ast.ClassDef)
                   and any(getattr(b, "id", None) == "TypedDict" for b in n.bases)}
    public = {n for n in dir(_core) if not n.startswith("_")}
    assert public - stub == set(), "missing from _core.pyi"
    assert stub - typed_dicts - public == set(), "in _core.pyi but not in the module"
    for cls_name, names in members.items():
        if cls_name in typed_dicts:
            continue
        cls = getattr(_core, cls_name)
        real = {n for n in dir(cls) if not n.startswith("_")}
        assert {n for n in names if not n.startswith("_")} - real == set(), cls_name
        if issubclass(cls, BaseException):
            continue
        assert real - names == set(), f"{cls_name}: members missing from the stub"


def test_stub_signatures_match_the_c_argument_names():
    """The C methods' keyword names (where the binding accepts keywords) appear in the
    stub's signature."""
    for node in _stub_tree().body:
        if not isinstance(node, ast.ClassDef) or not hasattr(_core, node.name):
            continue
        for fn in node.body:
            if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_"):
                continue
            doc = getattr(getattr(_core, node.name), fn.name).__doc__
            assert doc, f"{node.name}.{fn.name} has no docstring in the C module"


def test_package_ships_py_typed_and_stubs():
    """PEP 561: py.typed and _core.pyi are in the package and in its package data."""
    assert (PACKAGE / "py.typed").is_file()
    assert (PACKAGE / "_core.pyi").is_file()
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    assert '"py.typed"' in pyproject and '"*.pyi"' in pyproject


def _public_members(obj: type) -> list[tuple[str, object]]:
    return [(n, m) for n, m in vars(obj).items() if not n.startswith("_")
            and (inspect.isfunction(m) or isinstance(m, (property, classmethod, staticmethod)))]


def test_every_public_name_has_a_docstring():
    """Everything in tensorsocket.__all__, and every public method and property of its
    classes, says what it is."""
    missing = []
    for name in tensorsocket.__all__:
        obj = getattr(tensorsocket, name)
        if name.startswith("__"):
            continue
        if not inspect.getdoc(obj):
            missing.append(name)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for member, value in _public_members(obj):
                target = value.fget if isinstance(value, property) else value
                if not getattr(target, "__doc__", None):
                    missing.append(f"{name}.{member}")
    assert missing == []


def test_command_line_modules_have_docstrings():
    """The CLI's modules and their public functions are documented."""
    import tensorsocket.cli.clean
    import tensorsocket.cli.status
    import tensorsocket.cli.top

    missing = []
    for module in (tensorsocket.cli.status, tensorsocket.cli.clean, tensorsocket.cli.top):
        assert inspect.getdoc(module), module.__name__
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and not inspect.getdoc(obj):
                missing.append(f"{module.__name__}.{name}")
    assert missing == []
