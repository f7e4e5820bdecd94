"""Batch structure: flatten a loader batch into tensors plus a small spec.

A batch may nest tuples, lists, dicts and namedtuples; its leaves may be
torch tensors, numpy arrays, numpy scalars and plain values (None, bool, int,
float, str, bytes). Tensor leaves go into the ring slot; everything else goes
by value into the spec, which is encoded with msgpack (never pickle) and
stored beside the tensors in the same slot.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import msgpack
import numpy as np
import torch

from .dtypes import DLType, numpy_leaf, torch_leaf

# Spec node tags.
TORCH, NUMPY, NUMPY_SCALAR, TUPLE, LIST, DICT, NAMEDTUPLE, VALUE = range(8)

_PLAIN = (type(None), bool, int, float, str, bytes)
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1


def flatten(batch: Any) -> tuple[bytes, list[tuple[Any, DLType]]]:
    """Split batch into (encoded spec, [(buffer, dltype), ...])."""
    leaves: list[tuple[Any, DLType]] = []
    spec = _flatten(batch, leaves, "batch")
    return msgpack.packb(spec, use_bin_type=True), leaves


def _flatten(obj: Any, leaves: list, path: str) -> list:
    """Spec node for obj; appends its tensors to leaves."""
    if isinstance(obj, torch.Tensor):
        leaves.append(_leaf(torch_leaf, obj, path))
        return [TORCH, len(leaves) - 1]
    if isinstance(obj, np.ndarray):
        leaves.append(_leaf(numpy_leaf, obj, path))
        return [NUMPY, len(leaves) - 1]
    if isinstance(obj, np.generic) and not isinstance(obj, (np.str_, np.bytes_, np.object_)):
        leaves.append(_leaf(numpy_leaf, np.asarray(obj), path))
        return [NUMPY_SCALAR, len(leaves) - 1]
    if isinstance(obj, tuple):
        children = [_flatten(v, leaves, f"{path}[{i}]") for i, v in enumerate(obj)]
        fields = getattr(type(obj), "_fields", None)
        if fields is not None and all(isinstance(f, str) for f in fields):
            return [NAMEDTUPLE, type(obj).__name__, list(fields), children]
        return [TUPLE, children]
    if isinstance(obj, list):
        return [LIST, [_flatten(v, leaves, f"{path}[{i}]") for i, v in enumerate(obj)]]
    if isinstance(obj, dict):
        keys = list(obj.keys())
        for k in keys:
            if not isinstance(k, (str, int, float, bool, bytes, type(None))):
                raise TypeError(
                    f"{path} has a dict key of type {type(k).__name__}; keys must be "
                    "str, int, float, bool, bytes or None"
                )
        return [DICT, keys, [_flatten(obj[k], leaves, f"{path}[{k!r}]") for k in keys]]
    if isinstance(obj, _PLAIN):
        if isinstance(obj, int) and not (_INT64_MIN <= obj <= _UINT64_MAX):
            raise TypeError(f"{path} is an int outside the 64-bit range: {obj}")
        return [VALUE, obj]
    raise TypeError(
        f"{path} is a {type(obj).__module__}.{type(obj).__qualname__}, which tensorsocket "
        "cannot carry: batches may hold torch tensors, numpy arrays, tuples, lists, dicts "
        "and plain values (None, bool, int, float, str, bytes); convert it in the loader "
        "or with pack_fn="
    )


def _leaf(convert: Callable, obj: Any, path: str) -> tuple[Any, DLType]:
    """convert(obj), with the batch path added to its TypeError."""
    try:
        return convert(obj)
    except TypeError as e:
        raise TypeError(f"{path}: {e}") from None


class Decoder:
    """Turns a slot's spec blob into a function that builds the batch.

    The compiled builder is cached for the last blob seen, so a stream of
    batches with the same structure decodes the spec once.
    """

    def __init__(self) -> None:
        self._last_blob: bytes | None = None
        self._last: tuple[Callable[[list], Any], list[int]] | None = None
        self._namedtuples: dict[tuple[str, tuple[str, ...]], type] = {}

    def compile(self, blob: bytes) -> tuple[Callable[[list], Any], list[int]]:
        """(build, kinds): build(leaves) makes the batch; kinds[i] is the tag of leaf i."""
        if blob == self._last_blob and self._last is not None:
            return self._last
        spec = msgpack.unpackb(blob, raw=False, use_list=True, strict_map_key=False)
        kinds: list[int] = []
        build = self._compile(spec, kinds)
        self._last_blob, self._last = blob, (build, kinds)
        return self._last

    def _compile(self, node: list, kinds: list[int]) -> Callable[[list], Any]:
        tag = node[0]
        if tag in (TORCH, NUMPY, NUMPY_SCALAR):
            i = node[1]
            while len(kinds) <= i:
                kinds.append(TORCH)
            kinds[i] = tag
            if tag == NUMPY_SCALAR:
                return lambda leaves: leaves[i][()]
            return lambda leaves: leaves[i]
        if tag == VALUE:
            value = node[1]
            return lambda leaves: value
        if tag == TUPLE:
            parts = [self._compile(c, kinds) for c in node[1]]
            return lambda leaves: tuple([p(leaves) for p in parts])
        if tag == LIST:
            parts = [self._compile(c, kinds) for c in node[1]]
            return lambda leaves: [p(leaves) for p in parts]
        if tag == DICT:
            keys = node[1]
            parts = [self._compile(c, kinds) for c in node[2]]
            return lambda leaves: {k: p(leaves) for k, p in zip(keys, parts, strict=True)}
        if tag == NAMEDTUPLE:
            cls = self._namedtuple(node[1], tuple(node[2]))
            parts = [self._compile(c, kinds) for c in node[3]]
            return lambda leaves: cls(*[p(leaves) for p in parts])
        raise ValueError(f"unknown batch-structure tag {tag!r}")

    def _namedtuple(self, name: str, fields: tuple[str, ...]) -> type:
        """A namedtuple class with this name and fields (made here, never imported)."""
        key = (name, fields)
        known = self._namedtuples.get(key)
        if known is not None:
            return known
        made = collections.namedtuple(name, fields)  # type: ignore[misc]
        self._namedtuples[key] = made
        return made
