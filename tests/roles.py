"""Producer and consumer processes for the end-to-end tests.

Run as ``python tests/roles.py producer|consumer [options]`` (tests/conftest.py's
``procs.start()``). Each process prints JSON lines on stdout (tools.harness's
protocol: a producer's first says it is ready, the last one what it saw); the tests assert
on them.
Batch b of epoch e carries the value e * 1000 + b everywhere, so a consumer
can check the content of every batch it receives.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tensorsocket import (  # noqa: E402
    ConsumerDetached,
    ProducerFinished,
    ProducerGone,
    TensorConsumer,
    TensorProducer,
)
from tools.harness import emit  # noqa: E402  (the JSON-line protocol)


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
        epoch, self.epoch = self.epoch, self.epoch + 1  # counted even if cut short
        for b in range(self.batches):
            yield make_batch(self.kind, epoch * 1000 + b)


class SampleDataset(torch.utils.data.Dataset):
    """Sample i of epoch e: id e * 100000 + i, a feature row and a per-sample name."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        sid = self.epoch * 100000 + i
        return {"id": torch.tensor(sid), "x": torch.full((3,), float(sid)), "name": f"s{sid}"}


def collate_with_tag(samples: list) -> dict:
    """default_collate plus a per-batch plain value (passed through by re-batching)."""
    batch = torch.utils.data.default_collate(samples)
    batch["src"] = "loader"
    return batch


class DetectionDataset(SampleDataset):
    """Sample i: a (3, H_i, 5) image filled with its id and a target dict (variable sizes)."""

    def __getitem__(self, i: int):
        sid = self.epoch * 100000 + i
        return torch.full((3, 4 + i % 3, 5), float(sid)), {"id": sid,
                                                            "boxes": torch.zeros(i % 3, 4)}


def collate_tuples(samples: list) -> tuple:
    """The detection-style collate: a tuple of images and a tuple of targets."""
    return tuple(zip(*samples, strict=True))


class SampleLoader(torch.utils.data.DataLoader):
    """A real DataLoader whose dataset knows the epoch (for checkable sample ids)."""

    def __iter__(self):
        it = super().__iter__()
        yield from it
        self.dataset.epoch += 1


class Gate:
    """Hold the producer's loader before batch `index` of `epoch` until `consumers`
    consumers are attached (a deterministic join point for late-joiner tests)."""

    def __init__(self, spec: str | None, consumers: int) -> None:
        self.at = tuple(int(x) for x in spec.split(":")) if spec else None
        self.consumers = consumers
        self.producer = None

    def wrap(self, loader):
        gate = self

        class Gated:
            def __init__(self):
                self.epoch = 0
                self.batch_size = getattr(loader, "batch_size", None)

            def __len__(self):
                return len(loader)

            def __iter__(self):
                epoch, self.epoch = self.epoch, self.epoch + 1
                for i, batch in enumerate(loader):
                    if gate.at == (epoch, i):
                        gate.hold()
                    yield batch

        return Gated()

    def hold(self) -> None:
        emit({"gate": True})
        deadline = time.monotonic() + 60
        while self.producer.stats()["consumers"] < self.consumers:
            if time.monotonic() > deadline:
                raise TimeoutError("nobody came to the gate")
            time.sleep(0.01)


_WORKER_STATE = {"first_alloc_in_heap": None, "init_ran": False}  # per DataLoader worker


def mark_worker_init(worker_id: int) -> None:
    """The loader's own worker_init_fn: records that it ran in this worker."""
    del worker_id
    _WORKER_STATE["init_ran"] = True


