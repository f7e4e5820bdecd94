"""Handoff benchmark: how fast does a batch get from the producer to its consumers?

    python benchmarks/handoff.py [--quick] [--repeats N] [--kinds tiny,32MiB]
                                 [--consumers 1,2,4] [--json PATH] [--with-original]

Runs one producer process and N consumer processes (real, separate processes
started with ``subprocess`` and ``sys.executable``) for two batch shapes:

  tiny    a tuple (float32 (8, 16), int64 (8,)): 576 bytes, per-batch overhead
  32MiB   one uint8 tensor (32, 1024, 1024): bandwidth

with 1, 2 and 4 consumers; 20000 tiny and 200 32 MiB batches per run (10x
fewer with --quick), each configuration 3 times (1 with --quick).

The workload (shared with original_handoff.py, which runs the same through
the original TensorSocket 0.0.5): the producer's loader yields pre-made
tensors and only stamps the batch counter into them (tiny: int64 element
``batch[1][0]``; 32 MiB: the counter's 4 little-endian bytes at the first byte
of pages 0-3, every other byte is 7), so loader cost is ~0 and what is
measured is the handoff (here: the producer's copy into the ring plus the
consumer's acquire/decode/release).

Each consumer times from its first batch to its last, touching every batch
(tiny: one element, the counter; 32 MiB: one byte per 4 KiB page, which also
pays for any page faults of the zero-copy mapping, plus the counter bytes) and
checks the counters (each consumer must see 0, 1, ..., batches-1: missing,
duplicated or corrupt batches are reported as an error). It prints one JSON
line on stdout. For each configuration the median over consumers is taken,
and over the repeats the median of those.

A baseline is measured in the same run, in this (otherwise idle) process: a
single-threaded ``np.copyto`` of the same bytes into a preallocated buffer. For 32 MiB
also: np.copyto rotating over as many buffers as the ring has slots, and the ring's own
copy routine alone (``_core.copy_stream``: streaming stores, which the ring uses for long
runs into a ring bigger than the cache) rotating likewise, so that the handoff's cost
beyond its one copy shows apart from the copy routine's speed.

``--with-original`` then runs original_handoff.py's suite (the same
workloads through the original TensorSocket 0.0.5 from PyPI, in its own
cached venv) and prints one table: ours, original, ours/original, memcpy.

JSON (``--json PATH``; original_handoff.py writes the same schema)::

  {
    "schema": "tensorsocket-handoff/2",
    "implementation": "tensorsocket (this checkout)" | "tensorsocket 0.0.5 (original, PyPI)",
    "machine": {python, platform, cpus, cpus_usable, cpu_model, mem_total_gb,
                mem_available_gb, loadavg_start, loadavg_end, torch, numpy, pyzmq},
    "settings": {quick, repeats, kinds, consumer_counts, batches: {kind: n},
                 batch_bytes: {kind: n}, timeouts..., + implementation-specific
                 (ring_slots here; producer_batch_size etc. for the original)},
    "baselines": {kind: {gb_per_s, copies_per_s, us_per_copy,
                         rotating_gb_per_s, stream_gb_per_s, stream_is_streaming
                         (32MiB only), runs: [per repeat]}},
    "results": [                               # one per (kind, consumers)
      {"kind", "batch_bytes", "consumers", "batches", "repeats",
       "batches_per_s",        # per consumer: median over consumers, median over repeats
       "gb_per_s",             # batches_per_s * batch_bytes / 1e9
       "us_per_batch",         # 1e6 / batches_per_s (tiny: the per-batch overhead)
       "batches_per_s_runs", "gb_per_s_runs", "us_per_batch_runs",  # raw, per repeat
       "memcpy_gb_per_s", "memcpy_us_per_copy", "memcpy_copies_per_s",
       "ratio_vs_memcpy",      # gb_per_s / memcpy_gb_per_s (per consumer)
       "memcpy_rotating_gb_per_s", "ratio_vs_rotating_memcpy",   # 32MiB only, else null
       "stream_copy_gb_per_s", "ratio_vs_stream_copy",  # the ring's streaming copy alone,
                               # rotating over the same dsts (32MiB only, else null)
       "error",                # null, or the first failed repeat's error text
       "errors",               # per repeat: null or error text
       "notes",                # remarks that are not failures (e.g. a hung join())
       "runs": [{"repeat", "seconds", "error", "notes", "median_batches_per_s",
                 "median_gb_per_s", "consumers": [per-consumer report],
                 "producer": {producer report}}]}
    ],
    "verdicts": [{"target", "value", "ok"}],  # ok: true / false / null (not measurable)
    # only with --with-original:
    "original": {the same document for the original, without verdicts},
    "comparison": [{"kind", "consumers",
                    "ours_batches_per_s", "original_batches_per_s", "ours_over_original",
                    "ours_gb_per_s", "original_gb_per_s", "ours_us_per_batch",
                    "original_us_per_batch", "memcpy_gb_per_s", "memcpy_us_per_copy",
                    "ours_ratio_vs_memcpy", "original_ratio_vs_memcpy",
                    "ours_error", "original_error"}]
  }

Numbers are null where a configuration produced none (every repeat failed);
a per-consumer report holds batches, seconds, batches_per_s, gb_per_s,
first_counter, last_counter, missing, duplicates, corrupt, first_anomaly
(the original's also error, rc, max_rss_mb); the producer report here holds
batches, seconds, wait_seconds, bytes_copied, drained (the original's: see
original_handoff.py).

The script re-invokes itself with the hidden roles ``_producer`` and
``_consumer`` for the child processes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCHEMA = "tensorsocket-handoff/2"
PAGE = 4096
LARGE_SHAPE = (32, 1024, 1024)  # uint8: 32 MiB
TINY_SHAPES = ((8, 16), (8,))  # float32, int64
KINDS = ("tiny", "32MiB")
CONSUMER_COUNTS = (1, 2, 4)
FULL_BATCHES = {"tiny": 20000, "32MiB": 200}
QUICK_DIVISOR = 10
RING_SLOTS = 4
COUNTER_BYTES = 4  # 32 MiB batch: the counter's bytes, one at the start of each of pages 0-3
FILL = 7  # 32 MiB batch: every other byte

TARGET_TINY_BPS = 20000.0  # batches/s to one consumer
TARGET_LARGE_RATIO = 0.8  # consumer GB/s / memcpy GB/s, per consumer
TARGET_FLAT = 0.8  # 32 MiB per-consumer GB/s at N consumers / at 1 consumer
TARGET_VS_ORIGINAL = {"tiny": 10.0, "32MiB": 2.0}  # ours / original batches/s

# Timeouts (seconds). Every wait in this script has one.
ATTACH_TIMEOUT = 30.0  # consumer -> producer handshake
START_TIMEOUT = 60.0  # producer waits this long for min_consumers
BATCH_TIMEOUT = 60.0  # consumer waits this long for one batch
PUBLISH_TIMEOUT = 60.0  # producer waits this long for a free slot
JOIN_TIMEOUT = 60.0  # producer waits this long for consumers to drain
RUN_TIMEOUT = 600.0  # one whole configuration, from the orchestrator
KILL_GRACE = 5.0


# -- the workload (shared with original_handoff.py) --------------------------------------


def make_batch(kind: str):
    """A pre-made batch of this kind (its counter, where stamped, aside)."""
    import torch

    if kind == "tiny":
        return (
            torch.arange(128, dtype=torch.float32).reshape(TINY_SHAPES[0]),
            torch.arange(8, dtype=torch.int64),
        )
    if kind == "32MiB":
        t = torch.empty(LARGE_SHAPE, dtype=torch.uint8)
        t.view(-1)[::PAGE] = 1  # fault every page in once, before timing
        t.fill_(FILL)
        return (t,)
    raise ValueError(f"unknown kind {kind!r}")


def batch_bytes(kind: str) -> int:
    if kind == "tiny":
        return 8 * 16 * 4 + 8 * 8
    n = 1
    for d in LARGE_SHAPE:
        n *= d
    return n


def _stamper(kind: str, batch):
    """A function that writes the batch counter into `batch` in place (~0.1-1 us)."""
    if kind == "tiny":
        view = batch[1].numpy()

        def stamp(i: int) -> None:
            view[0] = i
    else:
        flat = batch[0].view(-1).numpy()
        where = slice(0, COUNTER_BYTES * PAGE, PAGE)

        def stamp(i: int) -> None:
            flat[where] = (i & 255, (i >> 8) & 255, (i >> 16) & 255, (i >> 24) & 255)
    return stamp


class CountingLoader:
    """A loader of `n` batches: pre-made tensors with the batch counter stamped in.

    `copies` pre-made batches are used in rotation, for a producer that keeps
    references to the loader's batches for a while (the original's rubber-band
    buffer); this project's producer copies each batch before taking the next
    one, so one copy suffices there.
    """

    def __init__(self, kind: str, n: int, copies: int = 1) -> None:
        self.kind = kind
        self.n = n
        self.batch_size = None
        self.batches = [make_batch(kind) for _ in range(max(1, copies))]
        self._stamps = [_stamper(kind, b) for b in self.batches]
        self.yielded = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        batches, stamps, k = self.batches, self._stamps, len(self.batches)
        for i in range(self.n):
            j = i % k
            stamps[j](i)
            self.yielded += 1
            yield batches[j]


def touch_fn(kind: str):
    """The consumer's touch: reads the batch and returns (counter, content_ok)."""
    if kind == "tiny":
        def touch(batch) -> tuple[int, bool]:
            return int(batch[1][0]), True  # one element: the counter
        return touch
    rest = FILL * (batch_bytes(kind) // PAGE - COUNTER_BYTES)

    def touch(batch) -> tuple[int, bool]:
        pages = batch[0].view(-1)[::PAGE]  # one byte per 4 KiB page
        total = int(pages.sum())
        head = pages[:COUNTER_BYTES].tolist()
        counter = head[0] | head[1] << 8 | head[2] << 16 | head[3] << 24
        return counter, total == rest + sum(head)
    return touch


class Tally:
    """What one consumer saw: batch count, first/last time, counter anomalies.

    Its attributes are updated after every batch, so that a watchdog thread
    can report progress.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.n = 0
        self.t_first = 0.0
        self.t_last = 0.0
        self.first = None
        self.last = -1
        self.missing = 0
        self.duplicates = 0
        self.corrupt = 0
        self.first_anomaly = None

    def consume(self, iterable, unwrap=None) -> None:
        """Iterate `iterable` to its end, touching and checking every batch."""
        touch = touch_fn(self.kind)
        for item in iterable:
            counter, ok = touch(item if unwrap is None else unwrap(item))
            t = time.perf_counter()
            if self.n == 0:
                self.t_first = t
                self.first = counter
            self.t_last = t
            self.n += 1
            if counter != self.last + 1 or not ok:
                self._anomaly(counter, ok)
            self.last = counter
            del item  # release the slot before waiting for the next one

    def _anomaly(self, counter: int, ok: bool) -> None:
        expected = self.last + 1
        if not ok:
            self.corrupt += 1
            what = f"batch {self.n - 1} (counter {counter}): wrong page bytes"
        elif counter > expected:
            self.missing += counter - expected
            what = f"batch {self.n - 1}: counter {counter}, expected {expected}"
        else:
            self.duplicates += 1
            what = f"batch {self.n - 1}: counter {counter} again (expected {expected})"
        if self.first_anomaly is None:
            self.first_anomaly = what

    def report(self, **extra) -> dict:
        seconds = self.t_last - self.t_first
        bps = (self.n - 1) / seconds if self.n > 1 and seconds > 0 else 0.0
        return {
            "role": "consumer",
            "pid": os.getpid(),
            "batches": self.n,
            "seconds": seconds,
            "batches_per_s": bps,
            "gb_per_s": bps * batch_bytes(self.kind) / 1e9,
            "first_counter": self.first,
            "last_counter": self.last if self.n else None,
            "missing": self.missing,
            "duplicates": self.duplicates,
            "corrupt": self.corrupt,
            "first_anomaly": self.first_anomaly,
            **extra,
        }


def check_reports(reports: list[dict], kind: str, batches: int, consumers: int) -> str | None:
    """None if every consumer got batches 0..batches-1 exactly once, intact; else why not."""
    problems = []
    if len(reports) != consumers:
        problems.append(f"{len(reports)} of {consumers} consumers reported")
    for i, r in enumerate(reports):
        who = f"consumer {i + 1}/{consumers}"
        if r.get("error"):
            problems.append(f"{who}: {r['error']}")
            continue
        bad = []
        if r["batches"] != batches:
            bad.append(f"got {r['batches']} of {batches} batches")
        if r["missing"] or r["duplicates"] or r["corrupt"]:
            bad.append(f"{r['missing']} missing, {r['duplicates']} duplicated, "
                       f"{r['corrupt']} corrupt ({r['first_anomaly']})")
        if r["batches"] and (r["first_counter"] != 0 or r["last_counter"] != batches - 1):
            bad.append(f"counters {r['first_counter']}..{r['last_counter']}, "
                       f"expected 0..{batches - 1}")
        if bad:
            problems.append(f"{who}: " + "; ".join(bad))
    return "; ".join(problems) or None


# -- child: producer -------------------------------------------------------------------


def run_producer(args: argparse.Namespace) -> int:
    from tensorsocket import TensorProducer

    loader = CountingLoader(args.kind, args.batches)
    producer = TensorProducer(
        loader,
        name=args.name,
        min_consumers=args.consumers,
        ring_slots=RING_SLOTS,
        start_timeout=START_TIMEOUT,
        publish_timeout=PUBLISH_TIMEOUT,
    )
    try:
        # Tell the orchestrator the control socket is bound.
        print(json.dumps({"role": "producer", "ready": True}), flush=True)
        t0 = None
        n = 0
        for _ in producer:
            if t0 is None:
                t0 = time.perf_counter()  # after the consumers attached
            n += 1
        t1 = time.perf_counter()
        stats = producer.stats()
        drained = producer.join(timeout=JOIN_TIMEOUT)
    finally:
        producer.close()
    print(json.dumps({
        "role": "producer",
        "batches": n,
        "seconds": t1 - (t0 or t1),
        "wait_seconds": stats["wait_seconds"],
        "bytes_copied": stats["bytes_copied"],
        "drained": drained,
    }), flush=True)
    return 0


# -- child: consumer -------------------------------------------------------------------


def run_consumer(args: argparse.Namespace) -> int:
    from tensorsocket import TensorConsumer

    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()

    consumer = TensorConsumer(name=args.name, timeout=ATTACH_TIMEOUT,
                              batch_timeout=BATCH_TIMEOUT)
    tally = Tally(args.kind)
    try:
        if profiler is not None:
            profiler.enable()
        tally.consume(consumer)
        if profiler is not None:
            profiler.disable()
    finally:
        consumer.close()
    if profiler is not None:
        profiler.dump_stats(f"{args.profile}.{os.getpid()}")
    print(json.dumps(tally.report()), flush=True)
    return 0


# -- orchestrator helpers (shared with original_handoff.py) -----------------------------


def _child_cmd(role: str, *extra: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), role, *extra]


def _json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def _kill_all(procs: list[subprocess.Popen]) -> None:
    """Terminate, then kill, every child still running; reap all of them."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + KILL_GRACE
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            try:
                p.wait(timeout=KILL_GRACE)
            except subprocess.TimeoutExpired:
                pass


def _tail(text: str, lines: int = 8, chars: int = 2000) -> str:
    """The last lines of a child's stderr, for an error message."""
    return "\n".join(text.strip().splitlines()[-lines:])[-chars:]


def _remove_leftovers(name: str) -> None:
    """Remove what a producer of this (unique, ours only) name may have left."""
    from tensorsocket.clean import remove_leftovers

    remove_leftovers(name)


def _read_ready(proc: subprocess.Popen, timeout: float) -> None:
    """Wait for the producer's 'ready' line (with a timeout)."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"producer not ready within {timeout} s")
            if not sel.select(left):
                continue
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"producer exited early (rc={proc.wait(timeout=KILL_GRACE)})")
            if '"ready"' in line:
                return
    finally:
        sel.close()


# -- orchestrator: one configuration of ours ---------------------------------------------


def run_config(kind: str, consumers: int, batches: int, tag: str,
               profile: str | None = None) -> dict:
    """One producer + `consumers` consumers for `batches` batches.

    Returns {"consumers": [reports], "producer": report or None, "error": None or text}.
    """
    name = f"bench-handoff-{os.getpid()}-{tag}"
    procs: list[subprocess.Popen] = []
    reports: list[dict] = []
    preport = None
    error = None
    try:
        producer = subprocess.Popen(
            _child_cmd("_producer", "--name", name, "--kind", kind,
                       "--batches", str(batches), "--consumers", str(consumers)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        procs.append(producer)
        _read_ready(producer, ATTACH_TIMEOUT)
        cons = []
        for _ in range(consumers):
            extra = ["--profile", profile] if profile else []
            c = subprocess.Popen(
                _child_cmd("_consumer", "--name", name, "--kind", kind, *extra),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            procs.append(c)
            cons.append(c)
        deadline = time.monotonic() + RUN_TIMEOUT
        for c in cons:
            out, err = c.communicate(timeout=max(1.0, deadline - time.monotonic()))
            lines = [r for r in _json_lines(out) if r.get("role") == "consumer"]
            if c.returncode != 0 or not lines:
                raise RuntimeError(f"consumer failed (rc={c.returncode}): {_tail(err)}")
            reports.append(lines[-1])
        out, err = producer.communicate(timeout=max(1.0, deadline - time.monotonic()))
        plines = [r for r in _json_lines(out) if "batches" in r]
        if producer.returncode != 0 or not plines:
            raise RuntimeError(f"producer failed (rc={producer.returncode}): {_tail(err)}")
        preport = plines[-1]
    except subprocess.TimeoutExpired:
        error = f"configuration not finished within {RUN_TIMEOUT:.0f} s"
    except Exception as e:  # recorded as this configuration's result
        error = f"{type(e).__name__}: {e}"
    finally:
        _kill_all(procs)
        _remove_leftovers(name)
    if error is None:
        error = check_reports(reports, kind, batches, consumers)
    return {"consumers": reports, "producer": preport, "error": error}


# -- memcpy baseline and machine ---------------------------------------------------------


def memcpy_baseline(kind: str, min_seconds: float) -> dict:
    """Single-threaded np.copyto of the batch's bytes into a preallocated buffer."""
    import numpy as np

    if kind == "32MiB":
        src = np.full(batch_bytes(kind), FILL, dtype=np.uint8)
        # Written once, so every page is faulted in before timing.
        dsts = [np.ones_like(src) for _ in range(RING_SLOTS)]

        def timed(targets: list, copy=np.copyto) -> float:
            for d in targets:
                copy(d, src)
            samples = []
            t_end = time.perf_counter() + min_seconds / 2
            while len(samples) < 20 or time.perf_counter() < t_end:
                d = targets[len(samples) % len(targets)]
                t0 = time.perf_counter()
                copy(d, src)
                samples.append(time.perf_counter() - t0)
                if len(samples) >= 2000:
                    break
            return statistics.median(samples)

        # The baseline: the same 32 MiB buffer, preallocated, every time.
        per_copy = timed(dsts[:1])
        # For reference: rotating over RING_SLOTS destinations like the ring's
        # slots do (a destination that is not cache-warm).
        per_copy_rot = timed(dsts)
        # And the copy the ring fills large slots with (streaming stores, ts_copy.c),
        # rotating likewise: the limit of our one copy per batch on this machine.
        from tensorsocket import _core

        streamed = _core.copy_stream(dsts[0], src)
        per_copy_stream = timed(dsts, _core.copy_stream)
        del dsts
        return {
            "copies_per_s": 1.0 / per_copy,
            "gb_per_s": batch_bytes(kind) / per_copy / 1e9,
            "us_per_copy": per_copy * 1e6,
            "rotating_gb_per_s": batch_bytes(kind) / per_copy_rot / 1e9,
            "stream_gb_per_s": batch_bytes(kind) / per_copy_stream / 1e9,
            "stream_is_streaming": streamed,
        }
    srcs = [np.arange(128, dtype=np.float32).reshape(8, 16), np.arange(8, dtype=np.int64)]
    dsts = [np.empty_like(s) for s in srcs]
    a_src, b_src = srcs
    a_dst, b_dst = dsts
    inner = 10000
    samples = []
    t_end = time.perf_counter() + min_seconds
    while len(samples) < 5 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        for _ in range(inner):
            np.copyto(a_dst, a_src)
            np.copyto(b_dst, b_src)
        samples.append((time.perf_counter() - t0) / inner)
    per_copy = statistics.median(samples)
    return {
        "copies_per_s": 1.0 / per_copy,
        "gb_per_s": batch_bytes(kind) / per_copy / 1e9,
        "us_per_copy": per_copy * 1e6,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _meminfo_gb(field: str) -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return round(int(line.split()[1]) * 1024 / 1e9, 2)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict:
    """This machine and the packages of this interpreter (the orchestrator's)."""
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "cpu_model": _cpu_model(),
        "mem_total_gb": _meminfo_gb("MemTotal"),
        "mem_available_gb": _meminfo_gb("MemAvailable"),
        "loadavg_start": _loadavg(),
    }
    for mod in ("torch", "numpy", "zmq"):
        try:
            info["pyzmq" if mod == "zmq" else mod] = __import__(mod).__version__
        except Exception:  # an informational field only
            info["pyzmq" if mod == "zmq" else mod] = None
    return info


# -- the suite (shared with original_handoff.py) -----------------------------------------


def _median(xs):
    return statistics.median(xs) if xs else None


def _div(a, b):
    return a / b if a is not None and b else None


def parse_common(parser: argparse.ArgumentParser, argv: list[str] | None):
    """Parse the options both scripts share; return (args, kinds, counts, repeats, nbatches)."""
    args = parser.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    kinds = [k for k in args.kinds.split(",") if k]
    for k in kinds:
        if k not in KINDS:
            parser.error(f"unknown kind {k!r}")
    try:
        counts = [int(c) for c in args.consumers.split(",") if c]
    except ValueError:
        parser.error(f"bad --consumers {args.consumers!r}")
    if not counts or min(counts) < 1:
        parser.error("--consumers: counts >= 1")
    div = QUICK_DIVISOR if args.quick else 1
    nbatches = {k: max(2, FULL_BATCHES[k] // div) for k in KINDS}
    return args, kinds, counts, repeats, nbatches


def add_common_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_DIVISOR}x fewer batches and 1 repeat")
    parser.add_argument("--repeats", type=int, default=None,
                        help="repeats per configuration (default 3, 1 with --quick)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated subset of {','.join(KINDS)}")
    parser.add_argument("--consumers", default=",".join(map(str, CONSUMER_COUNTS)),
                        help="comma-separated consumer counts (default 1,2,4)")


def run_suite(config_fn, *, label: str, kinds: list[str], counts: list[int], repeats: int,
              nbatches: dict, quick: bool, settings: dict | None = None) -> dict:
    """Run config_fn(kind, consumers, batches, tag) for every configuration and
    repeat, with the memcpy baseline; the JSON document (see the module docstring)."""
    machine = machine_info()
    print(f"[{label}] python {machine['python']}, torch {machine['torch']}, "
          f"{machine['cpus']} CPUs ({machine['cpu_model']}), load {machine['loadavg_start']}")
    print(f"[{label}] batches per run: " + ", ".join(f"{k}={nbatches[k]}" for k in kinds)
          + f"; consumers {','.join(map(str, counts))}; repeats={repeats}", flush=True)
    runs: dict[tuple[str, int], list[dict]] = {(k, n): [] for k in kinds for n in counts}
    baselines: dict[str, list[dict]] = {k: [] for k in kinds}
    for rep in range(repeats):
        for kind in kinds:
            baselines[kind].append(memcpy_baseline(kind, 0.5 if quick else 1.0))
            for n in counts:
                t0 = time.perf_counter()
                try:
                    res = config_fn(kind, n, nbatches[kind], f"{kind}-{n}-{rep}")
                except Exception as e:  # never lose the whole run to one configuration
                    res = {"consumers": [], "producer": None,
                           "error": f"{type(e).__name__}: {e}"}
                seconds = time.perf_counter() - t0
                ok = res["error"] is None
                bps = _median([c["batches_per_s"] for c in res["consumers"]]) if ok else None
                runs[(kind, n)].append({
                    "repeat": rep,
                    "seconds": seconds,
                    "error": res["error"],
                    "median_batches_per_s": bps,
                    "median_gb_per_s": _div(bps * batch_bytes(kind), 1e9) if ok else None,
                    "consumers": res["consumers"],
                    "producer": res["producer"],
                    "notes": res.get("notes") or [],
                })
                what = f"{bps:12.1f} batches/s (median of {n})" if ok \
                    else f"FAILED: {_short(res['error'])}"
                print(f"  [{label} {rep + 1}/{repeats}] {kind:>5} x{n}: {what} "
                      f"(run {seconds:.1f} s)", flush=True)
    results = [summarize(kind, n, runs[(kind, n)], baselines[kind], nbatches[kind], repeats)
               for kind in kinds for n in counts]
    machine["loadavg_end"] = _loadavg()
    return {
        "schema": SCHEMA,
        "implementation": label,
        "machine": machine,
        "settings": {
            "quick": quick,
            "repeats": repeats,
            "kinds": kinds,
            "consumer_counts": counts,
            "batches": {k: nbatches[k] for k in kinds},
            "batch_bytes": {k: batch_bytes(k) for k in kinds},
            **(settings or {}),
        },
        "baselines": {k: _baseline_summary(baselines[k]) for k in kinds},
        "results": results,
    }


def _short(text: str | None, n: int = 160) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _baseline_summary(runs: list[dict]) -> dict:
    out = {key: _median([b[key] for b in runs if key in b])
           for key in ("gb_per_s", "copies_per_s", "us_per_copy", "rotating_gb_per_s",
                       "stream_gb_per_s")}
    out["runs"] = runs
    return out


def summarize(kind: str, n: int, runs: list[dict], baselines: list[dict], batches: int,
              repeats: int) -> dict:
    base = _baseline_summary(baselines)
    good = [r for r in runs if r["error"] is None]
    bps_runs = [r["median_batches_per_s"] for r in good]
    bps = _median(bps_runs)
    gbps = _div(bps * batch_bytes(kind), 1e9) if bps is not None else None
    errors = [r["error"] for r in runs]
    return {
        "kind": kind,
        "batch_bytes": batch_bytes(kind),
        "consumers": n,
        "batches": batches,
        "repeats": repeats,
        "batches_per_s": bps,
        "gb_per_s": gbps,
        "us_per_batch": _div(1e6, bps),
        "batches_per_s_runs": bps_runs,
        "gb_per_s_runs": [b * batch_bytes(kind) / 1e9 for b in bps_runs],
        "us_per_batch_runs": [_div(1e6, b) for b in bps_runs],
        "memcpy_gb_per_s": base["gb_per_s"],
        "memcpy_us_per_copy": base["us_per_copy"],
        "memcpy_copies_per_s": base["copies_per_s"],
        "ratio_vs_memcpy": _div(gbps, base["gb_per_s"]),
        "memcpy_rotating_gb_per_s": base["rotating_gb_per_s"],
        "ratio_vs_rotating_memcpy": _div(gbps, base["rotating_gb_per_s"]),
        "stream_copy_gb_per_s": base["stream_gb_per_s"],
        "ratio_vs_stream_copy": _div(gbps, base["stream_gb_per_s"]),
        "error": next((e for e in errors if e), None),
        "errors": errors,
        "notes": sorted({n for r in runs for n in r.get("notes", [])}),
        "runs": runs,
    }


# -- output ------------------------------------------------------------------------------


def _fmt(x, spec: str, width: int) -> str:
    return f"{'-' if x is None else format(x, spec):>{width}}"


def print_table(doc: dict) -> None:
    print()
    print(f"{doc['implementation']}: medians (per consumer: median over consumers, "
          "then over repeats)")
    hdr = (f"{'batch':>6} {'cons':>4} {'batches/s':>12} {'GB/s':>9} {'us/batch':>9} "
           f"{'memcpy GB/s':>12} {'us/copy':>8} {'ratio':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in doc["results"]:
        print(f"{r['kind']:>6} {r['consumers']:>4} {_fmt(r['batches_per_s'], '.1f', 12)} "
              f"{_fmt(r['gb_per_s'], '.3f', 9)} {_fmt(r['us_per_batch'], '.2f', 9)} "
              f"{_fmt(r['memcpy_gb_per_s'], '.3f', 12)} "
              f"{_fmt(r['memcpy_us_per_copy'], '.2f', 8)} "
              f"{_fmt(r['ratio_vs_memcpy'], '.3f', 7)}")
        if r["error"]:
            bad = sum(1 for e in r["errors"] if e)
            print(f"{'':>12}ERROR in {bad}/{len(r['errors'])} repeats: {_short(r['error'], 300)}")
        for note in r["notes"]:
            print(f"{'':>12}note: {_short(note, 300)}")
    print("(ratio = consumer GB/s / memcpy GB/s of the same bytes, per consumer; for tiny it is "
          "memcpy us/copy / us/batch)")
    for k, b in doc["baselines"].items():
        line = (f"memcpy baseline {k:>5}: {_fmt(b['gb_per_s'], '.3f', 0)} GB/s, "
                f"{_fmt(b['us_per_copy'], '.2f', 0)} us per copy (np.copyto, 1 thread, "
                "same preallocated dst)")
        if b.get("rotating_gb_per_s"):
            line += (f"; {b['rotating_gb_per_s']:.3f} GB/s rotating over {RING_SLOTS} "
                     "dsts (cache-cold, like the ring's slots)")
        if b.get("stream_gb_per_s"):
            one = _by_key(doc["results"]).get((k, 1), {}).get("gb_per_s")
            line += (f"; {b['stream_gb_per_s']:.3f} GB/s with the ring's own streaming copy "
                     f"rotating likewise (ours at 1 consumer: "
                     f"{_fmt(_div(one, b['stream_gb_per_s']), '.3f', 0)}x of it)")
        print(line)


def _by_key(results: list[dict]) -> dict:
    return {(r["kind"], r["consumers"]): r for r in results}


def verdicts(ours: dict, original: dict | None = None) -> list[dict]:
    """The targets, each {"target", "value", "ok"} (ok None: not measurable)."""
    out = []
    res = ours["results"]
    for r in res:
        if r["kind"] == "32MiB":
            v = r["ratio_vs_memcpy"]
            out.append({"target": f"ours 32MiB x{r['consumers']}: per-consumer GB/s / memcpy "
                                  f">= {TARGET_LARGE_RATIO}",
                        "value": v, "ok": None if v is None else v >= TARGET_LARGE_RATIO})
    large = {r["consumers"]: r for r in res if r["kind"] == "32MiB"}
    if 1 in large and len(large) > 1:
        base = large[1]["gb_per_s"]
        worst = min((r for n, r in large.items() if n != 1),
                    key=lambda r: r["gb_per_s"] if r["gb_per_s"] is not None else -1)
        v = _div(worst["gb_per_s"], base)
        out.append({"target": f"ours 32MiB flat in N: min over N>1 of per-consumer GB/s / "
                              f"GB/s at 1 consumer >= {TARGET_FLAT} (worst: "
                              f"x{worst['consumers']})",
                    "value": v, "ok": None if v is None else v >= TARGET_FLAT})
    for r in res:
        if r["kind"] == "tiny":
            v = r["batches_per_s"]
            out.append({"target": f"ours tiny x{r['consumers']}: batches/s per consumer >= "
                                  f"{TARGET_TINY_BPS:.0f}",
                        "value": v, "ok": None if v is None else v >= TARGET_TINY_BPS})
    if original is not None:
        orig = _by_key(original["results"])
        for r in res:
            o = orig.get((r["kind"], r["consumers"]))
            if o is None:
                continue
            target = TARGET_VS_ORIGINAL[r["kind"]]
            v = _div(r["batches_per_s"], o["batches_per_s"])
            name = (f"ours/original {r['kind']} x{r['consumers']} (batches/s per consumer) "
                    f">= {target:g}")
            if v is None and o["error"] and r["batches_per_s"] is not None:
                name += f" [original failed: {_short(o['error'], 120)}]"
            out.append({"target": name, "value": v,
                        "ok": None if v is None else v >= target})
    return out


def print_verdicts(items: list[dict]) -> None:
    print()
    print("targets:")
    for v in items:
        state = {True: "OK", False: "BELOW TARGET", None: "NOT MEASURED"}[v["ok"]]
        val = "-" if v["value"] is None else (f"{v['value']:.1f}" if v["value"] >= 100
                                              else f"{v['value']:.3f}")
        print(f"  {state:>12}  {val:>10}  {v['target']}")


def comparison(ours: dict, original: dict) -> list[dict]:
    orig = _by_key(original["results"])
    rows = []
    for r in ours["results"]:
        o = orig.get((r["kind"], r["consumers"]), {})
        rows.append({
            "kind": r["kind"],
            "consumers": r["consumers"],
            "ours_batches_per_s": r["batches_per_s"],
            "original_batches_per_s": o.get("batches_per_s"),
            "ours_gb_per_s": r["gb_per_s"],
            "original_gb_per_s": o.get("gb_per_s"),
            "ours_us_per_batch": r["us_per_batch"],
            "original_us_per_batch": o.get("us_per_batch"),
            "ours_over_original": _div(r["batches_per_s"], o.get("batches_per_s")),
            "memcpy_gb_per_s": r["memcpy_gb_per_s"],
            "memcpy_us_per_copy": r["memcpy_us_per_copy"],
            "ours_ratio_vs_memcpy": r["ratio_vs_memcpy"],
            "original_ratio_vs_memcpy": o.get("ratio_vs_memcpy"),
            "ours_error": r["error"],
            "original_error": o.get("error"),
        })
    return rows


def print_comparison(rows: list[dict]) -> None:
    print()
    print("ours vs original TensorSocket 0.0.5 (per consumer; medians over consumers, then "
          "repeats)")
    hdr = (f"{'batch':>6} {'cons':>4} | {'ours b/s':>10} {'GB/s':>7} {'us/b':>8} | "
           f"{'orig b/s':>10} {'GB/s':>7} {'us/b':>8} | {'ours/orig':>9} | "
           f"{'memcpy GB/s':>11} {'us/copy':>7} {'ours/memcpy':>11}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['kind']:>6} {r['consumers']:>4} | "
              f"{_fmt(r['ours_batches_per_s'], '.1f', 10)} {_fmt(r['ours_gb_per_s'], '.3f', 7)} "
              f"{_fmt(r['ours_us_per_batch'], '.1f', 8)} | "
              f"{_fmt(r['original_batches_per_s'], '.1f', 10)} "
              f"{_fmt(r['original_gb_per_s'], '.3f', 7)} "
              f"{_fmt(r['original_us_per_batch'], '.1f', 8)} | "
              f"{_fmt(r['ours_over_original'], '.1f', 9)} | "
              f"{_fmt(r['memcpy_gb_per_s'], '.3f', 11)} {_fmt(r['memcpy_us_per_copy'], '.2f', 7)} "
              f"{_fmt(r['ours_ratio_vs_memcpy'], '.3f', 11)}")
        for who in ("ours", "original"):
            if r[f"{who}_error"]:
                print(f"{'':>12}{who} ERROR: {_short(r[who + '_error'], 300)}")


# -- main --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_options(parser)
    parser.add_argument("--with-original", action="store_true",
                        help="then run the same through the original TensorSocket 0.0.5 "
                             "(original_handoff.py) and print one comparison table")
    parser.add_argument("--profile", metavar="PREFIX",
                        help="cProfile every consumer (ours); stats go to PREFIX.<pid>")
    args, kinds, counts, repeats, nbatches = parse_common(parser, argv)

    def config_fn(kind, n, batches, tag):
        return run_config(kind, n, batches, tag, args.profile)

    ours = run_suite(config_fn, label="tensorsocket (this checkout)", kinds=kinds,
                     counts=counts, repeats=repeats, nbatches=nbatches, quick=args.quick,
                     settings={"ring_slots": RING_SLOTS, "timeouts": _timeouts()})
    print_table(ours)
    original = None
    if args.with_original:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import original_handoff

        print()
        original = original_handoff.run_original(kinds=kinds, counts=counts, repeats=repeats,
                                                 nbatches=nbatches, quick=args.quick)
        print_table(original)
        rows = comparison(ours, original)
        print_comparison(rows)
        ours["original"] = original
        ours["comparison"] = rows
    checks = verdicts(ours, original)
    print_verdicts(checks)
    ours["verdicts"] = checks

    if args.json:
        Path(args.json).write_text(json.dumps(ours, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if any(r["error"] for r in ours["results"]) else 0


def _timeouts() -> dict:
    return {"attach": ATTACH_TIMEOUT, "start": START_TIMEOUT, "batch": BATCH_TIMEOUT,
            "publish": PUBLISH_TIMEOUT, "join": JOIN_TIMEOUT, "run": RUN_TIMEOUT}


def _child_main(argv: list[str]) -> int:
    role = argv[0]
    # On SIGTERM from the orchestrator, unwind normally so that the producer
    # unlinks its segment and the consumer says bye (finally blocks run).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    parser = argparse.ArgumentParser(prog=f"handoff.py {role}")
    parser.add_argument("--name", required=True)
    parser.add_argument("--kind", required=True, choices=KINDS)
    parser.add_argument("--batches", type=int, default=0)
    parser.add_argument("--consumers", type=int, default=1)
    parser.add_argument("--profile", default=None)
    args = parser.parse_args(argv[1:])
    if role == "_producer":
        return run_producer(args)
    return run_consumer(args)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("_producer", "_consumer"):
        sys.exit(_child_main(sys.argv[1:]))
    sys.exit(main())
