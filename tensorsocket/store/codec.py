"""A decoded sample as one block of bytes in the store, and back.

A sample (what a dataset's ``__getitem__`` gives: a tensor, a tuple ``(image, label)``, a
dict, nested as a batch may be) is split as a ring slot splits a batch
(``data.structure.flatten``): its tensors and arrays are the leaves, everything else goes by
value into the spec (msgpack, never pickle). The block is

- ``b"TSS1"``, then the header's length (u32, little-endian), then the header: msgpack of
  ``[spec, [[dl_code, dl_bits, dl_lanes], shape, offset], ...]`` per leaf;
- each leaf's bytes at its offset (a multiple of LEAF_ALIGN).

``decode`` gives the sample back from a private copy of the block (``Store.get`` copies it
out): its tensors are views of that copy, writable, the store's own bytes untouched.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np
import torch

from ..data.structure import NUMPY, Decoder, flatten

MAGIC = b"TSS1"
_PREAMBLE = struct.Struct("<4sI")
LEAF_ALIGN = 64

# DLPack (code, bits) -> the torch dtype a leaf is read back as.
_TORCH_OF: dict[tuple[int, int], torch.dtype] = {
    (6, 8): torch.bool, (1, 8): torch.uint8, (0, 8): torch.int8, (0, 16): torch.int16,
    (0, 32): torch.int32, (0, 64): torch.int64, (2, 16): torch.float16,
    (2, 32): torch.float32, (2, 64): torch.float64, (4, 16): torch.bfloat16,
    (5, 64): torch.complex64, (5, 128): torch.complex128,
}
for _name, _bits in (("uint16", 16), ("uint32", 32), ("uint64", 64)):
    if hasattr(torch, _name):
        _TORCH_OF[(1, _bits)] = getattr(torch, _name)

_NUMPY_KIND = {0: "i", 1: "u", 2: "f", 5: "c", 6: "b"}


def _aligned(x: int) -> int:
    """x rounded up to a multiple of LEAF_ALIGN."""
    return (x + LEAF_ALIGN - 1) // LEAF_ALIGN * LEAF_ALIGN


def encode(sample: Any) -> tuple[int, list[tuple[int, Any]]]:
    """(the block's bytes, its pieces as (offset, buffer) pairs) of `sample`; TypeError
    naming what in it cannot be stored (as a batch's leaves would be refused)."""
    spec, leaves = flatten(sample)
    arrays = [_contiguous(np.asarray(array)) for array, _ in leaves]
    described, offsets = [], []
    # The header's size depends on the offsets it holds: lay the leaves out after a bound
    # on it (msgpack of each offset takes at most 9 bytes).
    draft = msgpack.packb([spec, [[list(dl), list(a.shape), 0] for a, (_, dl) in
                                  zip(arrays, leaves)]], use_bin_type=True)
    offset = _aligned(_PREAMBLE.size + len(draft) + 9 * len(arrays))
    for array, (_, dl) in zip(arrays, leaves):
        offsets.append(offset)
        described.append([list(dl), list(array.shape), offset])
        offset = _aligned(offset + array.nbytes)
    header = msgpack.packb([spec, described], use_bin_type=True)
    pieces: list[tuple[int, Any]] = [(0, _PREAMBLE.pack(MAGIC, len(header)) + header)]
    pieces += [(off, array) for off, array in zip(offsets, arrays) if array.nbytes]
    return max(offset, 1), pieces


def _contiguous(array: np.ndarray) -> np.ndarray:
    """The array, or a C-contiguous copy of it (of the same shape: ascontiguousarray would
    make a 0-d array 1-d)."""
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def block_bytes(nbytes: int, pieces: list[tuple[int, Any]]) -> bytes:
    """The block that encode()'s (nbytes, pieces) make, as bytes (what Store.put writes,
    zeros between the pieces: to compare a decode with what the store holds)."""
    block = bytearray(nbytes)
    for offset, piece in pieces:
        data = memoryview(piece).cast("B")
        block[offset:offset + len(data)] = data
    return bytes(block)


def encoded_bytes(sample: Any) -> bytes:
    """The block of `sample` as bytes."""
    return block_bytes(*encode(sample))


def arena_block(nbytes: int) -> int:
    """The bytes of the store's arena a block of `nbytes` takes: a power of two, at least
    4 KiB (the buddy allocator's orders, TS_STORE_MIN_ORDER in csrc/store/ts_store.h)."""
    return 1 << max(12, (nbytes - 1).bit_length())


class SampleDecoder:
    """decode() of blocks, with the spec's builder kept for the next block of the same
    structure (the samples of one dataset all have one, as a rule)."""

    def __init__(self) -> None:
        self._decoder = Decoder()

    def decode(self, block: bytearray) -> Any:
        """The sample a block holds (its tensors: views of `block`); ValueError if it is
        no block of this format."""
        magic, length = _PREAMBLE.unpack_from(block, 0)
        if magic != MAGIC:
            raise ValueError("a stored sample of an unknown format")
        spec, described = msgpack.unpackb(
            bytes(block[_PREAMBLE.size:_PREAMBLE.size + length]), raw=False, use_list=True,
            strict_map_key=False)
        build, kinds = self._decoder.compile(spec)
        leaves = [_leaf(block, dl, shape, offset, kinds[k] if k < len(kinds) else None)
                  for k, (dl, shape, offset) in enumerate(described)]
        return build(leaves)


def _leaf(block: bytearray, dl: list, shape: list, offset: int, kind: int | None) -> Any:
    """One leaf of a block: a numpy array for a NUMPY leaf (and a NUMPY_SCALAR's 0-d
    array), else a torch tensor."""
    dtype = _TORCH_OF[(dl[0], dl[1])]
    count = int(np.prod(shape, dtype=np.int64))
    if kind is not None and kind != 0:  # (TORCH is 0) a numpy leaf, array or scalar
        np_dtype = np.dtype(f"{_NUMPY_KIND[dl[0]]}{dl[1] // 8}")
        if kind == NUMPY or count:
            return np.frombuffer(block, np_dtype, count, offset).reshape(shape)
        return np.zeros(shape, np_dtype)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(block, dtype=dtype, count=count, offset=offset).view(shape)

