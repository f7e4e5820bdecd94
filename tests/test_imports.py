"""The library never imports the command line: no module that producers, consumers or
share() load imports the CLI modules (status, top, clean, demo, __main__), whose code
they do not need; what both use (the segment scan) lives in a library module."""

from __future__ import annotations

import ast

from conftest import ROOT

PACKAGE = ROOT / "tensorsocket"
CLI = {"status", "top", "clean", "demo", "_demo_panel", "__main__"}


def _imported(path) -> set[str]:
    """The tensorsocket modules a module imports (anywhere in it, functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "tensorsocket" and len(parts) > 1:
                    found.add(parts[1])
        elif isinstance(node, ast.ImportFrom):
            relative = node.level == 1
            absolute = node.level == 0 and (node.module or "").split(".")[0] == "tensorsocket"
            if not relative and not absolute:
                continue
            parts = (node.module or "").split(".")
            module = parts[0] if relative else (parts[1] if len(parts) > 1 else "")
            if module:
                found.add(module)
            else:  # from . import x / from tensorsocket import x
                found.update(alias.name for alias in node.names)
    return found


def test_library_modules_never_import_the_cli():
    library = [p for p in sorted(PACKAGE.glob("*.py")) if p.stem not in CLI]
    assert {p.stem for p in library} >= {"producer", "consumer", "control", "share",
                                        "segments", "config", "protocol"}
    offenders = {p.stem: sorted(_imported(p) & CLI) for p in library}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_cli_uses_the_library_segment_scan():
    """status and clean list segments through tensorsocket.segments, as the producer does."""
    for cli in ("status", "clean"):
        assert "segments" in _imported(PACKAGE / f"{cli}.py")
    assert "segments" in _imported(PACKAGE / "producer_files.py")
