"""Written by tools/torchvision_cpu as <dir>/site/sitecustomize.py: makes PyPI's CUDA build
of torchvision import beside a CPU-only torch.

torchvision/_C.so (its C++ ops) names libcudart.so.13, libc10_cuda.so and libtorch_cuda.so
as NEEDED; a CPU-only torch has none of them, so the ops library never loads and
`import torchvision` fails ("operator torchvision::nms does not exist"). Before the first
import of torchvision this hook imports torch (its libraries resolve _C.so's other
NEEDED entries), loads the stub libraries of <dir>/stubs by absolute path (their sonames
then satisfy _C.so's NEEDED entries, no LD_LIBRARY_PATH needed), and loads _C.so with
RTLD_LAZY | RTLD_GLOBAL: its CUDA functions are bound only if called, which they never
are on CPU. torchvision's own loader then finds _C.so loaded.

Nothing happens in an interpreter that does not import torchvision. Written to a path
that comes first on PYTHONPATH, this file would hide another sitecustomize: it runs the
next one on sys.path as well.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

_SITE = os.path.dirname(os.path.abspath(__file__))
_STUBS = os.path.join(os.path.dirname(_SITE), "stubs")
# Loaded in this order: libcudart first, whose symbol version _C.so's references name.
_STUB_LIBRARIES = ("libcudart.so.13", "libc10_cuda.so", "libtorch_cuda.so")


def _preload() -> None:
    """Load torch, the stubs and torchvision/_C.so (see the module's docstring)."""
    importlib.import_module("torch")  # its libc10.so, libtorch*.so: _C.so's other NEEDED

    for name in _STUB_LIBRARIES:
        ctypes.CDLL(os.path.join(_STUBS, name), mode=os.RTLD_GLOBAL)
    ctypes.CDLL(os.path.join(_SITE, "torchvision", "_C.so"),
                mode=os.RTLD_LAZY | os.RTLD_GLOBAL)


class _PreloadBeforeTorchvision(importlib.abc.MetaPathFinder):
    """A finder that finds nothing: it runs _preload() once, at the first import of the
    top-level torchvision package, and leaves the finding to the next finders."""

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname != "torchvision" or path is not None:
            return None
        sys.meta_path.remove(self)
        _preload()
        return None


def _run_hidden_sitecustomize() -> None:
    """Run the sitecustomize that this one hides (the next on sys.path), if any."""
    for entry in sys.path:
        if os.path.abspath(entry or ".") == _SITE:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


sys.meta_path.insert(0, _PreloadBeforeTorchvision())
_run_hidden_sitecustomize()
