"""What handoff.py and original_handoff.py share: the workload (batches with a counter
stamped in, the loader, the consumers' tally and its check), the memcpy baseline, the
options both scripts take, running the suite of configurations and the table of results.

Both scripts import this module; neither imports the other's code (handoff.py starts
original_handoff.py's suite through its run_original()). Child processes, timing, medians
and machine information come from bench_common (tools.harness, which only the
orchestrators import): the original's children run this module in a venv whose
tensorsocket is the original.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench_common import (
    add_run_options, count_list, cpu_seconds, div, fmt, loadavg, machine_info,
    median, name_list, repeats as default_repeats,
)


SCHEMA = "tensorsocket-handoff/2"
PAGE = 4096
LARGE_SHAPE = (32, 1024, 1024)  # uint8: 32 MiB
TINY_SHAPES = ((8, 16), (8,))  # float32, int64
KINDS = ("tiny", "32MiB")
CONSUMER_COUNTS = (1, 2, 4)
FULL_BATCHES = {"tiny": 20000, "32MiB": 200}
QUICK_DIVISOR = 10
# The peers get the same memory. iceoryx2's subscriber queue holds PEER_QUEUE samples
# (iceoryx2_handoff.py); its publisher's data segment then holds the queue, the sample the
# subscriber borrows and the one the publisher loans: 6 samples at one subscriber, 5N + 1
# at N (measured: 6 x 32 MiB at 1 subscriber, 11 x 32 MiB at 2). Our ring has RING_SLOTS
# slots whatever the consumer count (one slot serves them all: less memory than
# iceoryx2's at 2 and 4); the floor rotates over as many buffers.
PEER_QUEUE = 4
RING_SLOTS = PEER_QUEUE + 2
COUNTER_BYTES = 4  # 32 MiB batch: the counter's bytes, one at the start of each of pages 0-3
FILL = 7  # 32 MiB batch: every other byte


# -- the workload ------------------------------------------------------------------------


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
        self.cpu_first = self.cpu_last = 0.0  # CPU seconds of this process at first / end

    def consume(self, iterable, unwrap=None) -> None:
        """Iterate `iterable` to its end, touching and checking every batch."""
        touch = touch_fn(self.kind)
        for item in iterable:
            counter, ok = touch(item if unwrap is None else unwrap(item))
            t = time.perf_counter()
            if self.n == 0:
                self.t_first = t
                self.cpu_first = cpu_seconds()
                self.first = counter
            self.t_last = t
            self.n += 1
            if counter != self.last + 1 or not ok:
                self._anomaly(counter, ok)
            self.last = counter
            del item  # release the slot before waiting for the next one
        self.cpu_last = cpu_seconds()

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
            "cpu_seconds": self.cpu_last - self.cpu_first,  # from the first batch on
            **extra,
        }


def cpu_per_batch(consumers: list[dict], producer: dict | None) -> float | None:
    """CPU microseconds per delivered batch of one run: the producer's and every
    consumer's CPU time from the first batch on, over the batches all consumers got."""
    delivered = sum(c["batches"] for c in consumers)
    if not delivered or producer is None or "cpu_seconds" not in producer or \
            any("cpu_seconds" not in c for c in consumers):
        return None
    return 1e6 * (producer["cpu_seconds"] + sum(c["cpu_seconds"] for c in consumers)) \
        / delivered


def consumer_cpu_per_batch(consumers: list[dict]) -> float | None:
    """CPU microseconds per batch of one consumer (the median over the consumers of one
    run): its CPU time from its first batch to its end over the batches after the first."""
    per = [1e6 * c["cpu_seconds"] / (c["batches"] - 1) for c in consumers
           if "cpu_seconds" in c and c.get("batches", 0) > 1]
    return median(per) if per and len(per) == len(consumers) else None


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


# -- the memcpy baseline -----------------------------------------------------------------


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


# -- the suite ---------------------------------------------------------------------------


def child_parser(script: str, role: str) -> argparse.ArgumentParser:
    """The argument parser of a benchmark child (producer or consumer) of `script` in
    `role`: the run's --name, --kind and --batches; the script adds its own."""
    parser = argparse.ArgumentParser(prog=f"{script} {role}")
    parser.add_argument("--name", required=True)
    parser.add_argument("--kind", required=True, choices=KINDS)
    parser.add_argument("--batches", type=int, default=0)
    return parser


def print_errors(row: dict, peers: tuple[str, ...]) -> None:
    """Under a comparison table's row: each peer's error (row["<peer>_error"]), if any."""
    for who in peers:
        if row[f"{who}_error"]:
            print(f"{'':>12}{who} ERROR: {short(row[who + '_error'], 300)}")


