"""Handoff benchmark: how fast does a batch get from the producer to its consumers?

    python benchmarks/handoff.py [--quick] [--repeats N] [--kinds tiny,32MiB]
                                 [--consumers 1,2,4] [--json PATH] [--with-original]
                                 [--with-iceoryx2]

Runs one producer process and N consumer processes (real, separate processes
started with ``subprocess`` and ``sys.executable``) for two batch shapes:

  tiny    a tuple (float32 (8, 16), int64 (8,)): 576 bytes, per-batch overhead
  32MiB   one uint8 tensor (32, 1024, 1024): bandwidth

with 1, 2 and 4 consumers; 20000 tiny and 200 32 MiB batches per run (10x
fewer with --quick), each configuration 3 times (1 with --quick).

The workload (in handoff_common.py, shared with original_handoff.py, which runs the same through
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

``--with-iceoryx2`` runs iceoryx2_handoff.py's suite (the same workloads through iceoryx2
publish-subscribe with a WaitSet, PyPI ``iceoryx2``) interleaved with ours: per repeat and
configuration ours runs, then iceoryx2, so that drift of the machine hits both alike. It
prints one table: batches/s of both, ours/iceoryx2, and the CPU per batch of one consumer
and of all processes for both. Where ``import iceoryx2`` fails it says so and ours runs
alone.

JSON (``--json PATH``; original_handoff.py writes the same schema)::

  {
    "schema": "tensorsocket-handoff/2",
    "implementation": "tensorsocket (this checkout)" | "tensorsocket 0.0.5 (original, PyPI)",
    "machine": {python, platform, cpus, cpus_usable, cpu_model, mem_total_gb,
                mem_available_gb, loadavg_start, loadavg_end, torch, numpy, pyzmq},
    "settings": {quick, repeats, kinds, consumer_counts, batches: {kind: n},
                 batch_bytes: {kind: n}, timeouts..., + implementation-specific
                 (ring_slots here; producer_batch_size etc. for the original;
                 iceoryx2: its service settings)},
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
       "cpu_us_per_batch",     # CPU of producer + consumers per delivered batch
       "consumer_cpu_us_per_batch",  # one consumer's CPU per batch (median over
                               # consumers, then repeats)
       "error",                # null, or the first failed repeat's error text
       "errors",               # per repeat: null or error text
       "notes",                # remarks that are not failures (e.g. a hung join())
       "runs": [{"repeat", "seconds", "error", "notes", "median_batches_per_s",
                 "median_gb_per_s", "cpu_us_per_batch", "consumer_cpu_us_per_batch",
                 "consumers": [per-consumer report],
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
                    "ours_error", "original_error"}],
    # only with --with-iceoryx2:
    "iceoryx2": {iceoryx2_handoff.py's document, or {"skipped": why, "results": [], ...}},
    "comparison_iceoryx2": [{"kind", "consumers", "ours_batches_per_s",
                             "iceoryx2_batches_per_s", "ours_over_iceoryx2", "ours_gb_per_s",
                             "iceoryx2_gb_per_s", "ours_consumer_cpu_us_per_batch",
                             "iceoryx2_consumer_cpu_us_per_batch", "ours_cpu_us_per_batch",
                             "iceoryx2_cpu_us_per_batch", "ours_error", "iceoryx2_error"}]
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
import importlib
import os
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is not a package
from bench_common import (  # noqa: E402
    cpu_seconds, dispatch, div, fmt, harness, remove_leftovers, report, stop_all, tail,
    unwind_on_sigterm, write_json,
)
from handoff_common import (  # noqa: E402
    RING_SLOTS, CountingLoader, Tally, add_common_options, by_key, check_reports,
    child_parser, parse_common, print_errors, print_table, run_suite, run_suites, short,
)

OURS = "tensorsocket (this checkout)"
TARGET_TINY_BPS = 20000.0  # batches/s to one consumer
TARGET_TINY_BPS_ONE = 200000.0  # issue 17: batches/s with one consumer
TARGET_TINY_VS_FLOOR = 1.0  # issue 17: ours / shared_memory + pipes, tiny, every N
TARGET_TINY_CPU_US = 8.0  # issue 17: CPU (producer + consumers) per delivered tiny batch
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
        report({"role": "producer", "ready": True})
        t0 = None
        cpu0 = 0.0
        n = 0
        for _ in producer:
            if t0 is None:
                t0 = time.perf_counter()  # after the consumers attached
                cpu0 = cpu_seconds()
            n += 1
        t1 = time.perf_counter()
        cpu1 = cpu_seconds()
        stats = producer.stats()
        drained = producer.join(timeout=JOIN_TIMEOUT)
    finally:
        producer.close()
    report({
        "role": "producer",
        "batches": n,
        "seconds": t1 - (t0 or t1),
        "cpu_seconds": cpu1 - cpu0,
        "wait_seconds": stats["wait_seconds"],
        "bytes_copied": stats["bytes_copied"],
        "drained": drained,
    })
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
    report(tally.report())
    return 0


# -- orchestrator: one configuration of ours ---------------------------------------------


def child_argv(role: str, *extra: str) -> list[str]:
    """The argv of a child of this script in `role` (_producer, _consumer)."""
    return harness().python_argv(os.path.abspath(__file__), role, *extra)


def run_config(kind: str, consumers: int, batches: int, tag: str,
               profile: str | None = None) -> dict:
    """One producer + `consumers` consumers for `batches` batches.

    Returns {"consumers": [reports], "producer": report or None, "error": None or text}.
    """
    h = harness()
    name = f"bench-handoff-{os.getpid()}-{tag}"
    procs: list = []
    reports: list[dict] = []
    preport = None
    error = None
    try:
        producer = h.spawn(child_argv("_producer", "--name", name, "--kind", kind,
                                            "--batches", str(batches),
                                            "--consumers", str(consumers)), label="producer")
        procs.append(producer)
        producer.wait_ready(ATTACH_TIMEOUT)
        cons = []
        for i in range(consumers):
            extra = ["--profile", profile] if profile else []
            c = h.spawn(child_argv("_consumer", "--name", name, "--kind", kind, *extra),
                              label=f"consumer {i + 1}")
            procs.append(c)
            cons.append(c)
        deadline = time.monotonic() + RUN_TIMEOUT
        for c in cons:
            report = c.result(max(1.0, deadline - time.monotonic()))
            if report.get("role") != "consumer":
                raise RuntimeError(f"consumer said {report}")
            reports.append(report)
        preport = producer.result(max(1.0, deadline - time.monotonic()))
    except h.ChildFailed as e:
        error = str(e) if "did not exit" not in str(e) else \
            f"configuration not finished within {RUN_TIMEOUT:.0f} s: {e}"
        error = tail(error, lines=12, chars=3000)
    except Exception as e:  # recorded as this configuration's result
        error = f"{type(e).__name__}: {e}"
    finally:
        stop_all(procs)
        remove_leftovers(name)
    if error is None:
        error = check_reports(reports, kind, batches, consumers)
    return {"consumers": reports, "producer": preport, "error": error}


def _verdict(target: str, value: float | None, limit: float, at_most: bool = False) -> dict:
    """{"target", "value", "ok"}: ok whether value >= limit (<= with at_most), None when
    there is no value."""
    ok = None if value is None else (value <= limit if at_most else value >= limit)
    return {"target": target, "value": value, "ok": ok}


def verdicts(ours: dict, original: dict | None = None, floor: dict | None = None) -> list[dict]:
    """The targets, each {"target", "value", "ok"} (ok None: not measurable)."""
    res = ours["results"]
    tiny = [r for r in res if r["kind"] == "tiny"]
    out = []
    for r in tiny:
        if r["consumers"] == 1:
            out.append(_verdict(f"ours tiny x1: batches/s >= {TARGET_TINY_BPS_ONE:.0f}",
                                r["batches_per_s"], TARGET_TINY_BPS_ONE))
        out.append(_verdict(f"ours tiny x{r['consumers']}: CPU us per delivered batch <= "
                            f"{TARGET_TINY_CPU_US:g}", r.get("cpu_us_per_batch"),
                            TARGET_TINY_CPU_US, at_most=True))
    low = by_key(floor["results"]) if floor is not None else {}
    for r in tiny:
        f = low.get((r["kind"], r["consumers"]))
        if f is not None:
            out.append(_verdict(f"ours/floor tiny x{r['consumers']} (batches/s per consumer; "
                                f"floor: shared_memory + pipes) >= {TARGET_TINY_VS_FLOOR:g}",
                                div(r["batches_per_s"], f["batches_per_s"]),
                                TARGET_TINY_VS_FLOOR))
    for r in (r for r in res if r["kind"] == "32MiB"):
        out.append(_verdict(f"ours 32MiB x{r['consumers']}: per-consumer GB/s / memcpy "
                            f">= {TARGET_LARGE_RATIO}", r["ratio_vs_memcpy"],
                            TARGET_LARGE_RATIO))
    large = {r["consumers"]: r for r in res if r["kind"] == "32MiB"}
    if 1 in large and len(large) > 1:
        worst = min((r for n, r in large.items() if n != 1),
                    key=lambda r: r["gb_per_s"] if r["gb_per_s"] is not None else -1)
        out.append(_verdict(f"ours 32MiB flat in N: min over N>1 of per-consumer GB/s / "
                            f"GB/s at 1 consumer >= {TARGET_FLAT} (worst: "
                            f"x{worst['consumers']})",
                            div(worst["gb_per_s"], large[1]["gb_per_s"]), TARGET_FLAT))
    for r in tiny:
        out.append(_verdict(f"ours tiny x{r['consumers']}: batches/s per consumer >= "
                            f"{TARGET_TINY_BPS:.0f}", r["batches_per_s"], TARGET_TINY_BPS))
    if original is not None:
        out += _original_verdicts(res, by_key(original["results"]))
    return out


def _original_verdicts(res: list[dict], orig: dict) -> list[dict]:
    out = []
    for r in res:
        o = orig.get((r["kind"], r["consumers"]))
        if o is None:
            continue
        v = div(r["batches_per_s"], o["batches_per_s"])
        name = (f"ours/original {r['kind']} x{r['consumers']} (batches/s per consumer) "
                f">= {TARGET_VS_ORIGINAL[r['kind']]:g}")
        if v is None and o["error"] and r["batches_per_s"] is not None:
            name += f" [original failed: {short(o['error'], 120)}]"
        out.append(_verdict(name, v, TARGET_VS_ORIGINAL[r["kind"]]))
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
    orig = by_key(original["results"])
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
            "ours_over_original": div(r["batches_per_s"], o.get("batches_per_s")),
            "memcpy_gb_per_s": r["memcpy_gb_per_s"],
            "memcpy_us_per_copy": r["memcpy_us_per_copy"],
            "ours_ratio_vs_memcpy": r["ratio_vs_memcpy"],
            "original_ratio_vs_memcpy": o.get("ratio_vs_memcpy"),
            "ours_error": r["error"],
            "original_error": o.get("error"),
        })
    return rows


def floor_comparison(ours: dict, floor: dict) -> list[dict]:
    """Per configuration: ours and the floor's batches/s and CPU per batch, and the ratio."""
    low = by_key(floor["results"])
    rows = []
    for r in ours["results"]:
        f = low.get((r["kind"], r["consumers"]), {})
        rows.append({
            "kind": r["kind"], "consumers": r["consumers"],
            "ours_batches_per_s": r["batches_per_s"],
            "floor_batches_per_s": f.get("batches_per_s"),
            "ours_over_floor": div(r["batches_per_s"], f.get("batches_per_s")),
            "ours_cpu_us_per_batch": r.get("cpu_us_per_batch"),
            "floor_cpu_us_per_batch": f.get("cpu_us_per_batch"),
            "floor_error": f.get("error"),
        })
    return rows