class HeapProbeDataset(torch.utils.data.Dataset):
    """Sample i: (i, did this worker's first 20 MiB malloc come from the brk heap, did
    the loader's own worker_init_fn run here). Under glibc's defaults a worker's first
    block of that size is mmapped; with the producer's worker_heap_pad it is not."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if _WORKER_STATE["first_alloc_in_heap"] is None:
            import ctypes

            libc = ctypes.CDLL(None)
            libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
            libc.malloc.argtypes, libc.sbrk.argtypes = (ctypes.c_size_t,), (ctypes.c_ssize_t,)
            libc.free.argtypes = (ctypes.c_void_p,)
            block = libc.malloc(20 << 20)
            _WORKER_STATE["first_alloc_in_heap"] = block < libc.sbrk(0)  # mmap lies above
            libc.free(block)
        return torch.tensor([i, int(_WORKER_STATE["first_alloc_in_heap"]),
                             int(_WORKER_STATE["init_ran"])])


# DLPack (code, bits) -> torch dtype, for device views read back on the test double.
_DL_TORCH = {(0, 8): torch.int8, (0, 16): torch.int16, (0, 32): torch.int32,
             (0, 64): torch.int64, (1, 8): torch.uint8, (2, 16): torch.float16,
             (2, 32): torch.float32, (2, 64): torch.float64, (4, 16): torch.bfloat16,
             (6, 8): torch.bool}


class FakeGpu:
    """Stands in for torch.cuda in a consumer on the CUDA driver test double.

    A device view is exported with this consumer's stream (which must wait for the
    producer's copy), the stream is synchronized and the "device" bytes read back
    into a CPU tensor. With kernel_delay_us, a slow fake kernel that checksums the
    slot is queued on the stream as well, and the view is dropped at once: if the
    slot were handed back before that kernel ran, the producer's next copy would
    change the bytes under it and the checksum would not match.
    """

    def __init__(self, kernel_delay_us: int) -> None:
        from fakecuda import FakeCuda

        self.cuda = FakeCuda(os.environ["TENSORSOCKET_LIBCUDA"])
        self.cuda.setup(0)
        self.stream = self.cuda.stream_create(1)  # non-blocking, like torch's streams
        self.delay_us = kernel_delay_us
        self.reads: list = []  # (result cell, expected checksum)
        self.batch_exports = 0  # batches exported in one call (delivery._device_tensors)

    def tensor(self, view) -> torch.Tensor:
        """Stands in for delivery._device_tensor (one view, as torch.from_dlpack does)."""
        capsule = view.__dlpack__(stream=self.stream, max_version=(1, 0))
        self.cuda.stream_synchronize(self.stream)
        t = self._read(view)
        del capsule  # released once the fake kernel queued on the stream has run
        return t

    def tensors(self, slot, device) -> list:
        """Stands in for delivery._device_tensors (every leaf exported in one call)."""
        caps = slot.capsules(versioned=True, device=True, stream=self.stream)
        self.batch_exports += 1
        self.cuda.stream_synchronize(self.stream)
        out = [self._read(v) for v in slot.views(device=True)]
        del caps
        return out

    def _read(self, view) -> torch.Tensor:
        """The view's device bytes as a CPU tensor, and the slow checksum kernel."""
        from fakecuda import fnv1a

        data = self.cuda.read(view.data_ptr, view.nbytes)
        if self.delay_us:
            cell = self.cuda.launch_read(self.stream, view.data_ptr, view.nbytes, self.delay_us)
            self.reads.append((cell, fnv1a(data)))
        code, bits, _ = view.dtype
        t = torch.frombuffer(bytearray(data), dtype=_DL_TORCH[(code, bits)]) if data else \
            torch.empty(0, dtype=_DL_TORCH[(code, bits)])
        return t.reshape(view.shape)

    def check(self) -> dict:
        """Wait for the queued kernels; count the reads that saw other bytes."""
        self.cuda.stream_synchronize(self.stream)
        bad = sum(1 for cell, want in self.reads if cell.value != want)
        return {"kernel_reads": len(self.reads), "kernel_mismatches": bad,
                "batch_exports": self.batch_exports}


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
    if a.kind == "samples":
        loader = SampleLoader(SampleDataset(a.samples), batch_size=a.loader_bs, shuffle=False,
                              drop_last=a.loader_drop_last, collate_fn=collate_with_tag)
    elif a.kind == "heap-probe":
        loader = torch.utils.data.DataLoader(HeapProbeDataset(a.samples), batch_size=a.loader_bs,
                                             num_workers=2, worker_init_fn=mark_worker_init)
    elif a.kind == "detection":
        loader = SampleLoader(DetectionDataset(a.samples), batch_size=a.loader_bs,
                              shuffle=False, collate_fn=collate_tuples)
    else:
        loader = CountingLoader(a.batches, a.kind)
    gate = Gate(a.gate, a.gate_consumers)
    if gate.at is not None:
        loader = gate.wrap(loader)
    kw = dict(min_consumers=a.min_consumers, ring_slots=a.slots, max_lag=a.max_lag,
              lag_policy=a.lag_policy, device=a.device, device_fallback=not a.no_fallback)
    if a.window is not None:
        kw["rubber_band"] = a.window
    if a.worker_heap_pad is not None:
        kw["worker_heap_pad"] = a.worker_heap_pad
    if a.port is not None:
        p = TensorProducer(loader, str(a.port), str(a.port + 1), rubber_band_pct=0.02, **kw)
    else:
        p = TensorProducer(loader, name=a.name, start_timeout=a.start_timeout, **kw)
    gate.producer = p
    emit({"ready": True, "pid": os.getpid()})
    caught = warnings.catch_warnings(record=True)
    seen_warnings = caught.__enter__()
    warnings.simplefilter("always")
    cpu0 = time.process_time()
    cut = tuple(int(x) for x in a.cut.split(":")) if a.cut else None
    for e in range(a.epochs):
        for i, _ in enumerate(p):
            if a.delay:
                time.sleep(a.delay)
            if cut == (e, i + 1):
                break  # the producer's epoch e ends after i + 1 batches
    stats = p.stats()
    drained = p.join(timeout=60)
    caught.__exit__(None, None, None)
    return {"stats": stats, "drained": drained, "cpu": time.process_time() - cpu0,
            "warnings": [f"{w.category.__name__}: {w.message}" for w in seen_warnings],
            "loader_worker_init_fn": getattr(getattr(loader, "worker_init_fn", None),
                                             "__name__", None)}


