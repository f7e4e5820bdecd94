"""collocated.py's child processes (the hidden roles ``_trainer``, ``_producer``,
``_consumer``, ``_orig_producer`` and ``_orig_consumer``): each trains on, or serves, one
epoch and reports one JSON line. The original's roles run with its venv's python.

No role imports tensorsocket unless it uses it (see bench_common's docstring); this module
imports only the standard library and bench_common at the top.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench_common import HERE, report, start_watchdog, unwind_on_sigterm, vm_kb

WORKERS = 1
WARMUP = 5
SEED = 0

# Timeouts (seconds). Every wait has one.
ATTACH_TIMEOUT = 60.0  # consumer -> producer handshake; producer 'ready'
START_TIMEOUT = 120.0  # producer waits this long for its consumers
BATCH_TIMEOUT = 120.0  # a consumer waits this long for one batch
PUBLISH_TIMEOUT = 120.0  # the producer waits this long for a free slot
JOIN_TIMEOUT = 60.0  # the producer waits this long for the consumers to drain


def _workload():
    sys.path.insert(0, str(HERE))
    import workload

    return workload


def _set_threads() -> None:
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass




def _split(item):
    """(x, y, ids) from a loader item, with or without a leading batch index."""
    if isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], int):
        item = item[1]
    return item[0], item[1], item[2]


class _Epoch:
    """What one training process saw of its epoch: timings, losses, the sample ids and
    labels received, and the checksum of the images (in delivery order: equal across
    modes for equal data)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.ids_seen: list[int] = []
        self.label_errors = 0
        self.n = 0
        self.samples = 0
        self.first_loss = self.last_loss = None
        self.checksum = 0.0
        self.done_times: list[float] = []
        self.done_samples: list[int] = []
        self.wait_s = self.train_s = 0.0
        self.t_start: float | None = None

    def add(self, ids: list[int], labels: list[int], loss: float, t0: float, t1: float,
            t2: float) -> None:
        """One batch: asked for at t0, received at t1, trained on by t2."""
        self.ids_seen.extend(ids)
        self.label_errors += sum(1 for i, lab in zip(ids, labels, strict=True)
                                 if lab != i % 10)
        if self.n >= self.warmup:
            self.wait_s += t1 - t0
            self.train_s += t2 - t1
            self.done_times.append(t2)
            self.done_samples.append(len(ids))
        if self.n == 0:
            self.first_loss = loss
        self.last_loss = loss
        self.n += 1
        self.samples += len(ids)

    def check(self, expected: int) -> dict:
        """Every sample id of the epoch exactly once, with the right label."""
        import numpy as np

        arr = np.asarray(self.ids_seen, dtype=np.int64)
        valid = arr[(arr >= 0) & (arr < expected)]
        counts = np.bincount(valid, minlength=expected)
        missing = int((counts == 0).sum())
        duplicates = int((counts > 1).sum() + (len(arr) - len(valid)))
        return {
            "ok": missing == 0 and duplicates == 0 and self.label_errors == 0
            and len(arr) == expected,
            "expected": expected,
            "received": int(len(arr)),
            "missing": missing,
            "duplicates": duplicates,
            "label_errors": int(self.label_errors),
        }

    def result(self, expected: int) -> dict:
        t_end = self.done_times[-1] if self.done_times else None
        measured = int(sum(self.done_samples))
        seconds = (t_end - self.t_start) if (t_end is not None and self.t_start is not None) \
            else 0.0
        return {
            "batches": self.n,
            "samples": self.samples,
            "measured_samples": measured,
            "t_start": self.t_start,
            "t_end": t_end,
            "seconds": seconds,
            "samples_per_s": measured / seconds if seconds > 0 else 0.0,
            "done_times": self.done_times,
            "done_samples": self.done_samples,
            "wait_s": self.wait_s,
            "train_s": self.train_s,
            "loss_first": self.first_loss,
            "loss_last": self.last_loss,
            "data_checksum": self.checksum,
            "check": self.check(expected),
        }


