"""The child processes of examples/demo.py: one training job with its own DataLoader (the
baseline), the shared producer, and a training job fed by it (a consumer).

Every role is this file's ``main()`` run by demo.py as ``demo.py --role ROLE ...``. A role
reports to the parent with one JSON object per stdout line after ``MARK`` (``emit``):
``ready`` once set up, then per epoch, then ``result``. Jobs and the producer then wait
for a ``go`` line on stdin, which the parent sends to all of a run's children at once, when
every one is ready: in both runs the loading starts at that moment, with every process set
up (its imports done). A consumer cannot finish attaching before the producer has made its
ring, at its first batch: it says ``ready`` before it attaches, and attaches, with the
handshake, in the shared run's measured time. The workload is the collocated
benchmark's (benchmarks/workload.py): JPEGs decoded and augmented per sample on the CPU,
a small ResNet trained with SGD, one thread per process.

Each job checks, per epoch, that it trained on every sample id of the dataset exactly
once, and reports what it found; the parent turns a failed check into an error.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent / "benchmarks"))  # workload.py: the benchmark's workload
sys.path.append(str(HERE.parent))  # tools/: this checkout's, not installed

import workload  # noqa: E402
from bench_common import children_cpu_seconds  # noqa: E402  (its loader workers)

from tools import harness  # noqa: E402

MARK = "@tensorsocket-demo "
SEED = 0
LEARNING_RATES = (0.02, 0.05, 0.1, 0.01)  # job k (from 1) uses LEARNING_RATES[(k - 1) % 4]
HEAP_PAD = 16 << 20  # the producer's default worker_heap_pad, given to the baseline too


def emit(event: str, **fields: Any) -> None:
    """Send one event to the parent: a marked JSON line on stdout."""
    harness.emit({"event": event, **fields}, marker=MARK)


def learning_rate(rank: int) -> float:
    """Job `rank`'s learning rate (a small sweep)."""
    return LEARNING_RATES[(rank - 1) % len(LEARNING_RATES)]


def own_cpu_seconds() -> float:
    """CPU seconds of this process."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children."""
    return own_cpu_seconds() + children_cpu_seconds()


def make_loader(images: str, batch: int, workers: int, heap_pad: int):
    """The DataLoader every mode runs: shuffled, seeded, `workers` worker processes."""
    dataset = workload.JpegDataset(images, seed=SEED)
    return workload.make_loader(dataset, batch, workers, seed=SEED, worker_top_pad=heap_pad,
                                strict_pad=False)  # as the producer: unpadded where it cannot