def parse_common(parser: argparse.ArgumentParser, argv: list[str] | None):
    """Parse the options both scripts share; return (args, kinds, counts, repeats, nbatches)."""
    args = parser.parse_args(argv)
    repeats = default_repeats(args)
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    kinds = name_list(parser, args.kinds, KINDS, "kind")
    counts = count_list(parser, args.consumers)
    if not counts or min(counts) < 1:
        parser.error("--consumers: counts >= 1")
    div = QUICK_DIVISOR if args.quick else 1
    nbatches = {k: max(2, FULL_BATCHES[k] // div) for k in KINDS}
    return args, kinds, counts, repeats, nbatches


def add_common_options(parser: argparse.ArgumentParser) -> None:
    add_run_options(parser, f"{QUICK_DIVISOR}x fewer batches and 1 repeat", CONSUMER_COUNTS)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated subset of {','.join(KINDS)}")


def run_suite(config_fn, *, label: str, kinds: list[str], counts: list[int], repeats: int,
              nbatches: dict, quick: bool, settings: dict | None = None) -> dict:
    """Run config_fn(kind, consumers, batches, tag) for every configuration and
    repeat, with the memcpy baseline; the JSON document (see the module docstring)."""
    return run_suites({label: (config_fn, settings)}, kinds=kinds, counts=counts,
                      repeats=repeats, nbatches=nbatches, quick=quick)[label]


def run_suites(peers: dict, *, kinds: list[str], counts: list[int], repeats: int,
               nbatches: dict, quick: bool) -> dict:
    """run_suite() for several implementations at once, interleaved: every configuration
    of every repeat runs each peer in turn (in the order of `peers`, {label: (config_fn,
    settings)}, reversed every other repeat: neither always runs right after the other),
    so that drift of the machine hits them alike; one memcpy baseline per kind and repeat
    serves them all. Returns {label: document}."""
    machine = machine_info()
    for label in peers:
        print(f"[{label}] python {machine['python']}, torch {machine['torch']}, "
              f"{machine['cpus']} CPUs ({machine['cpu_model']}), load {machine['loadavg_start']}")
        print(f"[{label}] batches per run: " + ", ".join(f"{k}={nbatches[k]}" for k in kinds)
              + f"; consumers {','.join(map(str, counts))}; repeats={repeats}", flush=True)
    runs: dict = {(label, k, n): [] for label in peers for k in kinds for n in counts}
    baselines: dict[str, list[dict]] = {k: [] for k in kinds}
    for rep in range(repeats):
        for kind in kinds:
            baselines[kind].append(memcpy_baseline(kind, 0.5 if quick else 1.0))
            for n in counts:
                order = list(peers.items())
                for label, (config_fn, _) in order if rep % 2 == 0 else order[::-1]:
                    runs[(label, kind, n)].append(
                        _run_one(config_fn, label, kind, n, rep, repeats, nbatches[kind]))
    end = loadavg()
    return {label: _document(label, settings, machine, end, kinds, counts, repeats, nbatches,
                             quick, baselines, runs)
            for label, (_, settings) in peers.items()}


def _run_one(config_fn, label: str, kind: str, n: int, rep: int, repeats: int,
             batches: int) -> dict:
    """One repeat of one configuration of one implementation: its record in "runs"."""
    t0 = time.perf_counter()
    try:
        res = config_fn(kind, n, batches, f"{kind}-{n}-{rep}")
    except Exception as e:  # never lose the whole run to one configuration
        res = {"consumers": [], "producer": None, "error": f"{type(e).__name__}: {e}"}
    seconds = time.perf_counter() - t0
    ok = res["error"] is None
    bps = median([c["batches_per_s"] for c in res["consumers"]]) if ok else None
    what = f"{bps:12.1f} batches/s (median of {n})" if ok \
        else f"FAILED: {short(res['error'])}"
    print(f"  [{label} {rep + 1}/{repeats}] {kind:>5} x{n}: {what} (run {seconds:.1f} s)",
          flush=True)
    return {
        "repeat": rep,
        "seconds": seconds,
        "error": res["error"],
        "median_batches_per_s": bps,
        "cpu_us_per_batch": cpu_per_batch(res["consumers"], res["producer"]) if ok else None,
        "consumer_cpu_us_per_batch": consumer_cpu_per_batch(res["consumers"]) if ok else None,
        "median_gb_per_s": div(bps * batch_bytes(kind), 1e9) if ok else None,
        "consumers": res["consumers"],
        "producer": res["producer"],
        "notes": res.get("notes") or [],
    }


def _document(label: str, settings: dict | None, machine: dict, loadavg_end, kinds: list[str],
              counts: list[int], repeats: int, nbatches: dict, quick: bool,
              baselines: dict, runs: dict) -> dict:
    """One implementation's JSON document (see the module docstring of handoff.py)."""
    results = [summarize(kind, n, runs[(label, kind, n)], baselines[kind], nbatches[kind],
                         repeats)
               for kind in kinds for n in counts]
    return {
        "schema": SCHEMA,
        "implementation": label,
        "machine": dict(machine, loadavg_end=loadavg_end),
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


def short(text: str | None, n: int = 160) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _baseline_summary(runs: list[dict]) -> dict:
    out = {key: median([b[key] for b in runs if key in b])
           for key in ("gb_per_s", "copies_per_s", "us_per_copy", "rotating_gb_per_s",
                       "stream_gb_per_s")}
    out["runs"] = runs
    return out


def summarize(kind: str, n: int, runs: list[dict], baselines: list[dict], batches: int,
              repeats: int) -> dict:
    base = _baseline_summary(baselines)
    good = [r for r in runs if r["error"] is None]
    bps_runs = [r["median_batches_per_s"] for r in good]
    bps = median(bps_runs)
    gbps = div(bps * batch_bytes(kind), 1e9) if bps is not None else None
    errors = [r["error"] for r in runs]
    return {
        "kind": kind,
        "batch_bytes": batch_bytes(kind),
        "consumers": n,
        "batches": batches,
        "repeats": repeats,
        "batches_per_s": bps,
        "gb_per_s": gbps,
        "us_per_batch": div(1e6, bps),
        # CPU of producer + consumers per delivered batch (median over repeats)
        "cpu_us_per_batch": median([r["cpu_us_per_batch"] for r in good
                                     if r.get("cpu_us_per_batch") is not None]),
        # CPU of one consumer per batch (median over consumers, then over repeats)
        "consumer_cpu_us_per_batch": median([r.get("consumer_cpu_us_per_batch")
                                             for r in good]),
        "batches_per_s_runs": bps_runs,
        "gb_per_s_runs": [b * batch_bytes(kind) / 1e9 for b in bps_runs],
        "us_per_batch_runs": [div(1e6, b) for b in bps_runs],
        "memcpy_gb_per_s": base["gb_per_s"],
        "memcpy_us_per_copy": base["us_per_copy"],
        "memcpy_copies_per_s": base["copies_per_s"],
        "ratio_vs_memcpy": div(gbps, base["gb_per_s"]),
        "memcpy_rotating_gb_per_s": base["rotating_gb_per_s"],
        "ratio_vs_rotating_memcpy": div(gbps, base["rotating_gb_per_s"]),
        "stream_copy_gb_per_s": base["stream_gb_per_s"],
        "ratio_vs_stream_copy": div(gbps, base["stream_gb_per_s"]),
        "error": next((e for e in errors if e), None),
        "errors": errors,
        "notes": sorted({n for r in runs for n in r.get("notes", [])}),
        "runs": runs,
    }


# -- output ------------------------------------------------------------------------------


def print_table(doc: dict) -> None:
    print()
    print(f"{doc['implementation']}: medians (per consumer: median over consumers, "
          "then over repeats)")
    hdr = (f"{'batch':>6} {'cons':>4} {'batches/s':>12} {'GB/s':>9} {'us/batch':>9} "
           f"{'memcpy GB/s':>12} {'us/copy':>8} {'ratio':>7} {'CPU us/b':>9} {'cons CPU':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in doc["results"]:
        print(f"{r['kind']:>6} {r['consumers']:>4} {fmt(r['batches_per_s'], '.1f', 12)} "
              f"{fmt(r['gb_per_s'], '.3f', 9)} {fmt(r['us_per_batch'], '.2f', 9)} "
              f"{fmt(r['memcpy_gb_per_s'], '.3f', 12)} "
              f"{fmt(r['memcpy_us_per_copy'], '.2f', 8)} "
              f"{fmt(r['ratio_vs_memcpy'], '.3f', 7)} "
              f"{fmt(r.get('cpu_us_per_batch'), '.2f', 9)} "
              f"{fmt(r.get('consumer_cpu_us_per_batch'), '.2f', 9)}")
        if r["error"]:
            bad = sum(1 for e in r["errors"] if e)
            print(f"{'':>12}ERROR in {bad}/{len(r['errors'])} repeats: {short(r['error'], 300)}")
        for note in r["notes"]:
            print(f"{'':>12}note: {short(note, 300)}")
    print("(ratio = consumer GB/s / memcpy GB/s of the same bytes, per consumer; for tiny it is "
          "memcpy us/copy / us/batch; CPU us/b = CPU time of the producer and every consumer "
          "per batch delivered to a consumer; cons CPU = one consumer's CPU us per batch, median "
          "over consumers)")
    for k, b in doc["baselines"].items():
        line = (f"memcpy baseline {k:>5}: {fmt(b['gb_per_s'], '.3f', 0)} GB/s, "
                f"{fmt(b['us_per_copy'], '.2f', 0)} us per copy (np.copyto, 1 thread, "
                "same preallocated dst)")
        if b.get("rotating_gb_per_s"):
            line += (f"; {b['rotating_gb_per_s']:.3f} GB/s rotating over {RING_SLOTS} "
                     "dsts (cache-cold, like the ring's slots)")
        if b.get("stream_gb_per_s"):
            one = by_key(doc["results"]).get((k, 1), {}).get("gb_per_s")
            line += (f"; {b['stream_gb_per_s']:.3f} GB/s with the ring's own streaming copy "
                     f"rotating likewise (ours at 1 consumer: "
                     f"{fmt(div(one, b['stream_gb_per_s']), '.3f', 0)}x of it)")
        print(line)


def by_key(results: list[dict]) -> dict:
    return {(r["kind"], r["consumers"]): r for r in results}
