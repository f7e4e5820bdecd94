"""Batch flattening and rebuilding (in-process: pure functions)."""

from __future__ import annotations

import collections

import msgpack
import numpy as np
import pytest
import torch

from tensorsocket.data.structure import Decoder, Encoder, flatten

Point = collections.namedtuple("Point", ["x", "y"])


def roundtrip(batch):
    """Flatten, then rebuild from numpy views of the leaves (what a slot holds)."""
    meta, leaves = flatten(batch)
    build, kinds = Decoder().compile(meta)
    rebuilt = []
    for (buf, _dl), kind in zip(leaves, kinds, strict=True):
        arr = np.asarray(buf)
        rebuilt.append(arr if kind != 0 else torch.from_numpy(np.ascontiguousarray(arr)))
    return build(rebuilt), leaves, kinds


def test_nested_structure_is_preserved():
    batch = {
        "img": torch.zeros(2, 3),
        "pair": (np.arange(3), [1, "a", None, 2.5, True, b"raw"]),
        "pt": Point(torch.ones(1), 7),
        3: {"deep": [torch.arange(4)]},
    }
    out, leaves, kinds = roundtrip(batch)
    assert len(leaves) == 4
    assert set(out) == {"img", "pair", "pt", 3}
    assert isinstance(out["pair"], tuple) and isinstance(out["pair"][1], list)
    assert out["pair"][1] == [1, "a", None, 2.5, True, b"raw"]
    assert isinstance(out["pair"][0], np.ndarray)
    assert type(out["pt"]).__name__ == "Point" and out["pt"].y == 7
    assert out["pt"].x.tolist() == [1.0]
    assert out[3]["deep"][0].tolist() == [0, 1, 2, 3]


def test_numpy_scalar_comes_back_as_scalar():
    out, _, _ = roundtrip((np.float32(1.5), np.int64(3)))
    assert isinstance(out[0], np.float32) and out[0] == 1.5
    assert isinstance(out[1], np.int64) and out[1] == 3


@pytest.mark.parametrize(
    "dtype,code,bits",
    [
        (torch.bool, 6, 8),
        (torch.uint8, 1, 8),
        (torch.int8, 0, 8),
        (torch.int16, 0, 16),
        (torch.int32, 0, 32),
        (torch.int64, 0, 64),
        (torch.float16, 2, 16),
        (torch.bfloat16, 4, 16),
        (torch.float32, 2, 32),
        (torch.float64, 2, 64),
        (torch.complex64, 5, 64),
        (torch.complex128, 5, 128),
    ],
)
def test_torch_dtypes_map_to_dlpack(dtype, code, bits):
    _, leaves = flatten(torch.zeros(3, dtype=dtype))
    (buf, dl), = leaves
    assert dl == (code, bits, 1)
    assert memoryview(buf).itemsize * 8 == bits


def test_unsupported_leaf_names_its_path():
    with pytest.raises(TypeError, match=r"batch\[1\]\['meta'\] is a builtins.object"):
        flatten((torch.zeros(1), {"meta": object()}))


def test_unsupported_tensor_names_its_path():
    with pytest.raises(TypeError, match=r"batch\[0\]: .*layout"):
        flatten([torch.zeros(2, 2).to_sparse()])


def test_non_contiguous_and_special_tensors_flatten():
    t = torch.arange(12).reshape(3, 4).t()
    _, leaves = flatten((t, torch.tensor(5), torch.zeros(0, 3)))
    assert [memoryview(b).shape for b, _ in leaves] == [(4, 3), (), (0, 3)]


def test_huge_int_is_rejected():
    with pytest.raises(TypeError, match="64-bit"):
        flatten({"n": 2**70})


def test_spec_is_msgpack_not_pickle():
    meta, _ = flatten({"a": torch.zeros(1), "b": "x"})
    assert isinstance(msgpack.unpackb(meta, strict_map_key=False), list)
    assert b"\x80" not in meta[:1]  # not a pickle protocol header


def test_decoder_caches_the_last_spec():
    meta, _ = flatten((torch.zeros(1), 1))
    d = Decoder()
    assert d.compile(meta) is d.compile(bytes(meta))


