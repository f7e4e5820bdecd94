"""Odd but valid input goes through the ring intact: every dtype, 0-d and empty tensors,
non-contiguous tensors, shapes and structures that change from batch to batch."""

from __future__ import annotations

import threading

import numpy as np
import torch

from tensorsocket import TensorConsumer, TensorProducer

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128] + [d for d in (getattr(torch, "uint16", None),
                                          getattr(torch, "uint32", None),
                                          getattr(torch, "uint64", None)) if d is not None]


def _tensor(dtype: torch.dtype, i: int) -> torch.Tensor:
    base = torch.arange(12, dtype=torch.int64).reshape(3, 4) + i
    if dtype == torch.bool:
        return base % 2 == 0
    if dtype.is_complex:
        return torch.complex(base.double(), -base.double()).to(dtype)
    return base.to(dtype)


def _batches() -> list:
    out = []
    for i in range(6):
        x = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5) + i
        out.append({
            "dtypes": {str(d): _tensor(d, i) for d in DTYPES},
            "scalar": torch.tensor(i * 1.5),
            "empty": torch.zeros(0, 3),
            "transposed": x.transpose(0, 2),  # non-contiguous: copied contiguous, once
            "strided": x[:, ::2, 1:],
            "varying": torch.ones(i + 1, 2),  # a new shape in every batch
            "np_fortran": np.asfortranarray(np.arange(6 * (i + 1)).reshape(i + 1, 6)),
        })
    # The structure changes mid-epoch: every slot carries its own.
    out[3] = (torch.full((2,), 3.0), ["a", {"k": np.int16(7)}])
    return out


def test_odd_inputs_round_trip(name):
    batches = _batches()
    producer = TensorProducer(batches, name=name, start_timeout=30)
    thread = threading.Thread(target=lambda: [None for _ in producer], daemon=True)
    thread.start()
    try:
        # copy=True: the test keeps every batch, which must not pin the ring's slots.
        with TensorConsumer(name=name, timeout=10, batch_timeout=20, copy=True) as c:
            got = list(c)
        thread.join(10)
    finally:
        producer.close()
    assert len(got) == len(batches)
    for want, have in zip(batches, got, strict=True):
        if isinstance(want, tuple):
            assert torch.equal(have[0], want[0]) and have[1][0] == "a"
            assert have[1][1]["k"] == 7 and have[1][1]["k"].dtype == np.int16
            continue
        for key, t in want["dtypes"].items():
            assert have["dtypes"][key].dtype == t.dtype, key
            assert torch.equal(have["dtypes"][key], t), key
        assert have["scalar"].shape == () and float(have["scalar"]) == float(want["scalar"])
        assert have["empty"].shape == (0, 3)
        for key in ("transposed", "strided", "varying"):
            assert torch.equal(have[key], want[key]), key
            assert have[key].is_contiguous()
        assert np.array_equal(have["np_fortran"], want["np_fortran"])