def print_floor_comparison(rows: list[dict]) -> None:
    print()
    print("ours vs the floor (shared_memory + pipes, shm_pipe_handoff.py), same run")
    hdr = (f"{'batch':>6} {'cons':>4} | {'ours b/s':>10} {'floor b/s':>10} {'ours/floor':>10} | "
           f"{'ours CPU us/b':>13} {'floor CPU us/b':>14}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['kind']:>6} {r['consumers']:>4} | {fmt(r['ours_batches_per_s'], '.1f', 10)} "
              f"{fmt(r['floor_batches_per_s'], '.1f', 10)} {fmt(r['ours_over_floor'], '.2f', 10)}"
              f" | {fmt(r['ours_cpu_us_per_batch'], '.2f', 13)} "
              f"{fmt(r['floor_cpu_us_per_batch'], '.2f', 14)}")
        print_errors(r, ("floor",))


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
              f"{fmt(r['ours_batches_per_s'], '.1f', 10)} {fmt(r['ours_gb_per_s'], '.3f', 7)} "
              f"{fmt(r['ours_us_per_batch'], '.1f', 8)} | "
              f"{fmt(r['original_batches_per_s'], '.1f', 10)} "
              f"{fmt(r['original_gb_per_s'], '.3f', 7)} "
              f"{fmt(r['original_us_per_batch'], '.1f', 8)} | "
              f"{fmt(r['ours_over_original'], '.1f', 9)} | "
              f"{fmt(r['memcpy_gb_per_s'], '.3f', 11)} {fmt(r['memcpy_us_per_copy'], '.2f', 7)} "
              f"{fmt(r['ours_ratio_vs_memcpy'], '.3f', 11)}")
        print_errors(r, ("ours", "original"))


