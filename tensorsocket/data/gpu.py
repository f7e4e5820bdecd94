"""The GPU path: device names, and whether CUDA IPC can work on this machine.

tensorsocket never links the CUDA toolkit: the C core loads the driver
(``libcuda.so.1``) with dlopen on first use. ``gpu_status()`` reports what it
found; ``TENSORSOCKET_LIBCUDA`` names another driver library to load.
"""

from __future__ import annotations

from typing import Any

from .. import _core

__all__ = ["gpu_available", "gpu_status", "parse_device"]


def gpu_status() -> dict:
    """What the GPU path sees here.

    Keys: ``available`` (bool), ``reason`` (why not, or None), ``devices``
    (list of dicts with ordinal, name, uuid, ipc_events; None without a
    driver), ``driver_version`` (e.g. 12040) and ``library``.
    """
    return _core.cuda_status()


def gpu_available() -> bool:
    """True if the CUDA driver loads and sees at least one GPU."""
    return bool(_core.cuda_status()["available"])


def parse_device(device: Any, knob: str = "device") -> tuple[str, int | None]:
    """("cpu", None), ("cuda", None) for "cuda" without an index, or ("cuda", N).

    Accepts None (returns ("auto", None)), "cpu", "cuda", "cuda:N", an int N
    and torch.device objects.
    """
    if device is None:
        return "auto", None
    if isinstance(device, bool):
        raise TypeError(f"{knob}= must be 'cpu', 'cuda', 'cuda:N' or an int, not a bool")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"{knob}={device}: a CUDA device index is >= 0")
        return "cuda", device
    text = str(device)  # torch.device prints as "cuda:0"
    kind, _, index = text.partition(":")
    if kind == "cpu" and not index:
        return "cpu", None
    if kind == "cuda":
        if not index:
            return "cuda", None
        if index.isdigit():
            return "cuda", int(index)
    raise ValueError(f"{knob}={device!r} is not a device: use 'cpu', 'cuda' or 'cuda:N'")
