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
``_orig_producer``, ``_orig_consumer``: collocated_children.py) for the child processes;
one run is collocated_run.py (its process tree polled by collocated_poller.py), the
medians and the table collocated_summary.py. Every child has a
watchdog, every wait a timeout; all children (and their workers) are terminated and
reaped in a ``finally``, and the producers' leftovers (segment, lock, socket) removed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is not a package
from bench_common import (  # noqa: E402
    HERE, add_run_options, count_list, dispatch, log, machine_info, name_list, repeats,
    write_json,
)
from collocated_children import ROLES, SEED, WARMUP, WORKERS, child_main  # noqa: E402
from collocated_poller import POLL_S  # noqa: E402
from collocated_run import RunSpec, run_once  # noqa: E402
from collocated_summary import (  # noqa: E402
    OTHER_LOAD_WARN, compare_data, fmt_spec, print_table, summarize,
)

MODES = ("independent", "shared", "original")
CONSUMER_COUNTS = (1, 2, 3, 4)
BATCH_SIZE = 32
BATCHES = 60  # measured batches per consumer
QUICK_WARMUP = 3
QUICK_BATCHES = 20
MIN_RUN_TIMEOUT = 120.0
MAX_RUN_TIMEOUT = 900.0


def _workload():
    sys.path.insert(0, str(HERE))
    import workload

    return workload


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options, checked; adds repeats, warmup, batches, modes and counts resolved."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_options(parser, f"{QUICK_WARMUP}+{QUICK_BATCHES} batches per consumer, 1 repeat",
                    CONSUMER_COUNTS)
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated subset of {','.join(MODES)}")
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
    args.repeats = repeats(args)
    args.warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if args.quick
                                                               else WARMUP)
    args.batches = args.batches if args.batches is not None else (QUICK_BATCHES if args.quick
                                                                  else BATCHES)
    if args.warmup < 1 or args.batches < 2 or args.repeats < 1:
        parser.error("need --warmup >= 1, --batches >= 2, --repeats >= 1")
    args.modes = name_list(parser, args.modes, MODES, "mode")
    args.counts = count_list(parser, args.consumers)
    if args.worker_top_pad < 0:
        parser.error("--worker-top-pad takes a number of bytes >= 0")
    if args.producer_heap_pad is not None and args.producer_heap_pad < 0:
        parser.error("--producer-heap-pad takes a number of bytes >= 0")
    if args.producer_workers != "auto" and not (args.producer_workers.isdigit()
                                                and int(args.producer_workers) >= 0):
        parser.error("--producer-workers takes 'auto' or a number >= 0")
    return args


def _library_heap_pad() -> int:
    """tensorsocket's worker_heap_pad as a producer here would use it (default or env)."""
    from tensorsocket import config

    return config.get("worker_heap_pad")


def _original_python() -> tuple[str | None, dict]:
    try:
        from original_env import ORIGINAL_VERSION, ensure_venv

        python = str(ensure_venv(log))
        return python, {"python": python, "version": ORIGINAL_VERSION}
    except Exception as e:  # noqa: BLE001 - the original's runs record this error
        return None, {"error": f"{type(e).__name__}: {e}"}


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
    machine = machine_info(packages=())
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


