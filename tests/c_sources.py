"""The C core's sources for the C-level test programs: every file of csrc/base, csrc/device,
csrc/ring and csrc/store (the binding, csrc/binding, includes Python.h and is left out)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE_DIRS = ("base", "device", "ring", "store")


def core_sources() -> list[str]:
    """The core's .c files, relative to the checkout."""
    return [str(p.relative_to(ROOT)) for d in CORE_DIRS
            for p in sorted((ROOT / "csrc" / d).glob("ts_*.c"))]