def consume(batches, trainer, warmup: int, expected: int) -> dict:
    """Train on every batch of one epoch of `batches`; timings and the sample check."""
    epoch = _Epoch(warmup)
    it = iter(batches)
    while True:
        t0 = time.monotonic()
        if epoch.n == warmup:
            epoch.t_start = t0
        try:
            item = next(it)
        except StopIteration:
            break
        t1 = time.monotonic()
        x, y, ids = _split(item)
        loss = trainer.step(x, y)
        epoch.checksum += float(x.double().sum())
        ids_l = ids.tolist()
        ys = y.tolist()
        del item, x, y, ids  # release the batch (a ring slot) before asking for the next
        epoch.add(ids_l, ys, loss, t0, t1, time.monotonic())
    return epoch.result(expected)


def _own_usage() -> dict:
    """This process's peak RSS and CPU seconds, for its report."""
    return {"vmhwm_kb": vm_kb().get("VmHWM", 0), "cpu_s": sum(os.times()[:4])}


def _finish_consumer(res: dict, role: str) -> None:
    res.update({"role": role, "pid": os.getpid(), **_own_usage()})
    report(res)


def _loader(args: argparse.Namespace):
    """The DataLoader over the JPEG dataset, as every mode builds it."""
    wl = _workload()
    ds = wl.JpegDataset(args.images, length=args.samples, seed=args.seed)
    return wl.make_loader(ds, args.batch, args.workers, seed=args.seed,
                          worker_top_pad=args.worker_top_pad)


def run_trainer(args: argparse.Namespace) -> int:
    """independent: own DataLoader."""
    _set_threads()
    loader = _loader(args)
    trainer = _workload().Trainer(seed=args.index)
    res = consume(loader, trainer, args.warmup, args.samples)
    del loader  # shuts the workers down (and reaps them) before we report
    _finish_consumer(res, "trainer")
    return 0


def run_producer(args: argparse.Namespace) -> int:
    """shared: TensorProducer over the DataLoader."""
    _set_threads()
    _workload()  # first, then tensorsocket, then the loader: the order decides the heap
    from tensorsocket import TensorProducer  # the loader's workers are forked with

    loader = _loader(args)

    heap = {} if args.producer_heap_pad is None else {"worker_heap_pad": args.producer_heap_pad}
    producer = TensorProducer(loader, name=args.name, min_consumers=args.consumers,
                              start_timeout=START_TIMEOUT, publish_timeout=PUBLISH_TIMEOUT,
                              **heap)
    try:
        report({"role": "producer", "ready": True})
        n = 0
        for _ in producer:
            n += 1
        stats = producer.stats()
        drained = producer.join(timeout=JOIN_TIMEOUT)
    finally:
        producer.close()
    report({
        "role": "producer", "pid": os.getpid(), "batches": n,
        "slots": stats["slots"], "slot_bytes": stats["slot_bytes"],
        "ring_bytes": stats["slots"] * stats["slot_bytes"],
        "bytes_copied": stats["bytes_copied"], "wait_seconds": stats["wait_seconds"],
        "consumer_wait_seconds": stats["consumer_wait_seconds"], "drained": drained,
        "worker_heap_pad": producer.worker_heap_pad, **_own_usage(),
    })
    return 0


def run_consumer(args: argparse.Namespace) -> int:
    """shared: TensorConsumer."""
    _set_threads()
    wl = _workload()
    from tensorsocket import TensorConsumer

    trainer = wl.Trainer(seed=args.index)
    consumer = TensorConsumer(name=args.name, timeout=ATTACH_TIMEOUT,
                              batch_timeout=BATCH_TIMEOUT)
    try:
        res = consume(consumer, trainer, args.warmup, args.samples)
    finally:
        consumer.close()
    _finish_consumer(res, "consumer")
    return 0


