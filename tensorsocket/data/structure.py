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
from torch.utils.dlpack import to_dlpack

from .dtypes import COMPLEX_CODE, NUMPY_AS_IS, DLType, numpy_leaf, torch_leaf

# Spec node tags.
TORCH, NUMPY, NUMPY_SCALAR, TUPLE, LIST, DICT, NAMEDTUPLE, VALUE = range(8)

_PLAIN = (type(None), bool, int, float, str, bytes)
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1


def flatten(batch: Any) -> tuple[bytes, list[tuple[Any, DLType]]]:
    """Split batch into (encoded spec, [(buffer, dltype), ...])."""
    spec, leaves = _split(batch)
    return msgpack.packb(spec, use_bin_type=True), leaves


class Encoder:
    """flatten() for a stream of batches: the encoded spec of the last batch is reused
    while the structure stays the same. Only a spec of tensors and str dict keys is kept:
    == cannot tell plain values apart (True == 1 == 1.0), so specs holding any are encoded
    every time."""

    def __init__(self) -> None:
        self._last: tuple[list | None, bytes] = (None, b"")  # (reusable spec, its bytes)
        # The last spec was a tuple of this many torch tensors, in order (the common batch,
        # (inputs, targets)): a batch of the same shape is flattened without a walk.
        self._flat_tuple = -1

    def flatten(self, batch: Any, capsules: bool = False) -> tuple[bytes, list[tuple[Any, DLType]]]:
        """As flatten(batch). capsules: a flat tuple's tensors may be given as DLPack
        capsules (which Ring.publish reads, cheaper to make than arrays) instead of arrays."""
        if type(batch) is tuple and len(batch) == self._flat_tuple:
            leaves = _flat_leaves(batch, capsules)
            if leaves is not None:
                return self._last[1], leaves
        spec, leaves = _split(batch)
        last_spec, packed = self._last
        if last_spec is None or spec != last_spec:
            packed = msgpack.packb(spec, use_bin_type=True)
            self._last = (spec if _reusable(spec) else None, packed)
        flat = spec[0] == TUPLE and all(c == [TORCH, i] for i, c in enumerate(spec[1]))
        self._flat_tuple = len(spec[1]) if flat and self._last[0] is not None else -1
        return packed, leaves


def _flat_leaves(batch: tuple, capsules: bool) -> list[tuple[Any, DLType]] | None:
    """The leaves of a tuple of plain tensors, or None if one is not (the walk then says
    how, and where). capsules: as DLPack capsules of CPU tensors; to_dlpack exports a
    tensor's memory as it is, so one with the negative or conjugate bit (a lazy view whose
    values differ from its memory) goes the walk's way, which resolves it."""
    if not capsules:
        try:
            leaves = [torch_leaf(t) for t in batch if type(t) is torch.Tensor]
        except TypeError:
            return None
        return leaves if len(leaves) == len(batch) else None
    leaves = []
    for t in batch:
        dl = NUMPY_AS_IS.get(t.dtype) if type(t) is torch.Tensor else None
        if dl is None or not t.is_cpu or t.is_neg() or (dl[0] == COMPLEX_CODE and t.is_conj()):
            return None
        try:
            leaves.append((to_dlpack(t), dl))
        except (RuntimeError, TypeError, BufferError):
            return None
    return leaves


def _reusable(node: list) -> bool:
    """Whether equal specs (==) are the same spec: no plain values, only str dict keys."""
    tag = node[0]
    if tag in (TORCH, NUMPY, NUMPY_SCALAR):
        return True
    if tag in (TUPLE, LIST):
        return all(_reusable(c) for c in node[1])
    if tag == DICT:
        return all(type(k) is str for k in node[1]) and all(_reusable(c) for c in node[2])
    if tag == NAMEDTUPLE:
        return all(_reusable(c) for c in node[3])
    return False


def _split(batch: Any) -> tuple[list, list[tuple[Any, DLType]]]:
    """(spec, leaves) of a batch."""
    leaves: list[tuple[Any, DLType]] = []
    try:
        spec = _flatten(batch, leaves, None)
    except TypeError:
        # Once more, naming where in the batch the culprit sits (the fast pass above
        # builds no paths: that is most of its cost per batch).
        _flatten(batch, [], "batch")
        raise
    return spec, leaves


def _flatten(obj: Any, leaves: list, path: str | None) -> list:
    """Spec node for obj; appends its tensors to leaves. path: where obj is in the batch,
    for error messages; None: not tracked (its TypeError then names no place)."""
    if isinstance(obj, torch.Tensor):
        leaves.append(torch_leaf(obj) if path is None else _leaf(torch_leaf, obj, path))
        return [TORCH, len(leaves) - 1]
    if isinstance(obj, np.ndarray):
        leaves.append(numpy_leaf(obj) if path is None else _leaf(numpy_leaf, obj, path))
        return [NUMPY, len(leaves) - 1]
    if isinstance(obj, np.generic) and not isinstance(obj, (np.str_, np.bytes_, np.object_)):
        leaves.append(_leaf(numpy_leaf, np.asarray(obj), path or "batch"))
        return [NUMPY_SCALAR, len(leaves) - 1]
    if isinstance(obj, tuple):
        if path is None:
            children = [_flatten(v, leaves, None) for v in obj]
        else:
            children = [_flatten(v, leaves, f"{path}[{i}]") for i, v in enumerate(obj)]
        fields = getattr(type(obj), "_fields", None)
        if fields is not None and all(isinstance(f, str) for f in fields):
            return [NAMEDTUPLE, type(obj).__name__, list(fields), children]
        return [TUPLE, children]
    if isinstance(obj, list):
        if path is None:
            return [LIST, [_flatten(v, leaves, None) for v in obj]]
        return [LIST, [_flatten(v, leaves, f"{path}[{i}]") for i, v in enumerate(obj)]]
    if isinstance(obj, dict):
        keys = list(obj.keys())
        for k in keys:
            if not isinstance(k, (str, int, float, bool, bytes, type(None))):
                raise TypeError(
                    f"{path} has a dict key of type {type(k).__name__}; keys must be "
                    "str, int, float, bool, bytes or None"
                )
        if path is None:
            return [DICT, keys, [_flatten(obj[k], leaves, None) for k in keys]]
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
        build = self._compile_flat(spec, kinds) or self._compile(spec, kinds)
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

    def _compile_flat(self, node: list, kinds: list[int]) -> Callable[[list], Any] | None:
        """The builder of a batch (the root of its spec) that is one tuple, list or dict of
        all its leaves in order (the common batch: (images, labels), {"x": ..., "y": ...}), without a call
        per leaf; None for any other batch."""
        tag = node[0]
        children = node[2] if tag == DICT else node[1] if tag in (TUPLE, LIST) else None
        if children is None or not all(
                c[0] in (TORCH, NUMPY) and c[1] == i for i, c in enumerate(children)):
            return None
        for c in children:
            kinds.append(c[0])
        if tag == TUPLE:
            return tuple
        if tag == LIST:
            return list
        keys = node[1]
        return lambda leaves: dict(zip(keys, leaves, strict=True))

    def _namedtuple(self, name: str, fields: tuple[str, ...]) -> type:
        """A namedtuple class with this name and fields (made here, never imported)."""
        key = (name, fields)
        known = self._namedtuples.get(key)
        if known is not None:
            return known
        made = collections.namedtuple(name, fields)  # type: ignore[misc]
        self._namedtuples[key] = made
        return made