class EpochCheck:
    """The sample ids one job trained on in one epoch, against the dataset's."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.counts = torch.zeros(size, dtype=torch.int64)
        self.order: list[int] = []

    def add(self, ids: torch.Tensor) -> None:
        self.counts += torch.bincount(ids, minlength=self.size)[:self.size]

        self.order.extend(ids.tolist())

    def verdict(self) -> dict:
        """missing / repeated sample ids (0 and 0: every sample exactly once), and the ids
        in the order trained on."""
        return {"missing": int((self.counts == 0).sum()),
                "repeated": int((self.counts > 1).sum()), "ids": self.order}


def make_trainer(rank: int) -> workload.Trainer:
    """Job `rank`'s model and optimiser. Made before the job says it is ready: the first
    optimiser of a process takes seconds (torch's lazy imports), set-up, not training."""
    return workload.Trainer(seed=SEED + rank, lr=learning_rate(rank))


def train(batches_of_epoch, trainer: workload.Trainer, rank: int, epochs: int,
          size: int) -> dict:
    """Train `trainer` on `epochs` epochs of (images, labels, ids) batches, checking the
    ids of each epoch; `batches_of_epoch()` gives one epoch's batches."""
    samples, batches, loss, checks = 0, 0, float("nan"), []
    own0, kids0 = own_cpu_seconds(), children_cpu_seconds()
    first = time.monotonic()  # the first batch is asked for now (all jobs start together)
    for epoch in range(epochs):
        check, total, count = EpochCheck(size), 0.0, 0
        for images, labels, ids in batches_of_epoch():
            loss = trainer.step(images, labels)
            check.add(ids)
            total += loss * len(labels)
            count += len(labels)
            batches += 1
        samples += count
        checks.append(check.verdict())
        emit("epoch", epoch=epoch + 1, mean_loss=total / count if count else float("nan"),
             missing=checks[-1]["missing"], repeated=checks[-1]["repeated"])
    own, kids = own_cpu_seconds() - own0, children_cpu_seconds() - kids0
    return {"rank": rank, "lr": learning_rate(rank), "samples": samples, "batches": batches,
            "final_loss": loss, "first": first, "last": time.monotonic(),
            "train_cpu_s": own + kids,  # while it trained: this process and its workers
            "trainer_cpu_s": own, "workers_cpu_s": kids, "epochs": checks}


def wait_for_go() -> None:
    """Block until the parent writes a line (every job is ready)."""
    if not sys.stdin.readline():
        raise SystemExit("the parent closed stdin before the start")


def run_job(args) -> None:
    """Baseline job: its own DataLoader, as each job has without sharing."""
    loader = make_loader(args.images_dir, args.batch, args.workers, HEAP_PAD)
    trainer = make_trainer(args.rank)
    emit("ready", batches_per_epoch=len(loader), lr=learning_rate(args.rank))
    wait_for_go()
    result = train(lambda: loader, trainer, args.rank, args.epochs, len(loader.dataset))
    emit("result", cpu_s=cpu_seconds(), **result)


def run_producer(args) -> None:
    """The shared producer: the same DataLoader, run once for every job."""
    from tensorsocket import TensorProducer

    # heap pad 0 here: the producer pads its loader's workers itself, by the same HEAP_PAD
    # as the baseline's (given, so that TENSORSOCKET_WORKER_HEAP_PAD cannot make the runs
    # differ). start_grace=0: every job of the run is counted in min_consumers.
    loader = make_loader(args.images_dir, args.batch, args.workers, 0)
    producer = TensorProducer(loader, name=args.name, min_consumers=args.jobs, start_grace=0,
                              worker_heap_pad=HEAP_PAD,
                              start_timeout=args.child_timeout,
                              publish_timeout=args.child_timeout)
    try:
        emit("ready", batches_per_epoch=len(loader))
        wait_for_go()  # no loading before every process is set up, as in the baseline
        first = time.monotonic()  # the workers start with the first epoch
        own0, kids0 = own_cpu_seconds(), children_cpu_seconds()
        for epoch in range(args.epochs):
            batches = sum(1 for _ in producer)
            emit("epoch", epoch=epoch + 1, batches=batches)
        stats = producer.stats()
        if not producer.join(timeout=args.child_timeout):
            raise TimeoutError(f"the consumers did not read every batch within "
                               f"{args.child_timeout:g} s")
    finally:
        producer.close()
    own, kids = own_cpu_seconds() - own0, children_cpu_seconds() - kids0
    emit("result", batches=stats["batches"], bytes_copied=stats["bytes_copied"],
         cpu_s=cpu_seconds(), own_cpu_s=own, workers_cpu_s=kids, work_cpu_s=own + kids,
         first=first)


def run_consumer(args) -> None:
    """A job fed by the shared producer: the one line that changes is the loader's."""
    from tensorsocket import TensorConsumer

    trainer = make_trainer(args.rank)
    emit("ready", lr=learning_rate(args.rank))  # set up; attaching waits for the first batch
    consumer = TensorConsumer(name=args.name, timeout=args.child_timeout,
                              batch_timeout=args.child_timeout)
    try:
        size = args.images  # the dataset's samples: the producer's loader covers them all
        result = train(lambda: consumer, trainer, args.rank, args.epochs, size)
    finally:
        consumer.close()
    emit("result", cpu_s=cpu_seconds(), **result)


ROLES = {"job": run_job, "producer": run_producer, "consumer": run_consumer}
