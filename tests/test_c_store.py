"""Builds csrc/tests/test_store.c with the C core under ASan+UBSan and runs it: the C unit
tests of the decoded-sample store (issue 38: docs/decoded-store.md)."""

from __future__ import annotations

from pathlib import Path

from test_c_ring import ASAN_FLAGS, CSRC, _build, _check_output, _run

SEGMENTS = "tensorsocket-cstore-*"  # the test program's stores, in /dev/shm


def test_c_store(tmp_path: Path) -> None:
    binary = _build(tmp_path, ASAN_FLAGS, CSRC / "tests" / "test_store.c")
    before = set(Path("/dev/shm").glob(SEGMENTS))
    try:
        rc, out = _run([str(binary)], {"UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"})
        _check_output(rc, out, expect_passed=10)
        left = set(Path("/dev/shm").glob(SEGMENTS)) - before
        assert not left, f"the store tests left segments: {sorted(left)}"
    finally:
        for seg in set(Path("/dev/shm").glob(SEGMENTS)) - before:
            seg.unlink(missing_ok=True)