def iceoryx2_comparison(ours: dict, ice: dict) -> list[dict]:
    """Per configuration: ours and iceoryx2's batches/s, GB/s and CPU per batch (one
    consumer's, and producer + consumers' per delivered batch), and ours / iceoryx2."""
    theirs = by_key(ice["results"])
    rows = []
    for r in ours["results"]:
        o = theirs.get((r["kind"], r["consumers"]), {})
        rows.append({
            "kind": r["kind"], "consumers": r["consumers"],
            "ours_batches_per_s": r["batches_per_s"],
            "iceoryx2_batches_per_s": o.get("batches_per_s"),
            "ours_over_iceoryx2": div(r["batches_per_s"], o.get("batches_per_s")),
            "ours_gb_per_s": r["gb_per_s"],
            "iceoryx2_gb_per_s": o.get("gb_per_s"),
            "ours_consumer_cpu_us_per_batch": r.get("consumer_cpu_us_per_batch"),
            "iceoryx2_consumer_cpu_us_per_batch": o.get("consumer_cpu_us_per_batch"),
            "ours_cpu_us_per_batch": r.get("cpu_us_per_batch"),
            "iceoryx2_cpu_us_per_batch": o.get("cpu_us_per_batch"),
            "ours_error": r["error"],
            "iceoryx2_error": o.get("error") or ice.get("skipped"),
        })
    return rows


