"""Handoff benchmark: how fast does a batch get from the producer to its consumers?

    python benchmarks/handoff.py [--quick] [--repeats N] [--json PATH]

Runs one producer process and N consumer processes (real, separate processes
started with ``subprocess`` and ``sys.executable``) for two batch shapes:

  tiny    a tuple (float32 (8, 16), int64 (8,)): 576 bytes, per-batch overhead
  32MiB   one uint8 tensor (32, 1024, 1024): bandwidth

with 1 and 4 consumers. The producer's loader yields the same pre-made
tensors every time, so loader cost is ~0 and what is measured is the handoff
(the producer's copy into the ring plus the consumer's acquire/decode/release).

Each consumer times from its first batch to its last, touching every batch
(tiny: one element; 32 MiB: one byte per 4 KiB page, which also pays for any
page faults of the zero-copy mapping), and prints one JSON line on stdout.
For each configuration the median over consumers is taken, and over the
repeats the median of those.

A baseline is measured in the same run, in this (otherwise idle) process: a
single-threaded ``np.copyto`` of the same bytes into a preallocated buffer.

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

PAGE = 4096
LARGE_SHAPE = (32, 1024, 1024)  # uint8: 32 MiB
TINY_SHAPES = ((8, 16), (8,))  # float32, int64
KINDS = ("tiny", "32MiB")
CONSUMER_COUNTS = (1, 4)
FULL_BATCHES = {"tiny": 20000, "32MiB": 200}
QUICK_DIVISOR = 10
RING_SLOTS = 4

TARGET_TINY_BPS = 20000.0  # batches/s to one consumer
TARGET_LARGE_RATIO = 0.8  # consumer GB/s / memcpy GB/s, per consumer

# Timeouts (seconds). Every wait in this script has one.
ATTACH_TIMEOUT = 30.0  # consumer -> producer handshake
START_TIMEOUT = 60.0  # producer waits this long for min_consumers
BATCH_TIMEOUT = 60.0  # consumer waits this long for one batch
PUBLISH_TIMEOUT = 60.0  # producer waits this long for a free slot
JOIN_TIMEOUT = 60.0  # producer waits this long for consumers to drain
RUN_TIMEOUT = 600.0  # one whole configuration, from the orchestrator
KILL_GRACE = 5.0


def make_batch(kind: str):
    """The pre-made batch of this kind (same tensors every time)."""
    import torch

    if kind == "tiny":
        return (
            torch.arange(128, dtype=torch.float32).reshape(TINY_SHAPES[0]),
            torch.arange(8, dtype=torch.int64),
        )
    if kind == "32MiB":
        t = torch.empty(LARGE_SHAPE, dtype=torch.uint8)
        t.view(-1)[::PAGE] = 1  # fault every page in once, before timing
        t.fill_(7)
        return (t,)
    raise ValueError(f"unknown kind {kind!r}")


def expected_checksum(kind: str, batches: int) -> int:
    """What a consumer's touches add up to over `batches` batches of make_batch(kind)."""
    if kind == "tiny":  # batch[1][n & 7] == n & 7
        return sum(i & 7 for i in range(batches))
    return batches * 7 * (batch_bytes(kind) // PAGE)  # every byte is 7


def batch_bytes(kind: str) -> int:
    if kind == "tiny":
        return 8 * 16 * 4 + 8 * 8
    n = 1
    for d in LARGE_SHAPE:
        n *= d
    return n


# -- child: producer -------------------------------------------------------------------


class RepeatLoader:
    """A loader that yields the same batch `n` times (loader cost ~0)."""

    def __init__(self, batch, n: int) -> None:
        self.batch = batch
        self.n = n
        self.batch_size = None

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        batch = self.batch
        for _ in range(self.n):
            yield batch


def run_producer(args: argparse.Namespace) -> int:
    from tensorsocket import TensorProducer

    loader = RepeatLoader(make_batch(args.kind), args.batches)
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
    large = args.kind == "32MiB"
    checksum = 0
    n = 0
    t_first = t_last = 0.0
    try:
        if profiler is not None:
            profiler.enable()
        for batch in consumer:
            # Touch the data: cheap, but proves access (and pays page faults).
            if large:
                checksum += int(batch[0].view(-1)[::PAGE].sum())
            else:
                checksum += int(batch[1][n & 7])
            t_last = time.perf_counter()
            if n == 0:
                t_first = t_last
            n += 1
            del batch  # release the slot before waiting for the next one
        if profiler is not None:
            profiler.disable()
    finally:
        consumer.close()
    if profiler is not None:
        profiler.dump_stats(f"{args.profile}.{os.getpid()}")
    seconds = t_last - t_first
    bps = (n - 1) / seconds if n > 1 and seconds > 0 else 0.0
    print(json.dumps({
        "role": "consumer",
        "pid": os.getpid(),
        "batches": n,
        "seconds": seconds,
        "batches_per_s": bps,
        "gb_per_s": bps * batch_bytes(args.kind) / 1e9,
        "checksum": checksum,
    }), flush=True)
    return 0


# -- orchestrator ----------------------------------------------------------------------


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


def _remove_leftovers(name: str) -> None:
    """Remove what a producer of this (unique, ours only) name may leave behind:
    its shm segment if it was killed, and the lock file and ipc socket file in
    the runtime directory (the library leaves those even after a clean join)."""
    from tensorsocket.endpoints import resolve, segment_prefix

    prefix = segment_prefix(name)
    try:
        for entry in os.listdir("/dev/shm"):
            if entry.startswith(prefix):
                try:
                    os.unlink(os.path.join("/dev/shm", entry))
                except OSError:
                    pass
    except OSError:
        pass
    try:
        rdir = resolve(name).runtime_dir
    except (OSError, ValueError):
        return
    for suffix in (".lock", ".sock"):
        try:
            (rdir / f"{name}{suffix}").unlink()
        except OSError:
            pass


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


def run_config(kind: str, consumers: int, batches: int, tag: str,
               profile: str | None = None) -> dict:
    """One producer + `consumers` consumers for `batches` batches; their reports."""
    name = f"bench-handoff-{os.getpid()}-{tag}"
    procs: list[subprocess.Popen] = []
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
        reports = []
        for c in cons:
            out, err = c.communicate(timeout=max(1.0, deadline - time.monotonic()))
            lines = [r for r in _json_lines(out) if r.get("role") == "consumer"]
            if c.returncode != 0 or not lines:
                raise RuntimeError(f"consumer failed (rc={c.returncode}):\n{err[-4000:]}")
            reports.append(lines[-1])
        out, err = producer.communicate(timeout=max(1.0, deadline - time.monotonic()))
        plines = [r for r in _json_lines(out) if "batches" in r]
        if producer.returncode != 0 or not plines:
            raise RuntimeError(f"producer failed (rc={producer.returncode}):\n{err[-4000:]}")
    finally:
        _kill_all(procs)
        _remove_leftovers(name)
    for r in reports:
        if r["batches"] != batches:
            raise RuntimeError(f"consumer got {r['batches']} of {batches} batches")
        if r["checksum"] != expected_checksum(kind, batches):
            raise RuntimeError(f"consumer read wrong data: checksum {r['checksum']}, "
                               f"expected {expected_checksum(kind, batches)}")
    return {"consumers": reports, "producer": plines[-1]}


def memcpy_baseline(kind: str, min_seconds: float) -> dict:
    """Single-threaded np.copyto of the batch's bytes into a preallocated buffer."""
    import numpy as np

    if kind == "32MiB":
        src = np.full(batch_bytes(kind), 7, dtype=np.uint8)
        # Written once, so every page is faulted in before timing.
        dsts = [np.ones_like(src) for _ in range(RING_SLOTS)]

        def timed(targets: list) -> float:
            for d in targets:
                np.copyto(d, src)
            samples = []
            t_end = time.perf_counter() + min_seconds / 2
            while len(samples) < 20 or time.perf_counter() < t_end:
                d = targets[len(samples) % len(targets)]
                t0 = time.perf_counter()
                np.copyto(d, src)
                samples.append(time.perf_counter() - t0)
                if len(samples) >= 2000:
                    break
            return statistics.median(samples)

        # The baseline: the same 32 MiB buffer, preallocated, every time.
        per_copy = timed(dsts[:1])
        # For reference: rotating over RING_SLOTS destinations like the ring's
        # slots do (a destination that is not cache-warm).
        per_copy_rot = timed(dsts)
        del dsts
        return {
            "copies_per_s": 1.0 / per_copy,
            "gb_per_s": batch_bytes(kind) / per_copy / 1e9,
            "us_per_copy": per_copy * 1e6,
            "rotating_gb_per_s": batch_bytes(kind) / per_copy_rot / 1e9,
        }
    else:
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


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="10x fewer batches and 1 repeat")
    parser.add_argument("--repeats", type=int, default=None,
                        help="repeats per configuration (default 3, 1 with --quick)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated subset of {','.join(KINDS)}")
    parser.add_argument("--consumers", default=",".join(map(str, CONSUMER_COUNTS)),
                        help="comma-separated consumer counts (default 1,4)")
    parser.add_argument("--profile", metavar="PREFIX",
                        help="cProfile every consumer; stats go to PREFIX.<pid>")
    args = parser.parse_args(argv)

    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    kinds = [k for k in args.kinds.split(",") if k]
    for k in kinds:
        if k not in KINDS:
            parser.error(f"unknown kind {k!r}")
    counts = [int(c) for c in args.consumers.split(",") if c]
    div = QUICK_DIVISOR if args.quick else 1
    nbatches = {k: max(2, FULL_BATCHES[k] // div) for k in KINDS}

    import torch

    print(f"handoff benchmark: python {platform.python_version()}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs, {_cpu_model()}")
    print("batches per run: " + ", ".join(f"{k}={nbatches[k]}" for k in kinds)
          + f"; repeats={repeats}; ring_slots={RING_SLOTS}")

    runs: dict[tuple[str, int], list[dict]] = {(k, n): [] for k in kinds for n in counts}
    baselines: dict[str, list[dict]] = {k: [] for k in kinds}
    for rep in range(repeats):
        for kind in kinds:
            baselines[kind].append(memcpy_baseline(kind, 0.5 if args.quick else 1.0))
            for n in counts:
                t0 = time.perf_counter()
                res = run_config(kind, n, nbatches[kind], f"{kind}-{n}-{rep}", args.profile)
                med_bps = _median([c["batches_per_s"] for c in res["consumers"]])
                runs[(kind, n)].append({
                    "median_batches_per_s": med_bps,
                    "median_gb_per_s": med_bps * batch_bytes(kind) / 1e9,
                    "consumers": res["consumers"],
                    "producer": res["producer"],
                })
                print(f"  [{rep + 1}/{repeats}] {kind:>5} x{n}: {med_bps:12.1f} batches/s "
                      f"(median of {n} consumers; run {time.perf_counter() - t0:.1f} s)",
                      flush=True)

    results = []
    for kind in kinds:
        base_gbps = _median([b["gb_per_s"] for b in baselines[kind]])
        base_cps = _median([b["copies_per_s"] for b in baselines[kind]])
        rot_gbps = _median([b["rotating_gb_per_s"] for b in baselines[kind]
                            if "rotating_gb_per_s" in b])
        for n in counts:
            bps = _median([r["median_batches_per_s"] for r in runs[(kind, n)]])
            gbps = bps * batch_bytes(kind) / 1e9
            results.append({
                "kind": kind,
                "batch_bytes": batch_bytes(kind),
                "consumers": n,
                "batches": nbatches[kind],
                "repeats": repeats,
                "batches_per_s": bps,
                "gb_per_s": gbps,
                "us_per_batch": 1e6 / bps if bps > 0 else float("inf"),
                "memcpy_gb_per_s": base_gbps,
                "memcpy_copies_per_s": base_cps,
                "ratio_vs_memcpy": gbps / base_gbps if base_gbps > 0 else float("nan"),
                "memcpy_rotating_gb_per_s": rot_gbps,
                "ratio_vs_rotating_memcpy": gbps / rot_gbps if rot_gbps > 0 else float("nan"),
                "runs": runs[(kind, n)],
            })

    _print_table(results, kinds, baselines)
    _print_verdicts(results)

    if args.json:
        doc = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "cpu_model": _cpu_model(),
            "quick": args.quick,
            "repeats": repeats,
            "ring_slots": RING_SLOTS,
            "baselines": {k: {"runs": baselines[k],
                              "gb_per_s": _median([b["gb_per_s"] for b in baselines[k]]),
                              "copies_per_s": _median([b["copies_per_s"]
                                                       for b in baselines[k]])}
                          for k in kinds},
            "results": results,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _print_table(results: list[dict], kinds: list[str], baselines: dict) -> None:
    print()
    print("medians (per consumer: median over consumers, then median over repeats)")
    hdr = (f"{'batch':>6} {'cons':>4} {'batches/s':>12} {'GB/s':>9} {'us/batch':>9} "
           f"{'memcpy GB/s':>12} {'ratio':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        if r["kind"] == "tiny":  # a bandwidth ratio means nothing for 576 bytes
            base, ratio = "-", "-"
        else:
            base, ratio = f"{r['memcpy_gb_per_s']:.3f}", f"{r['ratio_vs_memcpy']:.3f}"
        print(f"{r['kind']:>6} {r['consumers']:>4} {r['batches_per_s']:>12.1f} "
              f"{r['gb_per_s']:>9.3f} {r['us_per_batch']:>9.2f} {base:>12} {ratio:>7}")
    print("(ratio = consumer GB/s / memcpy GB/s, per consumer)")
    print()
    for k in kinds:
        gb = _median([b["gb_per_s"] for b in baselines[k]])
        cps = _median([b["copies_per_s"] for b in baselines[k]])
        print(f"memcpy baseline {k:>5}: {gb:.3f} GB/s, {cps:.1f} copies/s "
              f"({1e6 / cps:.2f} us per copy; np.copyto, 1 thread, same preallocated dst)")
        rot = [b["rotating_gb_per_s"] for b in baselines[k] if "rotating_gb_per_s" in b]
        if rot:
            print(f"  reference: {_median(rot):.3f} GB/s rotating over {RING_SLOTS} "
                  f"preallocated dsts (cache-cold dst, like the ring's slots)")


def _print_verdicts(results: list[dict]) -> None:
    print()
    for r in results:
        if r["kind"] == "32MiB":
            ok = r["ratio_vs_memcpy"] >= TARGET_LARGE_RATIO
            print(f"32MiB x{r['consumers']}: consumer/memcpy = {r['ratio_vs_memcpy']:.3f} "
                  f"(target >= {TARGET_LARGE_RATIO}) {'OK' if ok else 'BELOW TARGET'}; "
                  f"vs rotating-dst memcpy = {r['ratio_vs_rotating_memcpy']:.3f}")
    for r in results:
        if r["kind"] == "tiny" and r["consumers"] == 1:
            ok = r["batches_per_s"] >= TARGET_TINY_BPS
            print(f"tiny x1: {r['batches_per_s']:.1f} batches/s, {r['us_per_batch']:.2f} us "
                  f"per batch (target >= {TARGET_TINY_BPS:.0f} batches/s) "
                  f"{'OK' if ok else 'BELOW TARGET'}")
    large = {r["consumers"]: r for r in results if r["kind"] == "32MiB"}
    if 1 in large and len(large) > 1:
        lo = min(large.values(), key=lambda r: r["consumers"])
        hi = max(large.values(), key=lambda r: r["consumers"])
        print(f"32MiB scaling x{lo['consumers']} -> x{hi['consumers']}: per-consumer GB/s "
              f"{lo['gb_per_s']:.3f} -> {hi['gb_per_s']:.3f} "
              f"({hi['gb_per_s'] / lo['gb_per_s']:.2f}x; flat = 1.00x)")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


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