def _check_original():
    import tensorsocket

    if getattr(tensorsocket, "__version__", None) != "0.0.5":
        raise RuntimeError(f"expected the original tensorsocket 0.0.5, imported "
                           f"{tensorsocket.__file__} ({getattr(tensorsocket, '__version__', '?')})")
    return tensorsocket


def _hearts(producer) -> int:
    """Consumers whose heartbeats the original producer has registered."""
    for _ in range(100):
        try:  # its heartbeat thread changes the set while we look
            return len(producer.hb.consumers)
        except RuntimeError:
            time.sleep(0.001)
    return len(producer.hb.consumers)


def run_orig_producer(args: argparse.Namespace) -> int:
    """original: TensorSocket 0.0.5's TensorProducer (run with the venv's python)."""
    _set_threads()
    _workload()  # before the original, as the loader of every mode (see run_producer)
    ts = _check_original()
    ports = [int(p) for p in args.ports.split(",")]
    loader = _loader(args)
    producer = ts.TensorProducer(loader, ports[0], ports[1], (ports[2], ports[3]))
    report({"role": "producer", "ready": True})
    # No min_consumers: wait until all N heartbeats are registered, so that every
    # consumer gets the whole epoch (a late one would be skipped until the next epoch).
    deadline = time.monotonic() + START_TIMEOUT
    while _hearts(producer) < args.consumers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {_hearts(producer)} of {args.consumers} "
                               f"consumers registered within {START_TIMEOUT} s")
        time.sleep(0.05)
    calls = 0
    for _ in producer:  # one epoch (yields None while it fills its buffer)
        calls += 1
    # Keep serving until the consumers are gone (their heartbeats stop when they exit).
    deadline = time.monotonic() + JOIN_TIMEOUT
    while _hearts(producer) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _hearts(producer)
    producer.join()
    it = getattr(producer, "data_loader_iter", None)  # the next epoch's, already started
    producer.data_loader_iter = None
    if hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    report({"role": "producer", "pid": os.getpid(), "next_calls": calls,
            "epochs": producer.epoch, "loader_batches": len(loader), "ports": ports,
            "consumers_left_at_exit": left, "tensorsocket": ts.__file__, **_own_usage()})
    sys.stdout.flush()
    os._exit(0)  # daemon threads and un-terminated zmq contexts: do not wait for them


def run_orig_consumer(args: argparse.Namespace) -> int:
    """original: TensorSocket 0.0.5's TensorConsumer (run with the venv's python)."""
    _set_threads()
    wl = _workload()
    ts = _check_original()
    ports = [int(p) for p in args.ports.split(",")]
    trainer = wl.Trainer(seed=args.index)
    consumer = ts.TensorConsumer(ports[0], ports[1], (ports[2], ports[3]),
                                 batch_size=args.batch)
    res = consume(consumer, trainer, args.warmup, args.samples)
    _finish_consumer(res, "consumer")
    sys.stdout.flush()
    os._exit(0)  # its fetch and heartbeat threads are daemons; zmq contexts never closed


ROLES = {
    "_trainer": run_trainer,
    "_producer": run_producer,
    "_consumer": run_consumer,
    "_orig_producer": run_orig_producer,
    "_orig_consumer": run_orig_consumer,
}


def child_main(argv: list[str]) -> int:
    """collocated.py started as one of ROLES (argv[0]): its options, a watchdog, then the
    role."""
    role = argv[0]
    parser = argparse.ArgumentParser(prog=f"collocated.py {role}")
    parser.add_argument("--name", default="")
    parser.add_argument("--ports", default="")
    parser.add_argument("--images", required=True)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--consumers", type=int, default=1)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--worker-top-pad", type=int, default=0)
    parser.add_argument("--producer-heap-pad", type=int, default=None)
    args = parser.parse_args(argv[1:])
    start_watchdog(args.timeout, f"collocated.py {role}")
    unwind_on_sigterm()
    return ROLES[role](args)