def print_iceoryx2_comparison(rows: list[dict], label: str) -> None:
    print()
    print(f"ours vs {label}, interleaved in the same run (per consumer; medians over "
          "consumers, then repeats)")
    hdr = (f"{'batch':>6} {'cons':>4} | {'ours b/s':>10} {'GB/s':>7} | {'iox2 b/s':>10} "
           f"{'GB/s':>7} | {'ours/iox2':>9} | {'cons CPU us/b: ours':>19} {'iox2':>9} | "
           f"{'all CPU us/b: ours':>18} {'iox2':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['kind']:>6} {r['consumers']:>4} | "
              f"{fmt(r['ours_batches_per_s'], '.1f', 10)} {fmt(r['ours_gb_per_s'], '.3f', 7)} | "
              f"{fmt(r['iceoryx2_batches_per_s'], '.1f', 10)} "
              f"{fmt(r['iceoryx2_gb_per_s'], '.3f', 7)} | "
              f"{fmt(r['ours_over_iceoryx2'], '.2f', 9)} | "
              f"{fmt(r['ours_consumer_cpu_us_per_batch'], '.2f', 19)} "
              f"{fmt(r['iceoryx2_consumer_cpu_us_per_batch'], '.2f', 9)} | "
              f"{fmt(r['ours_cpu_us_per_batch'], '.2f', 18)} "
              f"{fmt(r['iceoryx2_cpu_us_per_batch'], '.2f', 9)}")
        print_errors(r, ("ours", "iceoryx2"))
    print("(cons CPU us/b: one consumer's CPU time per batch, median over consumers; all CPU "
          "us/b: producer + every consumer per batch delivered to a consumer)")


def _run_with_iceoryx2(ours_peer: tuple, suite: dict) -> tuple[dict, dict]:
    """Ours and iceoryx2's suite interleaved (per configuration and repeat, in turn:
    handoff_common.run_suites); ours alone, with a skipped iceoryx2 document, where iceoryx2 does not
    import. Returns (ours, iceoryx2's document)."""
    ice_mod = importlib.import_module("iceoryx2_handoff")
    reason = ice_mod.unavailable()
    if reason:
        print(ice_mod.skip_line(reason), flush=True)
        return (run_suite(ours_peer[0], label=OURS, settings=ours_peer[1], **suite),
                ice_mod.skipped(reason, **suite))
    label = ice_mod.label()
    docs = run_suites({OURS: ours_peer, label: (ice_mod.run_config, ice_mod.settings())},
                      **suite)
    return docs[OURS], docs[label]