class Suite:
    """What every run of one invocation shares: the images, the original's python, the
    machine, the calibration, and the shared loader's workers at each N."""

    def __init__(self, args: argparse.Namespace) -> None:
        wl = _workload()
        self.args = args
        self.size = args.image_size or wl.IMAGE_SIZE
        self.nimg = args.num_images or wl.NUM_IMAGES
        self.started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        self.t0 = time.monotonic()
        self.images = str(wl.ensure_images(self.nimg, self.size, progress=log))
        self.original_python, original = (None, {"skipped": True})
        if "original" in args.modes:
            self.original_python, original = _original_python()
            if self.original_python is None:
                log(f"original TensorSocket unavailable: {original['error']}")
        self.machine = _machine(original)
        self.producer_heap_pad = (args.producer_heap_pad if args.producer_heap_pad is not None
                                  else _library_heap_pad())
        log("calibrating (loader-only and train-only CPU time, 1 thread each) ...")
        self.cal = wl.calibrate(self.images, args.batch_size, batches=4 if args.quick else 10,
                                top_pad=self.producer_heap_pad or wl.CALIBRATION_TOP_PAD)
        self.cores = max(1, self.machine["usable_cores"] or 1)

    def producer_workers(self, n: int) -> int:
        """Workers of the shared loader at N consumers: the N jobs' together, capped."""
        if self.args.producer_workers != "auto":
            return int(self.args.producer_workers)
        return max(self.args.workers, min(n * self.args.workers, self.cores))

    def spec(self, rep: int, n: int, mode: str) -> RunSpec:
        """One run, with a timeout from the expected time of all N jobs' loading and
        training on the usable cores."""
        a, cal = self.args, self.cal
        per_batch = (cal["loader_wall_ms_per_batch"] + cal["train_wall_ms_per_batch"]) / 1e3
        expect = n * (a.warmup + a.batches) * per_batch / min(self.cores, 2 * n)
        timeout = min(MAX_RUN_TIMEOUT, max(MIN_RUN_TIMEOUT, 90 + 10 * expect))
        return RunSpec(mode, n, rep, self.images, a.batch_size, a.warmup, a.batches,
                       a.workers, timeout, self.original_python, self.producer_workers(n),
                       a.worker_top_pad, a.producer_heap_pad)


    def print_header(self) -> None:
        a, m, cal = self.args, self.machine, self.cal
        print(f"collocated benchmark: {m['cpu_model']}, {m['cores']} cores, "
              f"python {m['python']}, torch {m['torch']}")
        print(f"workload: {self.nimg} JPEGs {self.size}x{self.size} -> RandomResizedCrop "
              f"{_workload().CROP} + flip, batch "
              f"{a.batch_size}, {a.warmup}+{a.batches} batches per consumer, "
              f"{a.workers} worker(s) per independent loader, shared loader "
              f"{', '.join(f'N={n}: {self.producer_workers(n)}' for n in a.counts)} worker(s), "
              f"model {cal['model_params']} params, "
              f"1 thread per process, {a.repeats} repeat(s), loader workers' malloc "
              + (f"M_TOP_PAD={a.worker_top_pad}" if a.worker_top_pad else "defaults")
              + f", shared producer worker_heap_pad={self.producer_heap_pad}")
        print(f"calibration (CPU time): loader {cal['loader_ms_per_batch']:.1f} ms/batch "
              f"(a forked process, heap padded), train {cal['train_ms_per_batch']:.1f} "
              f"ms/batch: a training process consumes {cal['train_over_loader']:.2f}x what "
              f"one loader worker produces ("
              f"{'loader-bound' if cal['loader_bound_one_worker'] else 'NOT loader-bound'})",
              flush=True)

    def run_all(self) -> list[dict]:
        """Every (repeat, N, mode), interleaved so that drifting load hits all modes."""
        a = self.args
        plan = [(rep, n, mode) for rep in range(a.repeats) for n in a.counts
                for mode in a.modes]
        runs = []
        for i, (rep, n, mode) in enumerate(plan):
            spec = self.spec(rep, n, mode)
            log(f"[{i + 1}/{len(plan)}] {mode} N={n} repeat {rep + 1}/{a.repeats} "
                f"(elapsed {time.monotonic() - self.t0:.0f} s) ...")
            runs.append(run_once(spec))
            _log_run(runs[-1])
        return runs

    def document(self, argv: list[str] | None, runs: list[dict], summary: list[dict]) -> dict:
        """The JSON document (schema in the module docstring)."""
        a, wl = self.args, _workload()
        return {
            "schema": "tensorsocket-collocated/2",
            "started": self.started,
            "argv": sys.argv[1:] if argv is None else argv,
            "quick": a.quick,
            "repeats": a.repeats,
            "config": {
                "consumers": a.counts, "modes": a.modes, "batch_size": a.batch_size,
                "warmup_batches": a.warmup, "measured_batches": a.batches,
                "samples_per_epoch": (a.warmup + a.batches) * a.batch_size,
                "workers": a.workers, "image_size": self.size, "num_images": self.nimg,
                "producer_workers": {str(n): self.producer_workers(n) for n in a.counts},
                "crop": wl.CROP, "threads_per_process": 1, "seed": SEED,
                "poll_interval_s": POLL_S, "worker_top_pad": a.worker_top_pad,
                "producer_worker_heap_pad": self.producer_heap_pad,
            },
            "machine": self.machine,
            "calibration": self.cal,
            "runs": runs,
            "summary": summary,
        }


def _log_run(r: dict) -> None:
    """One run's figures (or failure), on stderr."""
    if r["ok"] or r.get("check_failed"):
        cps = r["cpu_s_per_sample"]
        other = r.get("other_load_cores")
        log(f"    {r['wall_s']:.1f} s: {fmt_spec(r['aggregate_samples_per_s'], '.1f')} "
            f"samples/s, {fmt_spec(cps and cps * 1e3, '.2f')} CPU ms/sample, peak RSS "
            f"{fmt_spec(r['peak_rss_total_mb'], '.0f')} MB, run used "
            f"{fmt_spec(r.get('run_cores'), '.2f')} cores"
            + (f", OTHER LOAD {other:.2f} cores" if other and other > OTHER_LOAD_WARN
               else "")
            + ("" if r["ok"] else f"  [{r['error']}]"))
    else:
        log(f"    FAILED after {r['wall_s']:.1f} s: {r['error'][:500]}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    suite = Suite(args)
    suite.print_header()
    runs = suite.run_all()
    compare_data(runs)
    summary = summarize(runs, args.modes, args.counts)
    print_table(summary, args.repeats)
    suite.machine["loadavg_end"] = list(os.getloadavg())
    log(f"done in {time.monotonic() - suite.t0:.0f} s")
    if args.json:
        write_json(args.json, suite.document(argv, runs, summary))
    return 0


if __name__ == "__main__":
    dispatch({role: child_main for role in ROLES}, main)