def _batch_value(kind: str, batch, e: int, seen: list) -> int:
    """The value batch encodes (see make_batch)."""
    if kind == "big":
        return e * 1000 + len(seen)
    first = batch[0] if kind == "tuple" else batch["x"]
    return int(first.view(-1)[0].item())


def consumer(a: argparse.Namespace) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _consume(a)
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    return out


def _open(a: argparse.Namespace) -> TensorConsumer:
    kw = dict(batch_size=a.batch_size, drop_last=a.drop_last, device=a.device,
              pin_memory=a.pin_memory, align_epochs=not a.no_align)
    if a.port is None:
        return TensorConsumer(name=a.name, timeout=a.timeout, **kw)
    return TensorConsumer(str(a.port), str(a.port + 1), **kw)


def _consume(a: argparse.Namespace) -> dict:
    fake_gpu = None
    if a.current_device is not None:
        # What torch.cuda.set_device(N) would make torch.cuda.current_device() say, in a
        # CPU-only torch (the CUDA calls themselves go to the driver double).
        torch.cuda.is_available = lambda: True
        torch.cuda.current_device = lambda: a.current_device
    if a.gpu_double:
        import tensorsocket.data.delivery

        fake_gpu = FakeGpu(a.kernel_delay_us)
        tensorsocket.data.delivery._device_tensor = fake_gpu.tensor
        tensorsocket.data.delivery._device_tensors = fake_gpu.tensors
        tensorsocket.data.delivery.current_stream = lambda device: fake_gpu.stream
    c = _open(a)
    info = c.ring.info()
    lo, hi = info["data_address"], info["data_address"] + info["data_bytes"]
    epochs, sizes, inside, errors = [], [], True, []
    outcome = "done"
    n = 0
    pause = None
    ended_at = None
    try:
        for e in range(a.epochs):
            seen: list = []
            epoch_sizes: list = []
            for item in c:
                idx, batch = item if c.with_index else (None, item)
                n += 1
                if a.kind == "detection":
                    images, targets = batch
                    ids = [t["id"] for t in targets]
                    if [int(img[0, 0, 0]) for img in images] != ids or \
                            [tuple(t["boxes"].shape) for t in targets] != \
                            [(i % 100000 % 3, 4) for i in ids]:
                        errors.append(f"epoch {e}: images/targets do not match ids {ids}")
                    seen.extend(ids)
                    epoch_sizes.append(len(ids))
                    first = images[0]
                elif a.kind == "samples":
                    ids = batch["id"].tolist()
                    if batch["name"] != [f"s{i}" for i in ids] or batch["src"] != "loader":
                        errors.append(f"epoch {e}: names {batch['name'][:3]} for ids {ids[:3]}")
                    if not torch.equal(batch["x"][:, 0], batch["id"].float()):
                        errors.append(f"epoch {e}: features do not match ids {ids[:3]}")
                    seen.extend(ids)
                    epoch_sizes.append(len(ids))
                    first = batch["id"]
                else:
                    v = _batch_value(a.kind, batch, e, seen)
                    try:
                        check_batch(a.kind, batch, v)
                    except AssertionError as err:
                        errors.append(f"epoch {e} batch {len(seen)}: {err!r}"[:300])
                    first = batch[0] if a.kind == "tuple" else batch if a.kind == "big" \
                        else batch["x"]
                    seen.append(v)
                inside &= fake_gpu is not None or lo <= first.data_ptr() < hi
                if idx is not None and idx != len(epoch_sizes or seen) - 1:
                    errors.append(f"index {idx} at batch {len(seen)}")
                if a.stall_after is not None and len(seen) == a.stall_after:
                    emit({"stalled": True})
                    held = [batch]  # noqa: F841  (keep the batch's slot while we hang)
                    time.sleep(3600)
                if a.hold:  # train on the batch: hold it while "computing"
                    time.sleep(a.delay)
                del batch, item, first
                if a.hold:
                    pass
                elif a.delay_first is None or n <= a.delay_first:
                    time.sleep(a.delay)
                else:
                    time.sleep(a.delay_rest)
                if a.leave_after is not None and n == a.leave_after:
                    break
                if a.break_after is not None and n == a.break_after:
                    left_at = c.ring.info()["published"]
                    break
            if a.break_after is not None and n == a.break_after:
                time.sleep(a.pause)  # "evaluating": the others must not wait for us
                pause = {"left_at": left_at, "published_after": c.ring.info()["published"],
                         "slots": c.ring.info()["slot_count"]}
            epochs.append(seen)
            sizes.append(epoch_sizes)
            if a.leave_after is not None and n == a.leave_after:
                outcome = "left"
                break
    except (ConsumerDetached, ProducerFinished, ProducerGone) as err:
        outcome = f"{type(err).__name__}: {err}"
        ended_at = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes
    out = {"epochs": epochs, "sizes": sizes, "zero_copy": inside, "errors": errors,
           "outcome": outcome, "stats": c.stats(), "pause": pause, "ended_at": ended_at}
    try:
        out["len"] = len(c)
    except TypeError as err:
        out["len"] = str(err)
    out["ring_info"] = {k: info[k] for k in ("device_type", "device_uuid", "slot_count")}
    time.sleep(a.linger)  # still attached after the last batch (the producer waits for us)
    c.close()
    if fake_gpu is not None:
        out.update(fake_gpu.check())
    if a.rejoin_epochs:
        c2 = _open(a)
        again = []
        for _ in range(a.rejoin_epochs):
            again.append([_batch_value(a.kind, b, 0, []) for b in c2])
        out["rejoined"] = again
        c2.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["producer", "consumer"])
    ap.add_argument("--name", default="default")
    ap.add_argument("--port", type=int)
    ap.add_argument("--kind", default="mixed")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--slots", type=int)
    ap.add_argument("--min-consumers", type=int, default=1)
    ap.add_argument("--start-timeout", type=float, default=60)
    ap.add_argument("--timeout", type=float, default=30)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--stall-after", type=int)
    ap.add_argument("--delay-first", type=int, help="sleep --delay only after the first N")
    ap.add_argument("--delay-rest", type=float, default=0.0, help="... and this after them")
    ap.add_argument("--hold", action="store_true", help="sleep --delay holding the batch")
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--loader-bs", type=int, default=8)
    ap.add_argument("--loader-drop-last", action="store_true")
    ap.add_argument("--window", type=int)
    ap.add_argument("--worker-heap-pad", type=int, help="producer: worker_heap_pad=")
    ap.add_argument("--max-lag", type=int)
    ap.add_argument("--lag-policy", default="raise")
    ap.add_argument("--gate", help="EPOCH:INDEX where the producer waits for consumers")
    ap.add_argument("--gate-consumers", type=int, default=2)
    ap.add_argument("--cut", help="EPOCH:N: the producer breaks out of epoch EPOCH after N")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--no-align", action="store_true",
                    help="consumer: align_epochs=False (a late joiner's epochs span two)")
    ap.add_argument("--drop-last", action="store_true")
    ap.add_argument("--leave-after", type=int, help="close after N batches")
    ap.add_argument("--break-after", type=int, help="break out of the loop after N batches")
    ap.add_argument("--pause", type=float, default=0.0, help="... and sleep this long")
    ap.add_argument("--device", help="producer: device= of the ring; consumer: device=")
    ap.add_argument("--no-fallback", action="store_true", help="producer: device_fallback=False")
    ap.add_argument("--pin-memory", action="store_true", help="consumer: pin_memory=True")
    ap.add_argument("--current-device", type=int,
                    help="consumer: torch.cuda.current_device() says this (set_device)")
    ap.add_argument("--gpu-double", action="store_true",
                    help="consumer: read device views through the CUDA test double")
    ap.add_argument("--kernel-delay-us", type=int, default=0,
                    help="with --gpu-double: queue a slow checksum kernel per tensor")
    ap.add_argument("--linger", type=float, default=0.0,
                    help="consumer: stay open this long after the last batch")
    ap.add_argument("--rejoin-epochs", type=int, default=0,
                    help="after leaving, attach again in this process for N epochs")
    a = ap.parse_args()
    result = producer(a) if a.role == "producer" else consumer(a)
    emit(result)


if __name__ == "__main__":
    main()