def _show_iceoryx2(ours: dict, ice: dict) -> None:
    """Print iceoryx2's table and the comparison; keep both in ours ("iceoryx2",
    "comparison_iceoryx2")."""
    ours["iceoryx2"] = ice
    if ice.get("skipped"):
        print()
        print(f"iceoryx2: skipped ({ice['skipped']})")
        ours["comparison_iceoryx2"] = []
        return
    print_table(ice)
    rows = iceoryx2_comparison(ours, ice)
    print_iceoryx2_comparison(rows, ice["implementation"])
    ours["comparison_iceoryx2"] = rows


# -- main --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_options(parser)
    parser.add_argument("--with-original", action="store_true",
                        help="then run the same through the original TensorSocket 0.0.5 "
                             "(original_handoff.py) and print one comparison table")
    parser.add_argument("--with-iceoryx2", action="store_true",
                        help="run the same through iceoryx2 publish-subscribe with a WaitSet "
                             "(iceoryx2_handoff.py), interleaved with ours per configuration "
                             "and repeat, and print one comparison table (skipped, saying "
                             "so, where iceoryx2 does not import)")
    parser.add_argument("--no-floor", action="store_true",
                        help="skip the floor: the same workload through plain shared_memory "
                             "and pipes (shm_pipe_handoff.py), run after ours by default")
    parser.add_argument("--profile", metavar="PREFIX",
                        help="cProfile every consumer (ours); stats go to PREFIX.<pid>")
    args, kinds, counts, repeats, nbatches = parse_common(parser, argv)

    def config_fn(kind, n, batches, tag):
        return run_config(kind, n, batches, tag, args.profile)

    suite = {"kinds": kinds, "counts": counts, "repeats": repeats, "nbatches": nbatches,
             "quick": args.quick}
    ours_peer = (config_fn, {"ring_slots": RING_SLOTS, "timeouts": _timeouts()})
    ours, ice = (_run_with_iceoryx2(ours_peer, suite) if args.with_iceoryx2
                 else (run_suite(ours_peer[0], label=OURS, settings=ours_peer[1], **suite),
                       None))
    print_table(ours)
    floor = None if args.no_floor else _run_beside(
        ours, "floor", "floor_comparison", "shm_pipe_handoff", "run_floor", floor_comparison,
        print_floor_comparison, suite)
    original = _run_beside(
        ours, "original", "comparison", "original_handoff", "run_original", comparison,
        print_comparison, suite) if args.with_original else None
    if ice is not None:
        _show_iceoryx2(ours, ice)
    checks = verdicts(ours, original, floor)
    print_verdicts(checks)
    ours["verdicts"] = checks

    if args.json:
        write_json(args.json, ours)
    return 1 if any(r["error"] for r in ours["results"]) else 0


def _run_beside(ours: dict, key: str, rows_key: str, module: str, runner: str,
                compare: Callable[[dict, dict], list[dict]],
                show: Callable[[list[dict]], None], suite: dict) -> dict:
    """Run another implementation's suite (module.runner, a script beside this one) on the
    same workloads after ours; print its table and the comparison, and keep both in ours
    (ours[key], ours[rows_key]). Returns its document."""
    print()
    other = getattr(importlib.import_module(module), runner)(**suite)
    print_table(other)
    rows = compare(ours, other)
    show(rows)
    ours[key] = other
    ours[rows_key] = rows
    return other


def _timeouts() -> dict:
    return {"attach": ATTACH_TIMEOUT, "start": START_TIMEOUT, "batch": BATCH_TIMEOUT,
            "publish": PUBLISH_TIMEOUT, "join": JOIN_TIMEOUT, "run": RUN_TIMEOUT}


def _child_main(argv: list[str]) -> int:
    role = argv[0]
    unwind_on_sigterm()
    parser = child_parser("handoff.py", role)
    parser.add_argument("--consumers", type=int, default=1)
    parser.add_argument("--profile", default=None)
    args = parser.parse_args(argv[1:])
    if role == "_producer":
        return run_producer(args)
    return run_consumer(args)


if __name__ == "__main__":
    dispatch({"_producer": _child_main, "_consumer": _child_main}, main)