def test_encoder_gives_flattens_bytes_and_reuses_only_what_equals_exactly():
    """The producer's Encoder keeps the last spec's bytes while the structure stays; a spec
    with plain values is encoded every time (True == 1 == 1.0, yet they are not the same
    batch), and so is one with dict keys other than str."""
    enc = Encoder()
    x, y = torch.zeros(2), torch.ones(3)
    first, _ = enc.flatten((x, y))
    again, leaves = enc.flatten((torch.zeros(5), torch.ones(1)))
    assert first == flatten((x, y))[0] and again is first
    assert [np.asarray(b).shape for b, _ in leaves] == [(5,), (1,)]
    for a, b in [({"k": 1}, {"k": True}), ({"k": 1.0}, {"k": 1}), ({1: x}, {True: x}),
                 ((x, 0), (x, False))]:
        for batch in (a, b, a):
            meta, _ = enc.flatten(batch)
            assert meta == flatten(batch)[0], batch
    assert roundtrip({True: x})[0].keys() == {True}


@pytest.mark.parametrize("batch", [
    (torch.zeros(2), torch.ones(3)),
    [torch.zeros(2)],
    {"a": torch.zeros(1), "b": np.arange(3)},
    (),
    {},
])
def test_flat_batches_rebuild_with_their_container(batch):
    """A tuple, list or dict holding only its leaves, in order, is rebuilt by the container
    itself (no call per leaf): same type, same keys, same values."""
    rebuilt, _, _ = roundtrip(batch)
    assert type(rebuilt) is type(batch)
    items = rebuilt.items() if isinstance(batch, dict) else enumerate(rebuilt)
    want = dict(batch.items() if isinstance(batch, dict) else enumerate(batch))
    assert {k for k, _ in items} == set(want)
    for k, v in (rebuilt.items() if isinstance(batch, dict) else enumerate(rebuilt)):
        assert type(v) is type(want[k]) and np.array_equal(np.asarray(v), np.asarray(want[k]))


@pytest.mark.parametrize("batch", [
    ({"a": torch.zeros(1)}, torch.ones(2)),
    ((torch.zeros(1),), torch.ones(2)),
    [[torch.zeros(1)], torch.ones(2)],
])
def test_a_flat_container_inside_a_batch_keeps_only_its_own_leaves(batch):
    """Only the whole batch may be rebuilt by its container: a flat tuple, list or dict
    nested in it takes its own leaves, not the batch's."""
    rebuilt, _, _ = roundtrip(batch)
    assert type(rebuilt) is type(batch) and type(rebuilt[0]) is type(batch[0])
    assert len(rebuilt[0]) == 1 and torch.equal(rebuilt[1], batch[1])


def test_flat_tuples_go_as_capsules_only_where_their_memory_is_their_values():
    """Encoder.flatten(capsules=True) gives a flat tuple's tensors as DLPack capsules (the
    ring reads them); a lazy negative or conjugate view, whose memory is not its values,
    and a tensor numpy cannot hold as it is (bfloat16) go the walk's way, as arrays."""
    enc = Encoder()
    x = torch.arange(4.0)
    enc.flatten((x, x))  # (the first batch of a structure is walked)
    _, leaves = enc.flatten((x, x.t()), capsules=True)
    assert [type(b).__name__ for b, _ in leaves] == ["PyCapsule", "PyCapsule"]
    neg = torch.complex(torch.zeros(4), -x).conj().imag
    conj = torch.complex(x, x).conj()
    for odd in (neg, conj, x.to(torch.bfloat16)):
        _, leaves = enc.flatten((x, odd), capsules=True)
        assert not any(type(b).__name__ == "PyCapsule" for b, _ in leaves), odd
        back = torch.from_numpy(np.asarray(leaves[1][0]).copy())
        if odd.dtype == torch.bfloat16:
            back = back.view(torch.bfloat16)
        assert torch.equal(back, odd.resolve_conj().resolve_neg())
    _, leaves = enc.flatten((x, x))
    assert all(isinstance(b, np.ndarray) for b, _ in leaves)
