"""The GPU path: whether CUDA IPC can work on this machine (device names are checked by
tensorsocket.validation.parse_device).

tensorsocket never links the CUDA toolkit: the C core loads the driver
(``libcuda.so.1``) with dlopen on first use. ``gpu_status()`` reports what it
found; ``TENSORSOCKET_LIBCUDA`` names another driver library to load.
"""

from __future__ import annotations
from ..ring import cuda_status


__all__ = ["gpu_available", "gpu_status"]


def gpu_status() -> dict:
    """What the GPU path sees here.

    Keys: ``available`` (bool), ``reason`` (why not, or None), ``devices``
    (list of dicts with ordinal, name, uuid, ipc_events; None without a
    driver), ``driver_version`` (e.g. 12040) and ``library``.
    """
    return cuda_status()


def gpu_available() -> bool:
    """True if the CUDA driver loads and sees at least one GPU."""
    return bool(cuda_status()["available"])
