"""Mapping between torch / numpy dtypes and DLPack (code, bits, lanes)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# DLPack type codes
_INT, _UINT, _FLOAT, _BFLOAT, _COMPLEX, _BOOL = 0, 1, 2, 4, 5, 6
COMPLEX_CODE = _COMPLEX

DLType = tuple[int, int, int]

# torch dtype -> (DLPack type, dtype of a same-size view numpy can hold or None)
_TORCH: dict[torch.dtype, tuple[DLType, torch.dtype | None]] = {
    torch.bool: ((_BOOL, 8, 1), None),
    torch.uint8: ((_UINT, 8, 1), None),
    torch.int8: ((_INT, 8, 1), None),
    torch.int16: ((_INT, 16, 1), None),
    torch.int32: ((_INT, 32, 1), None),
    torch.int64: ((_INT, 64, 1), None),
    torch.float16: ((_FLOAT, 16, 1), None),
    torch.float32: ((_FLOAT, 32, 1), None),
    torch.float64: ((_FLOAT, 64, 1), None),
    torch.bfloat16: ((_BFLOAT, 16, 1), torch.int16),
    torch.complex64: ((_COMPLEX, 64, 1), None),
    torch.complex128: ((_COMPLEX, 128, 1), None),
}
for _name, _bits in (("uint16", 16), ("uint32", 32), ("uint64", 64)):
    if hasattr(torch, _name):
        _TORCH[getattr(torch, _name)] = ((_UINT, _bits, 1), None)
if hasattr(torch, "complex32"):
    _TORCH[torch.complex32] = ((_COMPLEX, 32, 1), torch.int32)

# torch dtype -> DLPack type, for the dtypes whose tensors numpy() exports as they are
# (torch_leaf's common case; Encoder's flat batches read it without a call).
NUMPY_AS_IS: dict[torch.dtype, DLType] = {d: dl for d, (dl, view) in _TORCH.items()
                                          if view is None}

_NUMPY_KINDS = {"b": _BOOL, "i": _INT, "u": _UINT, "f": _FLOAT, "c": _COMPLEX}

# The DLPack dtypes a consumer's torch can import: a leaf of any other (numpy's longdouble
# and clongdouble: 128 and 256 bits) is refused at the producer, not at every consumer.
_CARRIED: frozenset[DLType] = frozenset(dl for dl, _ in _TORCH.values())


def torch_leaf(t: torch.Tensor) -> tuple[Any, DLType]:
    """A buffer exporter for a CPU tensor and its DLPack dtype.

    Raises TypeError for tensors that cannot be carried (other devices,
    sparse or quantized layouts, unknown dtypes).
    """
    dl = NUMPY_AS_IS.get(t.dtype)
    if dl is not None:
        # The common case, a CPU strided tensor without grad, conjugate or negative bit:
        # numpy() refuses every other (and the checks below then say why, or fix it).
        try:
            return t.numpy(), dl
        except (RuntimeError, TypeError):
            pass
    entry = _TORCH.get(t.dtype)
    if entry is None:
        raise TypeError(f"tensors of dtype {t.dtype} are not supported")
    if t.device.type != "cpu":
        raise TypeError(
            f"tensor is on {t.device}: batches must hold CPU tensors (with device='cuda:N' the "
            "producer copies each batch to the GPU once, for every consumer)"
        )
    if t.layout != torch.strided:
        raise TypeError(f"tensors with layout {t.layout} are not supported")
    dl, view_as = entry
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if view_as is not None:
        t = t.view(view_as)
    return t.numpy(), dl


def numpy_leaf(a: np.ndarray) -> tuple[Any, DLType]:
    """The array itself (it exports a buffer) and its DLPack dtype."""
    code = _NUMPY_KINDS.get(a.dtype.kind)
    dl = (code, a.dtype.itemsize * 8, 1) if code is not None else None
    if dl not in _CARRIED or a.dtype.byteorder == ">":
        raise TypeError(
            f"numpy arrays of dtype {a.dtype} are not supported (torch, on the consumers' "
            "side, has no such dtype: convert it, e.g. a.astype(np.float64))")
    return a, dl
