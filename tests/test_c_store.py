"""Builds csrc/tests/test_store.c with the C core under ASan+UBSan and runs it: the C unit
tests of the decoded-sample store (issue 38, being built: docs/decoded-store.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from c_sources import core_sources
from test_c_ring import ASAN_FLAGS, _check_output, _compile, _run

SEGMENTS = "tensorsocket-cstore-*"  # the test program's stores, in /dev/shm


def test_c_store(tmp_path: Path) -> None:
    binary = tmp_path / "test_store"
    proc = _compile(["csrc/tests/test_store.c", *core_sources()], binary, ASAN_FLAGS)
    if proc.returncode != 0:
        pytest.fail(f"compiling the C store tests failed:\n{proc.stdout}{proc.stderr}")
    before = set(Path("/dev/shm").glob(SEGMENTS))
    try:
        rc, out = _run([str(binary)], {"UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"})
        _check_output(rc, out, expect_passed=7)
        left = set(Path("/dev/shm").glob(SEGMENTS)) - before
        assert not left, f"the store tests left segments: {sorted(left)}"
    finally:
        for seg in set(Path("/dev/shm").glob(SEGMENTS)) - before:
            seg.unlink(missing_ok=True)
