"""Collocated training: N jobs with N data loaders vs. one shared loader (tensorsocket).

    python benchmarks/collocated.py [--consumers 1,2,3,4] [--modes independent,shared,original]
                                    [--repeats 3] [--quick] [--json out.json]

Defaults: N = 1..4, all three modes, 3 repeats, 5 warm-up + 60 measured batches per
consumer: ~8.5 minutes on an idle 2-core machine (~20 when other work takes a core).
``--quick``: 3 + 20 batches, 1 repeat, ~2-3 minutes. The first run also generates the
JPEGs (~30 s, cached). The original at N = 4 peaks at ~10 GB of RSS (its consumers
unpickle every consumer's batches), so leave that much memory free.

The TensorSocket paper's experiment, scaled to a small CPU-only machine: N = 1..4
training processes, each training a small CNN on the CPU (``torch.set_num_threads(1)``
in every process), fed by a loader doing real CPU work (JPEG decoding and augmentation,
``workload.py``). Modes:

  independent  N processes, each with its own ``DataLoader(num_workers=--workers)`` over
               the same dataset (what N jobs do without sharing);
  shared       one producer process running that DataLoader once through
               ``tensorsocket.TensorProducer(loader, name=<unique>, min_consumers=N)``, and
               N processes training from ``TensorConsumer(name=<unique>)``. The one loader
               gets the workers the N jobs had together, N x --workers, at most the usable
               cores (``--producer-workers``, default ``auto``): one loader is configured
               once for the machine, as a user of a shared loader does; with 1 worker it
               could use at most one core whatever N is. The workers of every mode are
               recorded (``loader_workers`` per run, ``producer_workers`` per N);
  original     the same through the original TensorSocket 0.0.5 from PyPI (a cached venv,
               ``original_env.py``; roles run with that venv's python, unique TCP ports
               per run). Its producer has no ``min_consumers``: the role waits until N
               consumers' heartbeats are registered before iterating. Its defaults are
               kept (``producer_batch_size=8``, rubber band 0.5%, buffer of 10 batches).
               Its producer ends an epoch as soon as its loader is exhausted, before it
               broadcasts the loader batches it still holds (1 to producer_batch_size),
               so its consumers miss the epoch's last batches and fail the check (an
               epoch shorter than 8 batches is never sent at all: its consumers hang,
               recorded as "hang after X s").

Every consumer trains on exactly one epoch of ``(warmup + batches) * batch_size`` samples
(sample ``i`` is image ``i % images``) in the loader's shuffled order. It checks that it
got every sample id of the epoch exactly once, with the right label, and it sums the
images it trained on: shared and original consumers must receive, bit for bit and in the
same order, the images the independent jobs load themselves. A failed check is a failed
run (its numbers are kept, flagged, see "summary" below). Runs are interleaved (for each
repeat, for each N, every mode) so that drifting load on the machine hits all modes
alike; CPU used by other work during a run is measured and flagged.

Calibration (printed at start, stored in the JSON): CPU time of one thread per batch,
for the loader alone (``dataset[i]`` x batch + collate, what one DataLoader worker does,
in a forked process whose heap is padded first as the producer's workers pad theirs) and
for one SGD step on a fixed batch (in this process). On a CPU-only machine training
costs CPU too, so what sharing can win depends on the loader's cost L per batch against
the training cost T per batch: with C cores fully used, N independent jobs train
C / (L + T) batches/s in all, a shared loader N C / (L + N T); the throughput ratio is
N (L + T) / (L + N T) and the CPU-per-sample ratio (L + N T) / (N (L + T)). The defaults
are the loader-bound regime of the paper (there, training runs on GPUs and costs the CPU
almost nothing): 512x512 JPEGs decoded and randomly resized-cropped to 32x32, batch 32,
a ~20k-parameter ResNet-style CNN, so L is 6 to 9 T on the development machine (AMD
EPYC, 2 cores; it moves with the host's load). The calibration is printed and stored; CROP and WIDTHS in workload.py move the workload towards the training-bound side
(64x64 crops with widths 16,48,96 give L/T of about 1.4: measured 1.62x at N = 3, as the
formula predicts).

Measured per run:

- aggregate samples/s: sum over consumers of measured samples / seconds, each consumer
  timed from the request of its first post-warmup batch to the end of its last step;
- CPU-seconds per sample, two ways. ``cpu_s_per_sample``: a thread of this process polls
  /proc/<pid>/stat of every process of the run (producer, consumers, their DataLoader
  workers) every 0.25 s; the CPU they used in the window where every consumer is past
  its warmup and none has finished, divided by the samples trained in it (all consumers,
  interpolated from their per-batch timestamps). ``cpu_s_per_sample_total``: the CPU of
  the whole run (``getrusage(RUSAGE_CHILDREN)`` of this process, which includes reaped
  workers; interpreter start-up and imports included) divided by every sample trained;
- memory: ``peak_rss_total_mb`` = sum over the run's processes of their peak RSS
  (VmHWM, polled, and reported by each child before it exits); ``rss_per_consumer_mb``:
  median VmHWM of the training processes themselves (without their workers);
  ``peak_pss_total_mb``: largest sum of PSS (shared pages split between the processes
  mapping them) seen in one poll; ``shm_peak_mb``: largest total of the shared-memory
  objects under /dev/shm mapped by the run's processes (unlinked ones included: the
  ring for shared, DataLoader's and torch's shared tensors for the others), allocated
  bytes, polled every second;
- ratios shared/independent and original/independent for each N.

Allocator (``--worker-top-pad BYTES``, default 0: glibc's defaults): every DataLoader
worker is forked from its loader's process and inherits that process's malloc heap.
Decoding one 512x512 JPEG takes ~0.8 MB, under glibc's dynamic mmap threshold (~0.9 MB
once torch is imported), so it comes from the heap; whether freeing it leaves more than
the trim threshold (2 x the mmap threshold) free at the top of the heap, which glibc then
returns to the kernel and the next image faults back in page by page, depends on what
happens to sit at the top of the heap when the worker is forked. Everything the process
allocated before decides that, so importing one more module can flip it: measured here, a
worker forked after ``import tensorsocket`` took ~930k minor page faults and 3.6k ``brk``
calls per 60 batches against ~10k and 0.8k without, and ~40% more CPU per batch.
``--worker-top-pad`` makes every DataLoader worker of every mode call
``mallopt(M_MMAP_THRESHOLD, 32 MiB)`` and ``mallopt(M_TOP_PAD, BYTES)`` first
(``workload.pad_heap`` as ``worker_init_fn``), which removes the churn in all of them
(~10k faults per 60 batches), so both modes are compared on the loader's own work.
It is applied in the workers only: ``MALLOC_TOP_PAD_`` in the environment would reach the
training processes too (and it also fixes glibc's mmap threshold at its 128 KiB default
in every process), which would change what is compared.

tensorsocket's producer does the same in its own loader's workers by default
(``TensorProducer(worker_heap_pad=16 MiB)``, docs/usage.md "The loader's workers"), so
without ``--worker-top-pad`` the shared mode's workers are padded and the independent
ones keep glibc's defaults, as a user's own DataLoaders would. ``--producer-heap-pad
BYTES`` passes ``worker_heap_pad=BYTES`` to the shared producer (0: glibc's defaults
there too, as before the producer padded); the producer reports what it used.

Console: progress lines on stderr; on stdout the calibration and a table of medians over
the repeats.

JSON (``--json PATH``), schema ``tensorsocket-collocated/2``::

  schema, started (ISO time), argv, quick, repeats
  config: consumers [int], modes [str], batch_size, warmup_batches, measured_batches,
      samples_per_epoch, workers, producer_workers {N: workers of the shared loader},
      image_size, num_images, crop, threads_per_process, seed, poll_interval_s,
      worker_top_pad (bytes; 0: glibc's defaults), producer_worker_heap_pad (bytes: the
      shared producer's worker_heap_pad)
  machine: cpu_model, cores (os.cpu_count), usable_cores (sched_getaffinity),
      mem_total_gb, loadavg_start, loadavg_end, platform, python, torch, numpy, pillow,
      psutil, tensorsocket (this project's version and file), original (python, version,
      or error)
  calibration: batch_size, clock ("thread CPU time"), loader_top_pad, loader_batches_per_s,
      loader_samples_per_s, loader_ms_per_batch, loader_wall_ms_per_batch,
      train_batches_per_s, train_samples_per_s, train_ms_per_batch, train_wall_ms_per_batch,
      train_over_loader (train rate / loader rate, > 1: loader-bound), loader_bound_one_worker,
      model_params, threads (the rates and ms_per_batch are CPU time; schema 1 held wall
      times, the loader's measured in the orchestrator's own process)
  runs: [one per (repeat, N, mode)]:
      mode, consumers, repeat, ok (bool), error (str or null: the exception text, a
      failed check, or "hang after X s ..."), warnings [str], wall_s,
      aggregate_samples_per_s, cpu_s_per_sample, cpu_window ("common": the window above;
      "whole-run": fallback when the consumers' measured windows overlap too little),
      cpu_window_s, run_cores (CPU-seconds per second the run's processes used in the
      window), machine_busy_cores (the same for the whole machine, /proc/stat),
      other_load_cores (the difference: other work on the machine, this process's
      polling included; runs above 0.2 are flagged), cpu_s_total, cpu_s_per_sample_total,
      samples_trained,
      peak_rss_total_mb, rss_per_consumer_mb, peak_pss_total_mb, shm_peak_mb,
      shm_size_peak_mb (file sizes rather than allocated bytes),
      check: {ok, per_consumer: [{ok, expected, received, missing, duplicates,
      label_errors}]},
      data_checksums: distinct values of the consumers' checksums (sum of every image
      tensor received, in order; one value when all consumers got the same images),
      data_matches_independent: true when the run has one checksum equal to the
      independent run's of the same repeat and N (same images bit for bit, same order;
      the augmentation is deterministic per sample), false fails the run, null when
      there is nothing to compare,
      per_consumer: [{pid, batches, samples, measured_samples, seconds, samples_per_s,
      wait_s, train_s, loss_first, loss_last, vmhwm_mb, data_checksum, check}],
      producer: the producer's report (shared: batches, ring slots/slot_bytes/ring_bytes,
      bytes_copied, wait_seconds, drained; original: batches fetched, ports) or null,
      processes: [{pid, role, peak_rss_mb, cpu_s}],
      orchestrator_cpu_s (this process's own CPU during the run: the measuring
      overhead, not counted above), ports (original only)
  summary: [one per (mode, N)]:
      mode, consumers, runs, ok_runs, status ("ok": medians over the ok runs;
      "check_failed": no run passed its check, medians over the runs that finished with
      a failed check; "error": no numbers), errors [distinct error texts],
      aggregate_samples_per_s, cpu_s_per_sample, cpu_s_per_sample_total,
      peak_rss_total_mb, rss_per_consumer_mb, peak_pss_total_mb, shm_peak_mb, run_cores,
      other_load_cores (medians), cpu_window ("common", "whole-run" or "mixed" over
      the runs used),
      vs_independent: {samples_per_s, cpu_s_per_sample, peak_rss_total} (ratios of
      medians, this mode / independent at the same N; null where either is missing)

The script runs itself with hidden roles (``_trainer``, ``_producer``, ``_consumer``,
``_orig_producer``, ``_orig_consumer``) for the child processes. Every child has a
watchdog, every wait a timeout; all children (and their workers) are terminated and
reaped in a ``finally``, and the producers' leftovers (segment, lock, socket) removed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

MODES = ("independent", "shared", "original")
CONSUMER_COUNTS = (1, 2, 3, 4)
BATCH_SIZE = 32
WARMUP = 5
BATCHES = 60  # measured batches per consumer
QUICK_WARMUP = 3
QUICK_BATCHES = 20
WORKERS = 1
SEED = 0

POLL_S = 0.25  # /proc/<pid>/stat and status of the run's processes
SLOW_POLL_EVERY = 4  # PSS and shared-memory objects every 4th poll (1 s)
MIN_WINDOW_FRACTION = 0.25  # of the median measured time, for the common CPU window
OTHER_LOAD_WARN = 0.2  # cores busy outside the run (other work on the machine): flagged

# Timeouts (seconds). Every wait has one.
ATTACH_TIMEOUT = 60.0  # consumer -> producer handshake; producer 'ready'
START_TIMEOUT = 120.0  # producer waits this long for its consumers
BATCH_TIMEOUT = 120.0  # a consumer waits this long for one batch
PUBLISH_TIMEOUT = 120.0  # the producer waits this long for a free slot
JOIN_TIMEOUT = 60.0  # the producer waits this long for the consumers to drain
PRODUCER_EXIT_GRACE = 30.0  # after the consumers finished
MIN_RUN_TIMEOUT = 120.0
MAX_RUN_TIMEOUT = 900.0
KILL_GRACE = 5.0

MB = 1024 * 1024


# ======================================================================================
# children
# ======================================================================================


def _workload():
    sys.path.insert(0, str(HERE))
    import workload

    return workload


def _harness():
    """tools.harness (child processes, machine information): for the orchestrator
    only. The children must not import tensorsocket unless they use it: importing the
    package changes what sits at the top of the heap of a DataLoader's forked workers (see
    benchmarks/README.md, "The allocator")."""
    root = str(Path(__file__).resolve().parent.parent)  # tools/: this checkout's, not installed
    if root not in sys.path:
        sys.path.append(root)
    from tools import harness

    return harness


def _set_threads() -> None:
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass


def _vm_kb(pid: int | str = "self") -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmHWM:", "VmRSS:")):
                    out[line.split(":")[0]] = int(line.split()[1])
    except OSError:
        pass
    return out


def _report(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def _split(item):
    """(x, y, ids) from a loader item, with or without a leading batch index."""
    if isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], int):
        item = item[1]
    return item[0], item[1], item[2]


def consume(batches, trainer, warmup: int, expected: int) -> dict:
    """Train on every batch of one epoch of `batches`; timings and the sample check."""
    import numpy as np

    ids_seen = []
    label_errors = 0
    n = 0
    samples = 0
    first_loss = last_loss = None
    checksum = 0.0  # of the images, in delivery order: equal across modes for equal data
    done_times: list[float] = []
    done_samples: list[int] = []
    wait_s = train_s = 0.0
    t_start = None
    it = iter(batches)
    while True:
        t0 = time.monotonic()
        if n == warmup:
            t_start = t0
        try:
            item = next(it)
        except StopIteration:
            break
        t1 = time.monotonic()
        x, y, ids = _split(item)
        loss = trainer.step(x, y)
        checksum += float(x.double().sum())
        ids_l = ids.tolist()
        ys = y.tolist()
        del item, x, y, ids  # release the batch (a ring slot) before asking for the next
        t2 = time.monotonic()
        ids_seen.extend(ids_l)
        label_errors += sum(1 for i, lab in zip(ids_l, ys, strict=True) if lab != i % 10)
        if n >= warmup:
            wait_s += t1 - t0
            train_s += t2 - t1
            done_times.append(t2)
            done_samples.append(len(ids_l))
        if n == 0:
            first_loss = loss
        last_loss = loss
        n += 1
        samples += len(ids_l)
    arr = np.asarray(ids_seen, dtype=np.int64)
    valid = arr[(arr >= 0) & (arr < expected)]
    counts = np.bincount(valid, minlength=expected)
    missing = int((counts == 0).sum())
    duplicates = int((counts > 1).sum() + (len(arr) - len(valid)))
    check = {
        "ok": missing == 0 and duplicates == 0 and label_errors == 0 and len(arr) == expected,
        "expected": expected,
        "received": int(len(arr)),
        "missing": missing,
        "duplicates": duplicates,
        "label_errors": int(label_errors),
    }
    t_end = done_times[-1] if done_times else None
    measured = int(sum(done_samples))
    seconds = (t_end - t_start) if (t_end is not None and t_start is not None) else 0.0
    return {
        "batches": n,
        "samples": samples,
        "measured_samples": measured,
        "t_start": t_start,
        "t_end": t_end,
        "seconds": seconds,
        "samples_per_s": measured / seconds if seconds > 0 else 0.0,
        "done_times": done_times,
        "done_samples": done_samples,
        "wait_s": wait_s,
        "train_s": train_s,
        "loss_first": first_loss,
        "loss_last": last_loss,
        "data_checksum": checksum,
        "check": check,
    }


def _finish_consumer(res: dict, role: str) -> None:
    res.update({"role": role, "pid": os.getpid(), "vmhwm_kb": _vm_kb().get("VmHWM", 0),
                "cpu_s": sum(os.times()[:4])})
    _report(res)


def run_trainer(args: argparse.Namespace) -> int:
    """independent: own DataLoader."""
    _set_threads()
    wl = _workload()
    ds = wl.JpegDataset(args.images, length=args.samples, seed=args.seed)
    loader = wl.make_loader(ds, args.batch, args.workers, seed=args.seed,
                            worker_top_pad=args.worker_top_pad)
    trainer = wl.Trainer(seed=args.index)
    res = consume(loader, trainer, args.warmup, args.samples)
    del loader  # shuts the workers down (and reaps them) before we report
    _finish_consumer(res, "trainer")
    return 0


def run_producer(args: argparse.Namespace) -> int:
    """shared: TensorProducer over the DataLoader."""
    _set_threads()
    wl = _workload()
    from tensorsocket import TensorProducer

    ds = wl.JpegDataset(args.images, length=args.samples, seed=args.seed)
    loader = wl.make_loader(ds, args.batch, args.workers, seed=args.seed,
                            worker_top_pad=args.worker_top_pad)
    heap = {} if args.producer_heap_pad is None else {"worker_heap_pad": args.producer_heap_pad}
    producer = TensorProducer(loader, name=args.name, min_consumers=args.consumers,
                              start_timeout=START_TIMEOUT, publish_timeout=PUBLISH_TIMEOUT,
                              **heap)
    try:
        _report({"role": "producer", "ready": True})
        n = 0
        for _ in producer:
            n += 1
        stats = producer.stats()
        drained = producer.join(timeout=JOIN_TIMEOUT)
    finally:
        producer.close()
    _report({
        "role": "producer", "pid": os.getpid(), "batches": n,
        "slots": stats["slots"], "slot_bytes": stats["slot_bytes"],
        "ring_bytes": stats["slots"] * stats["slot_bytes"],
        "bytes_copied": stats["bytes_copied"], "wait_seconds": stats["wait_seconds"],
        "consumer_wait_seconds": stats["consumer_wait_seconds"], "drained": drained,
        "worker_heap_pad": producer.worker_heap_pad,
        "vmhwm_kb": _vm_kb().get("VmHWM", 0), "cpu_s": sum(os.times()[:4]),
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
    wl = _workload()
    ts = _check_original()
    ports = [int(p) for p in args.ports.split(",")]
    ds = wl.JpegDataset(args.images, length=args.samples, seed=args.seed)
    loader = wl.make_loader(ds, args.batch, args.workers, seed=args.seed,
                            worker_top_pad=args.worker_top_pad)
    producer = ts.TensorProducer(loader, ports[0], ports[1], (ports[2], ports[3]))
    _report({"role": "producer", "ready": True})
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
    _report({"role": "producer", "pid": os.getpid(), "next_calls": calls,
             "epochs": producer.epoch, "loader_batches": len(loader), "ports": ports,
             "consumers_left_at_exit": left, "tensorsocket": ts.__file__,
             "vmhwm_kb": _vm_kb().get("VmHWM", 0), "cpu_s": sum(os.times()[:4])})
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


def _child_main(argv: list[str]) -> int:
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

    def watchdog() -> None:
        sys.stderr.write(f"collocated.py {role}: watchdog: still running after "
                         f"{args.timeout:.0f} s, exiting\n")
        sys.stderr.flush()
        os._exit(124)

    timer = threading.Timer(args.timeout, watchdog)
    timer.daemon = True
    timer.start()
    # On SIGTERM from the orchestrator, unwind so that finally blocks run (the
    # producer unlinks its segment, a consumer says bye).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    return ROLES[role](args)


# ======================================================================================
# orchestrator: process-tree sampling
# ======================================================================================


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(")") + 2:].split()
    # fields[0] is field 3 (state): utime is field 14, stime field 15.
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def _machine_busy_s() -> float | None:
    """CPU-seconds the whole machine spent busy since boot (all CPUs; /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    ticks = [int(x) for x in fields[:8]]
    # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
    return (sum(ticks) - ticks[3] - ticks[4]) / _CLK_TCK


def _proc_pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _proc_shm_objects(pid: int, into: dict) -> None:
    """Shared-memory files under /dev/shm mapped by `pid` (deleted ones included):
    (dev, inode) -> (size, allocated bytes)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = [ln for ln in f if " /dev/shm/" in ln]
    except OSError:
        return
    for ln in lines:
        parts = ln.split(None, 5)
        if len(parts) < 6:
            continue
        key = (parts[3], parts[4])
        if key in into:
            continue
        try:
            st = os.stat(f"/proc/{pid}/map_files/{parts[0]}")
            into[key] = (st.st_size, st.st_blocks * 512)
        except OSError:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            into[key] = (hi - lo, hi - lo)


class Poller(threading.Thread):
    """Samples CPU time, peak RSS, PSS and shared memory of the run's process tree."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self._stop_evt = threading.Event()
        self._lock = threading.Lock()
        self.roots: dict[int, str] = {}  # direct children -> role
        self.roles: dict[int, str] = {}  # every process of the run seen -> role
        self.cpu: dict[int, float] = {}  # last seen cumulative CPU per pid
        self.hwm_kb: dict[int, int] = {}
        self.series: list[tuple[float, float]] = []  # (monotonic, total CPU s)
        self.busy: list[tuple[float, float]] = []  # (monotonic, machine busy CPU s)
        self.pss_peak_kb = 0
        self.shm_peak = (0, 0)  # (size, allocated) bytes
        self.error: str | None = None

    def add(self, pid: int, role: str) -> None:
        with self._lock:
            self.roots[pid] = role
            self.roles[pid] = role

    def stop(self) -> None:
        self._stop_evt.set()
        if self.ident is not None:
            self.join(timeout=10)
        try:
            self.sample(slow=False)  # a last look at whatever is still there
        except Exception:  # noqa: BLE001 - measurement only
            pass

    def pids(self, discover: bool) -> list[int]:
        """The roots and their descendants (looked for again only when `discover`)."""
        import psutil

        with self._lock:
            roots = dict(self.roots)
        if not discover:
            return list(self.roles)
        for pid, role in roots.items():
            try:
                kids = psutil.Process(pid).children(recursive=True)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            with self._lock:
                for k in kids:
                    self.roles.setdefault(k.pid, f"{role}-worker")
        return list(self.roles)

    def sample(self, slow: bool) -> None:
        now = time.monotonic()
        pids = self.pids(discover=slow or len(self.series) < 8)
        for pid in pids:
            c = _proc_cpu_s(pid)
            if c is not None:
                self.cpu[pid] = max(c, self.cpu.get(pid, 0.0))
            hwm = _vm_kb(pid).get("VmHWM")
            if hwm:
                self.hwm_kb[pid] = max(hwm, self.hwm_kb.get(pid, 0))
        self.series.append((now, sum(self.cpu.values())))
        busy = _machine_busy_s()
        if busy is not None:
            self.busy.append((now, busy))
        if slow:
            self.pss_peak_kb = max(self.pss_peak_kb, sum(_proc_pss_kb(p) for p in pids))
            objs: dict = {}
            for pid in pids:
                _proc_shm_objects(pid, objs)
            size = sum(v[0] for v in objs.values())
            alloc = sum(v[1] for v in objs.values())
            self.shm_peak = (max(self.shm_peak[0], size), max(self.shm_peak[1], alloc))

    def run(self) -> None:
        i = 0
        while not self._stop_evt.is_set():
            try:
                self.sample(slow=i % SLOW_POLL_EVERY == 0)
            except Exception as e:  # noqa: BLE001 - never kill a run for a measurement
                self.error = f"{type(e).__name__}: {e}"
            i += 1
            self._stop_evt.wait(POLL_S)

    def cpu_at(self, t: float, series: list | None = None) -> float | None:
        """Cumulative CPU-seconds of the run's processes (or of `series`) at `t`."""
        import numpy as np

        series = self.series if series is None else series
        if len(series) < 2 or not series[0][0] <= t <= series[-1][0]:
            return None
        ts, cs = zip(*series, strict=True)
        return float(np.interp(t, ts, cs))


# ======================================================================================
# orchestrator: one run
# ======================================================================================


def _library_heap_pad() -> int:
    """tensorsocket's worker_heap_pad as a producer here would use it (default or env)."""
    from tensorsocket import config

    return config.get("worker_heap_pad")


def _child_cmd(python: str, role: str, **kw) -> list[str]:
    cmd = [python, str(Path(__file__).resolve()), role]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return cmd


def _child_env() -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.pop("TENSORSOCKET_NAME", None)
    return env


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def _kill_all(procs: list[subprocess.Popen]) -> None:
    """Terminate, then kill, every child still running and the workers it started (its
    process tree); reap the children."""
    children = _harness().Children()
    children.procs = list(procs)
    children.stop_all(KILL_GRACE)


def _remove_leftovers(name: str) -> None:
    """What a tensorsocket producer of this (unique, ours only) name may leave: its
    segment if it was killed, and the lock and socket files."""
    from tensorsocket.cli.clean import remove_leftovers

    remove_leftovers(name)


def _wait_ready(proc: subprocess.Popen, out_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if '"ready"' in out_path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"producer exited early (rc={proc.returncode})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"producer not ready within {timeout:.0f} s")
        time.sleep(0.05)


def _rusage_children_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


class RunSpec:
    def __init__(self, mode: str, consumers: int, repeat: int, images: str, batch: int,
                 warmup: int, batches: int, workers: int, timeout: float,
                 original_python: str | None, producer_workers: int | None = None,
                 worker_top_pad: int = 0, producer_heap_pad: int | None = None) -> None:
        self.mode = mode
        self.consumers = consumers
        self.repeat = repeat
        self.images = images
        self.batch = batch
        self.warmup = warmup
        self.batches = batches
        self.workers = workers
        # DataLoader workers of the one shared loader (shared and original modes).
        self.producer_workers = producer_workers if producer_workers is not None else workers
        self.timeout = timeout
        self.original_python = original_python
        self.worker_top_pad = worker_top_pad  # mallopt(M_TOP_PAD) in every loader worker
        self.producer_heap_pad = producer_heap_pad  # shared producer's worker_heap_pad

    @property
    def samples(self) -> int:
        return (self.warmup + self.batches) * self.batch


def run_once(spec: RunSpec) -> dict:
    """One run; never raises: failures are recorded in the result."""
    record = {"mode": spec.mode, "consumers": spec.consumers, "repeat": spec.repeat,
              "loader_workers": (spec.workers if spec.mode == "independent"
                                 else spec.producer_workers),
              "ok": False, "error": None, "warnings": []}
    name = f"bench-coll-{os.getpid()}-{spec.mode}-{spec.consumers}-{spec.repeat}"
    tmp = Path(tempfile.mkdtemp(prefix="collocated-"))
    procs: list[subprocess.Popen] = []
    logs: dict[int, tuple[str, Path, Path]] = {}
    poller = Poller()
    common = dict(images=spec.images, samples=spec.samples, batch=spec.batch,
                  workers=spec.workers, warmup=spec.warmup, seed=SEED,
                  timeout=spec.timeout + 30, worker_top_pad=spec.worker_top_pad)
    cpu0 = _rusage_children_s()
    own0 = sum(os.times()[:2])
    t0 = time.monotonic()

    def spawn(python: str, role: str, label: str, **kw) -> subprocess.Popen:
        out = tmp / f"{label}.out"
        err = tmp / f"{label}.err"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            p = _harness().spawn(_child_cmd(python, role, **dict(common, **kw)), stdout=fo,
                                 stderr=fe, stdin=subprocess.DEVNULL, cwd=tmp,
                                 env=_child_env(), label=label)
        procs.append(p)
        logs[p.pid] = (label, out, err)
        poller.add(p.pid, label.rstrip("0123456789"))
        return p

    producer = None
    consumers: list[subprocess.Popen] = []
    try:
        poller.start()
        if spec.mode == "independent":
            for k in range(spec.consumers):
                consumers.append(spawn(sys.executable, "_trainer", f"trainer{k}", index=k))
        elif spec.mode == "shared":
            heap = ({} if spec.producer_heap_pad is None
                    else {"producer_heap_pad": spec.producer_heap_pad})
            producer = spawn(sys.executable, "_producer", "producer", name=name,
                             workers=spec.producer_workers,
                             consumers=spec.consumers, **heap)
            _wait_ready(producer, logs[producer.pid][1], ATTACH_TIMEOUT)
            for k in range(spec.consumers):
                consumers.append(spawn(sys.executable, "_consumer", f"consumer{k}",
                                       name=name, index=k))
        elif spec.mode == "original":
            if spec.original_python is None:
                raise RuntimeError("the original TensorSocket is unavailable")
            ports = ",".join(map(str, _free_ports(4)))
            record["ports"] = ports
            producer = spawn(spec.original_python, "_orig_producer", "producer",
                             workers=spec.producer_workers,
                             ports=ports, consumers=spec.consumers)
            _wait_ready(producer, logs[producer.pid][1], ATTACH_TIMEOUT)
            for k in range(spec.consumers):
                consumers.append(spawn(spec.original_python, "_orig_consumer",
                                       f"consumer{k}", ports=ports, index=k))
        else:
            raise ValueError(f"unknown mode {spec.mode!r}")

        deadline = t0 + spec.timeout
        consumers_done_at = None
        while True:
            now = time.monotonic()
            bad = [p for p in procs if p.poll() not in (None, 0)]
            if bad:
                p = bad[0]
                label, _, err = logs[p.pid]
                raise RuntimeError(f"{label} exited with rc={p.returncode}: "
                                   f"{_tail(err, 1200)}")
            if all(p.poll() == 0 for p in consumers):
                if producer is None or producer.poll() == 0:
                    break
                consumers_done_at = consumers_done_at or now
                if now - consumers_done_at > PRODUCER_EXIT_GRACE:
                    raise RuntimeError(f"hang: the producer did not exit within "
                                       f"{PRODUCER_EXIT_GRACE:.0f} s after the consumers "
                                       f"finished: {_tail(logs[producer.pid][2], 800)}")
            if now > deadline:
                running = [logs[p.pid][0] for p in procs if p.poll() is None]
                raise TimeoutError(f"hang after {now - t0:.0f} s (still running: "
                                   f"{', '.join(running)})")
            time.sleep(0.1)
        record["wall_s"] = time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - a failed run is a result
        record["error"] = str(e) or type(e).__name__
        record["wall_s"] = time.monotonic() - t0
    finally:
        _kill_all(procs)
        poller.stop()
        if spec.mode == "shared":
            _remove_leftovers(name)
    cpu_total = _rusage_children_s() - cpu0
    record["orchestrator_cpu_s"] = sum(os.times()[:2]) - own0

    reports = {}
    for pid, (_label, out, _err) in logs.items():
        lines = [r for r in _harness().json_lines(_tail(out, 10**7)) if r.get("role") and
                 not r.get("ready")]
        if lines:
            reports[pid] = lines[-1]
    shutil.rmtree(tmp, ignore_errors=True)
    if poller.error:
        record["warnings"].append(f"poller: {poller.error}")

    cons = [reports.get(p.pid) for p in consumers]
    record["producer"] = reports.get(producer.pid) if producer is not None else None
    if record["error"] is None and (not cons or any(c is None for c in cons)):
        record["error"] = "a consumer reported nothing"
    cons = [c for c in cons if c is not None]
    try:
        _metrics(record, spec, cons, poller, reports, cpu_total)
    except Exception as e:  # noqa: BLE001 - a broken report fails the run, not the suite
        record["error"] = record["error"] or f"bad report: {type(e).__name__}: {e}"
        cons = []
    prod = record["producer"] or {}
    if prod.get("drained") is False:
        record["warnings"].append("the producer's join() timed out before the consumers "
                                  "had read everything")
    if record["error"] is None:
        failed = [c["check"] for c in cons if not c["check"]["ok"]]
        if failed:
            f = failed[0]
            record["error"] = (f"check failed in {len(failed)} of {len(cons)} consumers: "
                               f"received {f['received']} of {f['expected']} samples, "
                               f"{f['missing']} missing, {f['duplicates']} duplicated, "
                               f"{f['label_errors']} wrong labels")
            record["check_failed"] = True
        else:
            record["ok"] = True
    return record


def _metrics(record: dict, spec: RunSpec, cons: list[dict], poller: Poller,
             reports: dict, cpu_total: float) -> None:
    import numpy as np

    record["check"] = {"ok": bool(cons) and all(c["check"]["ok"] for c in cons),
                       "per_consumer": [c["check"] for c in cons]}
    record["per_consumer"] = [{
        "pid": c["pid"], "batches": c["batches"], "samples": c["samples"],
        "measured_samples": c["measured_samples"], "seconds": c["seconds"],
        "samples_per_s": c["samples_per_s"], "wait_s": c["wait_s"], "train_s": c["train_s"],
        "loss_first": c["loss_first"], "loss_last": c["loss_last"],
        "vmhwm_mb": c["vmhwm_kb"] / 1024, "data_checksum": c["data_checksum"],
        "check": c["check"],
    } for c in cons]
    record["data_checksums"] = sorted({c["data_checksum"] for c in cons})
    complete = bool(cons) and len(cons) == spec.consumers and all(
        c["seconds"] > 0 for c in cons)
    record["aggregate_samples_per_s"] = (sum(c["samples_per_s"] for c in cons)
                                         if complete else None)
    samples_total = sum(c["samples"] for c in cons)
    record["samples_trained"] = samples_total
    record["cpu_s_total"] = cpu_total
    record["cpu_s_per_sample_total"] = cpu_total / samples_total if complete else None

    # CPU in the common measured window.
    record["cpu_s_per_sample"] = None
    record["cpu_window"] = None
    record["cpu_window_s"] = None
    record["run_cores"] = None
    record["machine_busy_cores"] = None
    record["other_load_cores"] = None
    if complete:
        ws = max(c["t_start"] for c in cons)
        we = min(c["t_end"] for c in cons)
        med = statistics.median(c["seconds"] for c in cons)
        c0, c1 = poller.cpu_at(ws), poller.cpu_at(we)
        if we - ws >= max(1.0, MIN_WINDOW_FRACTION * med) and c0 is not None \
                and c1 is not None:
            done = 0.0
            for c in cons:
                ts = [c["t_start"]] + c["done_times"]
                cum = np.concatenate([[0], np.cumsum(c["done_samples"])])
                done += float(np.interp(we, ts, cum) - np.interp(ws, ts, cum))
            if done > 0:
                record["cpu_s_per_sample"] = (c1 - c0) / done
                record["cpu_window"] = "common"
                record["cpu_window_s"] = we - ws
                record["run_cores"] = (c1 - c0) / (we - ws)
                b0, b1 = poller.cpu_at(ws, poller.busy), poller.cpu_at(we, poller.busy)
                if b0 is not None and b1 is not None:
                    record["machine_busy_cores"] = (b1 - b0) / (we - ws)
                    record["other_load_cores"] = max(0.0, record["machine_busy_cores"]
                                                     - record["run_cores"])
        if record["cpu_s_per_sample"] is None:
            record["cpu_s_per_sample"] = record["cpu_s_per_sample_total"]
            record["cpu_window"] = "whole-run"

    # Memory.
    procs = []
    for pid, role in sorted(poller.roles.items()):
        hwm = max(poller.hwm_kb.get(pid, 0), (reports.get(pid) or {}).get("vmhwm_kb", 0))
        procs.append({"pid": pid, "role": role, "peak_rss_mb": hwm / 1024,
                      "cpu_s": poller.cpu.get(pid)})
    record["processes"] = procs
    record["peak_rss_total_mb"] = sum(p["peak_rss_mb"] for p in procs) if procs else None
    own = [c["vmhwm_kb"] / 1024 for c in cons if c.get("vmhwm_kb")]
    record["rss_per_consumer_mb"] = statistics.median(own) if own else None
    record["peak_pss_total_mb"] = poller.pss_peak_kb / 1024
    record["shm_size_peak_mb"] = poller.shm_peak[0] / MB
    record["shm_peak_mb"] = poller.shm_peak[1] / MB


# ======================================================================================
# orchestrator: the suite
# ======================================================================================


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _machine(original: dict) -> dict:
    import numpy
    import PIL
    import torch

    try:
        import psutil
        psutil_version = psutil.__version__
    except ImportError:
        psutil_version = None
    try:
        import tensorsocket
        ours = {"version": getattr(tensorsocket, "__version__", None),
                "file": tensorsocket.__file__}
    except ImportError as e:
        ours = {"error": str(e)}
    machine = _harness().machine_info(packages=())
    return {
        "cpu_model": machine["cpu_model"],
        "cores": machine["cpus"],
        "usable_cores": machine["cpus_usable"],
        "mem_total_gb": machine["mem_total_gb"] and machine["mem_total_gb"] * 1e9 / 2**30,  # GiB
        "loadavg_start": machine["loadavg_start"],
        "platform": machine["platform"],
        "python": machine["python"],
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "pillow": PIL.__version__,
        "psutil": psutil_version,
        "tensorsocket": ours,
        "original": original,
    }


def _original_python() -> tuple[str | None, dict]:
    try:
        sys.path.insert(0, str(HERE))
        from original_env import ORIGINAL_VERSION, ensure_venv

        python = str(ensure_venv(_log))
        return python, {"python": python, "version": ORIGINAL_VERSION}
    except Exception as e:  # noqa: BLE001 - the original's runs record this error
        return None, {"error": f"{type(e).__name__}: {e}"}


def _compare_data(runs: list[dict]) -> None:
    """data_matches_independent: whether every consumer of a run trained on exactly the
    images (bit for bit, in the same order) that the independent run of the same repeat
    and N trained on (the augmentation is deterministic per sample and epoch)."""
    for r in runs:
        base = next((b for b in runs if b["mode"] == "independent" and b["ok"]
                     and b["repeat"] == r["repeat"] and b["consumers"] == r["consumers"]),
                    None)
        if r["mode"] == "independent":
            r["data_matches_independent"] = (len(r.get("data_checksums") or []) == 1
                                             if r["ok"] else None)
        elif base is None or not r.get("data_checksums") or not r["ok"]:
            r["data_matches_independent"] = None
        else:
            r["data_matches_independent"] = r["data_checksums"] == base["data_checksums"]
        if r["data_matches_independent"] is False:
            r["ok"] = False
            r["check_failed"] = True
            r["error"] = ("data check failed: the consumers' images differ from those of "
                          "the independent run (data_checksums)")
            _log(f"{r['mode']} N={r['consumers']} repeat {r['repeat'] + 1}: {r['error']}")


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


METRICS = ("aggregate_samples_per_s", "cpu_s_per_sample", "cpu_s_per_sample_total",
           "peak_rss_total_mb", "rss_per_consumer_mb", "peak_pss_total_mb", "shm_peak_mb",
           "run_cores", "other_load_cores")


def summarize(runs: list[dict], modes: list[str], counts: list[int]) -> list[dict]:
    out = []
    for n in counts:
        for mode in modes:
            rs = [r for r in runs if r["mode"] == mode and r["consumers"] == n]
            ok = [r for r in rs if r["ok"]]
            flagged = [r for r in rs if r.get("check_failed")
                       and r.get("aggregate_samples_per_s") is not None]
            use, status = (ok, "ok") if ok else ((flagged, "check_failed") if flagged
                                                 else ([], "error"))
            s = {"mode": mode, "consumers": n, "runs": len(rs), "ok_runs": len(ok),
                 "status": status,
                 "errors": sorted({r["error"] for r in rs if r["error"]})}
            for m in METRICS:
                s[m] = _median([r.get(m) for r in use])
            windows = {r.get("cpu_window") for r in use} - {None}
            s["cpu_window"] = (windows.pop() if len(windows) == 1
                               else ("mixed" if windows else None))
            out.append(s)
    for s in out:
        base = next((b for b in out if b["mode"] == "independent"
                     and b["consumers"] == s["consumers"] and b["status"] == "ok"), None)

        def ratio(key: str, s=s, base=base):
            if base is None or s[key] is None or not base[key]:
                return None
            return s[key] / base[key]

        s["vs_independent"] = {"samples_per_s": ratio("aggregate_samples_per_s"),
                               "cpu_s_per_sample": ratio("cpu_s_per_sample"),
                               "peak_rss_total": ratio("peak_rss_total_mb")}
    return out


def _fmt(x, spec: str) -> str:
    if x is not None:
        return format(x, spec)
    width = spec.split(".")[0]
    return "-".rjust(int(width) if width.isdigit() else 1)


def print_table(summary: list[dict], repeats: int) -> None:
    print()
    print(f"medians over {repeats} repeat(s); 'vs ind' = this mode / independent at the same N")
    hdr = (f"{'mode':<12}{'N':>2} {'ok':>5} {'samples/s':>10} {'vs ind':>7} "
           f"{'CPU ms/smp':>10} {'vs ind':>7} {'total':>6} {'RSS MB':>8} {'RSS/job':>8} "
           f"{'PSS MB':>7} {'shm MB':>7}  status")
    print(hdr)
    print("-" * len(hdr))
    notes = []
    for s in summary:
        v = s["vs_independent"]
        cpu = s["cpu_s_per_sample"]
        cpu_tot = s["cpu_s_per_sample_total"]
        rss_job = (s["peak_rss_total_mb"] / s["consumers"]
                   if s["peak_rss_total_mb"] is not None else None)
        status = s["status"]
        if status == "check_failed":
            status = "CHECK FAILED (numbers flagged)"
        elif status == "error":
            status = "ERROR"
        if s["errors"]:
            notes.append(f"{s['mode']} N={s['consumers']}: {s['errors'][0][:300]}")
        print(f"{s['mode']:<12}{s['consumers']:>2} {s['ok_runs']:>2}/{s['runs']:<2} "
              f"{_fmt(s['aggregate_samples_per_s'], '10.1f')} "
              f"{_fmt(v['samples_per_s'], '7.2f')} "
              f"{_fmt(cpu and cpu * 1e3, '10.2f')} {_fmt(v['cpu_s_per_sample'], '7.2f')} "
              f"{_fmt(cpu_tot and cpu_tot * 1e3, '6.2f')} "
              f"{_fmt(s['peak_rss_total_mb'], '8.0f')} {_fmt(rss_job, '8.0f')} "
              f"{_fmt(s['peak_pss_total_mb'], '7.0f')} {_fmt(s['shm_peak_mb'], '7.1f')}  "
              f"{status}")
    print("CPU ms/smp: CPU of all the run's processes per trained sample, steady state "
          "(common measured window); total: whole run incl. start-up.")
    print("RSS MB: sum of the processes' peak RSS; RSS/job: that / N; PSS MB: peak sum of "
          "PSS; shm MB: peak /dev/shm objects mapped.")
    whole = [f"{s['mode']} N={s['consumers']}" for s in summary
             if s.get("cpu_window") in ("whole-run", "mixed")]
    if whole:
        print("CPU ms/smp includes start-up (the consumers' measured windows overlapped too "
              "little) for: " + ", ".join(whole))
    busy = [s for s in summary if (s.get("other_load_cores") or 0) > OTHER_LOAD_WARN]
    if busy:
        print("WARNING: other work used the machine's CPUs during these (medians, cores): "
              + ", ".join(f"{s['mode']} N={s['consumers']} {s['other_load_cores']:.2f}"
                          for s in busy))
    if notes:
        print()
        print("errors / failed checks (first of each):")
        for line in notes:
            print(f"  {line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--consumers", default=",".join(map(str, CONSUMER_COUNTS)),
                        help="comma-separated consumer counts (default 1,2,3,4)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--repeats", type=int, default=None,
                        help="repeats per configuration (default 3, 1 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_WARMUP}+{QUICK_BATCHES} batches per consumer, 1 repeat")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    parser.add_argument("--batches", type=int, default=None,
                        help=f"measured batches per consumer (default {BATCHES}, "
                             f"{QUICK_BATCHES} with --quick)")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"warm-up batches per consumer (default {WARMUP}, "
                             f"{QUICK_WARMUP} with --quick)")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument("--workers", type=int, default=WORKERS,
                        help="DataLoader workers of every loader (default 1)")
    parser.add_argument("--producer-workers", default="auto",
                        help="DataLoader workers of the one shared loader (shared and "
                             "original modes): a number, or 'auto' (default) for what the N "
                             "independent jobs have together, N x --workers, at most the "
                             "usable cores")
    parser.add_argument("--image-size", type=int, default=None,
                        help="side of the generated JPEGs (default: workload.IMAGE_SIZE)")
    parser.add_argument("--num-images", type=int, default=None,
                        help="number of generated JPEGs (default: workload.NUM_IMAGES)")
    parser.add_argument("--worker-top-pad", type=int, default=0, metavar="BYTES",
                        help="every DataLoader worker of every mode pads its heap first "
                             "(workload.pad_heap: M_TOP_PAD=BYTES, M_MMAP_THRESHOLD=32 MiB; "
                             "default 0: glibc's defaults); see 'Allocator'")
    parser.add_argument("--producer-heap-pad", type=int, default=None, metavar="BYTES",
                        help="worker_heap_pad= of the shared producer (default: "
                             "tensorsocket's, 16 MiB; 0: glibc's defaults in its workers)")
    args = parser.parse_args(argv)

    wl = _workload()
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if args.quick
                                                          else WARMUP)
    batches = args.batches if args.batches is not None else (QUICK_BATCHES if args.quick
                                                             else BATCHES)
    if warmup < 1 or batches < 2 or repeats < 1:
        parser.error("need --warmup >= 1, --batches >= 2, --repeats >= 1")
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            parser.error(f"unknown mode {m!r}")
    counts = [int(c) for c in args.consumers.split(",") if c]
    if args.worker_top_pad < 0:
        parser.error("--worker-top-pad takes a number of bytes >= 0")
    if args.producer_heap_pad is not None and args.producer_heap_pad < 0:
        parser.error("--producer-heap-pad takes a number of bytes >= 0")
    if args.producer_workers != "auto" and not (args.producer_workers.isdigit()
                                                and int(args.producer_workers) >= 0):
        parser.error("--producer-workers takes 'auto' or a number >= 0")
    size = args.image_size or wl.IMAGE_SIZE
    nimg = args.num_images or wl.NUM_IMAGES
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    t_suite = time.monotonic()

    images = str(wl.ensure_images(nimg, size, progress=_log))
    original_python, original = (None, {"skipped": True})
    if "original" in modes:
        original_python, original = _original_python()
        if original_python is None:
            _log(f"original TensorSocket unavailable: {original['error']}")
    machine = _machine(original)

    producer_heap_pad = (args.producer_heap_pad if args.producer_heap_pad is not None
                         else _library_heap_pad())
    _log("calibrating (loader-only and train-only CPU time, 1 thread each) ...")
    cal = wl.calibrate(images, args.batch_size, batches=4 if args.quick else 10,
                       top_pad=producer_heap_pad or wl.CALIBRATION_TOP_PAD)
    per_batch = (cal["loader_wall_ms_per_batch"] + cal["train_wall_ms_per_batch"]) / 1e3
    cores = max(1, machine["usable_cores"] or 1)

    def producer_workers(n: int) -> int:
        """Workers of the shared loader at N consumers: the N jobs' together, capped."""
        if args.producer_workers != "auto":
            return int(args.producer_workers)
        return max(args.workers, min(n * args.workers, cores))
    print(f"collocated benchmark: {machine['cpu_model']}, {machine['cores']} cores, "
          f"python {machine['python']}, torch {machine['torch']}")
    print(f"workload: {nimg} JPEGs {size}x{size} -> RandomResizedCrop {wl.CROP} + flip, batch "
          f"{args.batch_size}, {warmup}+{batches} batches per consumer, "
          f"{args.workers} worker(s) per independent loader, shared loader "
          f"{', '.join(f'N={n}: {producer_workers(n)}' for n in counts)} worker(s), "
          f"model {cal['model_params']} params, "
          f"1 thread per process, {repeats} repeat(s), loader workers' malloc "
          + (f"M_TOP_PAD={args.worker_top_pad}" if args.worker_top_pad else "defaults")
          + f", shared producer worker_heap_pad={producer_heap_pad}")
    print(f"calibration (CPU time): loader {cal['loader_ms_per_batch']:.1f} ms/batch "
          f"(a forked process, heap padded), train {cal['train_ms_per_batch']:.1f} "
          f"ms/batch: a training process consumes {cal['train_over_loader']:.2f}x what one "
          f"loader worker produces ("
          f"{'loader-bound' if cal['loader_bound_one_worker'] else 'NOT loader-bound'})",
          flush=True)

    plan = [(rep, n, mode) for rep in range(repeats) for n in counts for mode in modes]
    runs = []
    for i, (rep, n, mode) in enumerate(plan):
        # Expected seconds: all N jobs' loading + training on the usable cores.
        expect = n * (warmup + batches) * per_batch / min(cores, 2 * n)
        timeout = min(MAX_RUN_TIMEOUT, max(MIN_RUN_TIMEOUT, 90 + 10 * expect))
        spec = RunSpec(mode, n, rep, images, args.batch_size, warmup, batches, args.workers,
                       timeout, original_python, producer_workers(n), args.worker_top_pad,
                       args.producer_heap_pad)
        _log(f"[{i + 1}/{len(plan)}] {mode} N={n} repeat {rep + 1}/{repeats} "
             f"(elapsed {time.monotonic() - t_suite:.0f} s) ...")
        r = run_once(spec)
        runs.append(r)
        if r["ok"] or r.get("check_failed"):
            cps = r["cpu_s_per_sample"]
            other = r.get("other_load_cores")
            _log(f"    {r['wall_s']:.1f} s: {_fmt(r['aggregate_samples_per_s'], '.1f')} "
                 f"samples/s, {_fmt(cps and cps * 1e3, '.2f')} CPU ms/sample, peak RSS "
                 f"{_fmt(r['peak_rss_total_mb'], '.0f')} MB, run used "
                 f"{_fmt(r.get('run_cores'), '.2f')} cores"
                 + (f", OTHER LOAD {other:.2f} cores" if other and other > OTHER_LOAD_WARN
                    else "")
                 + ("" if r["ok"] else f"  [{r['error']}]"))
        else:
            _log(f"    FAILED after {r['wall_s']:.1f} s: {r['error'][:500]}")

    _compare_data(runs)
    summary = summarize(runs, modes, counts)
    print_table(summary, repeats)
    machine["loadavg_end"] = list(os.getloadavg())
    _log(f"done in {time.monotonic() - t_suite:.0f} s")

    if args.json:
        doc = {
            "schema": "tensorsocket-collocated/2",
            "started": started,
            "argv": sys.argv[1:] if argv is None else argv,
            "quick": args.quick,
            "repeats": repeats,
            "config": {
                "consumers": counts, "modes": modes, "batch_size": args.batch_size,
                "warmup_batches": warmup, "measured_batches": batches,
                "samples_per_epoch": (warmup + batches) * args.batch_size,
                "workers": args.workers, "image_size": size, "num_images": nimg,
                "producer_workers": {str(n): producer_workers(n) for n in counts},
                "crop": wl.CROP, "threads_per_process": 1, "seed": SEED,
                "poll_interval_s": POLL_S, "worker_top_pad": args.worker_top_pad,
                "producer_worker_heap_pad": producer_heap_pad,
            },
            "machine": machine,
            "calibration": cal,
            "runs": runs,
            "summary": summary,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ROLES:
        sys.exit(_child_main(sys.argv[1:]))
    sys.exit(main())
