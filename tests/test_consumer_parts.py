"""The big classes stay classes with one job over parts with one job each (issue 25): their
sizes, sibling parking through ParkingMember's public interface only, and share() passing
what it knows to the constructor instead of setting the consumer's private state."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tensorsocket"
CLASS_LINES, INIT_LINES = 350, 50


def _tree(relative: str) -> ast.Module:
    return ast.parse((PACKAGE / relative).read_text())


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _foreign_private(tree: ast.AST, own: set[str]) -> list[str]:
    """`x._name` where x is not one of `own` (self, cls): another object's private state.
    Dunder names (__dict__, __init__) are not private state."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            base = node.value
            if not (isinstance(base, ast.Name) and base.id in own):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path, name", [("consumer/tensor_consumer.py", "TensorConsumer"),
                                        ("producer/tensor_producer.py", "TensorProducer"),
                                        ("control/server.py", "ControlServer")])
def test_the_big_classes_are_small(path, name):
    """TensorConsumer, TensorProducer and ControlServer under 350 lines (docstring
    included) and their __init__ under 50: the jobs are their parts' (the files beside
    them)."""
    cls = _class(_tree(path), name)
    assert cls.end_lineno - cls.lineno + 1 < CLASS_LINES
    init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    assert init.end_lineno - init.lineno + 1 < INIT_LINES


def test_sibling_parking_reads_no_private_state_of_another_object():
    """siblings.py reads other consumers through ParkingMember's public interface only
    (it used to read their _attached, _cursor, _segment and _state_lock)."""
    assert _foreign_private(_tree("consumer/siblings.py"), {"self"}) == []


@pytest.mark.parametrize("function", ["share", "_elect_and_attach", "_attach"])
def test_share_sets_no_private_state_of_the_consumer(function):
    """share() passes what it knows to the constructor (SharedLoader): it sets no private
    attribute of the consumer and calls no private method of it."""
    tree = _tree("sharing/share.py")
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    assert _foreign_private(fn, {"self"}) == []


def test_the_checks_can_fail():
    """The private-state check reports what it is meant to."""
    doctored = ast.parse("def f(consumer):\n    consumer._ready_now()\n    self._ok = 1\n")
    assert _foreign_private(doctored, {"self"}) == ["line 2: consumer._ready_now"]
