"""Producer and consumer processes for the end-to-end tests.

Run as ``python tests/roles.py producer|consumer [options]``. Each process
prints one JSON line with what it saw on stdout; the tests assert on it.
Batch b of epoch e carries the value e * 1000 + b everywhere, so a consumer
can check the content of every batch it receives.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tensorsocket import TensorConsumer, TensorProducer  # noqa: E402


class CountingLoader:
    """A loader of `batches` deterministic batches per epoch, with len()."""

    batch_size = 4

    def __init__(self, batches: int, kind: str) -> None:
        self.batches = batches
        self.kind = kind
        self.epoch = 0

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        for b in range(self.batches):
            yield make_batch(self.kind, self.epoch * 1000 + b)
        self.epoch += 1


def make_batch(kind: str, v: int):
    """The batch whose every tensor encodes v."""
    x = torch.full((4, 8), float(v))
    if kind == "tuple":
        return x, torch.full((4,), v, dtype=torch.int64)
    if kind == "big":
        return torch.full((256, 1024), v % 251, dtype=torch.uint8)
    return {
        "x": x,
        "pair": (np.full(5, v, dtype=np.int32), [v, f"s{v}"]),
        "meta": {"flag": v % 2 == 0, "none": None, "half": torch.full((2, 2), v % 7).half()},
        "label": v,
    }


def check_batch(kind: str, batch, v: int) -> None:
    """Assert batch equals make_batch(kind, v)."""
    if kind == "tuple":
        x, y = batch
        assert torch.equal(x, torch.full((4, 8), float(v))), (v, x)
        assert torch.equal(y, torch.full((4,), v, dtype=torch.int64)), (v, y)
        return
    if kind == "big":
        assert torch.equal(batch, torch.full((256, 1024), v % 251, dtype=torch.uint8))
        return
    assert torch.equal(batch["x"], torch.full((4, 8), float(v))), (v, batch["x"])
    arr, lst = batch["pair"]
    assert isinstance(batch["pair"], tuple) and isinstance(lst, list)
    assert isinstance(arr, np.ndarray) and arr.dtype == np.int32 and (arr == v).all()
    assert lst == [v, f"s{v}"], lst
    meta = batch["meta"]
    assert meta["flag"] is (v % 2 == 0) and meta["none"] is None
    assert meta["half"].dtype == torch.float16 and torch.equal(meta["half"],
                                                               torch.full((2, 2), v % 7).half())
    assert batch["label"] == v


def producer(a: argparse.Namespace) -> dict:
    loader = CountingLoader(a.batches, a.kind)
    kw = {} if a.port is None else {}
    if a.port is not None:
        p = TensorProducer(loader, str(a.port), str(a.port + 1), rubber_band_pct=0.02,
                           min_consumers=a.min_consumers, ring_slots=a.slots, **kw)
    else:
        p = TensorProducer(loader, name=a.name, min_consumers=a.min_consumers,
                           ring_slots=a.slots, start_timeout=a.start_timeout)
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    cpu0 = time.process_time()
    for _ in range(a.epochs):
        for _ in p:
            if a.delay:
                time.sleep(a.delay)
    stats = p.stats()
    drained = p.join(timeout=60)
    return {"stats": stats, "drained": drained, "cpu": time.process_time() - cpu0}


def consumer(a: argparse.Namespace) -> dict:
    c = TensorConsumer(name=a.name, timeout=a.timeout) if a.port is None else \
        TensorConsumer(str(a.port), str(a.port + 1))
    info = c.ring.info()
    lo, hi = info["data_address"], info["data_address"] + info["data_bytes"]
    epochs, inside, errors = [], True, []
    for e in range(a.epochs):
        seen = []
        for item in c:
            idx, batch = item if c.with_index else (None, item)
            first = batch[0] if a.kind == "tuple" else batch if a.kind == "big" else batch["x"]
            v = int(first.view(-1)[0].item()) if a.kind != "big" else None
            if a.kind == "big":
                v = e * 1000 + len(seen)
            try:
                check_batch(a.kind, batch, v)
            except AssertionError as err:
                errors.append(f"epoch {e} batch {len(seen)}: {err!r}"[:300])
            inside &= lo <= first.data_ptr() < hi
            if idx is not None and idx != len(seen):
                errors.append(f"index {idx} != {len(seen)}")
            seen.append(v)
            if a.stall_after is not None and len(seen) == a.stall_after:
                print(json.dumps({"stalled": True}), flush=True)
                held = [batch]  # noqa: F841  (keep the batch's slot while we hang)
                time.sleep(3600)
            if a.delay:
                time.sleep(a.delay)
        epochs.append(seen)
    out = {"epochs": epochs, "zero_copy": inside, "errors": errors, "len": len(c)}
    c.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["producer", "consumer"])
    ap.add_argument("--name", default="default")
    ap.add_argument("--port", type=int)
    ap.add_argument("--kind", default="mixed")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--min-consumers", type=int, default=1)
    ap.add_argument("--start-timeout", type=float, default=60)
    ap.add_argument("--timeout", type=float, default=30)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--stall-after", type=int)
    a = ap.parse_args()
    result = producer(a) if a.role == "producer" else consumer(a)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
