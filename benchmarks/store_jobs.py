"""Jobs with their own subset, seed and speed over one dataset: each with its own
DataLoader, against ``share(..., store=True)`` (the store of decoded samples), one run.

    python benchmarks/store_jobs.py [--images 2000] [--epochs 3] [--stagger 5] [--batch 32]
                                    [--workers 1] [--rounds 1] [--quick] [--json PATH]

Three jobs (real processes) over one image dataset: subsets of 100 % (the dataset,
shuffled), 50 % (a ``Subset`` of a fixed random half, shuffled) and 25 % (a
``SubsetRandomSampler`` over every fourth sample), each with its own seed; training steps
of about 1x, 2x and 4x the cost (the job takes 1, 2 or 4 SGD steps of
``workload.SmallResNet`` per batch); ``--epochs`` epochs each; started ``--stagger``
seconds apart (0, 5 and 10 s). The dataset is ``workload.DecodedDataset`` (Ld: read a
JPEG, decode, resize: deterministic, the part the store shares); each job's own part is
``workload.Augment`` (La_k: a random resized crop, flip, jitter, to float), given as
``share(..., store=True, transform=<its Augment>, seed=...)``; in the own mode each job's
DataLoader runs the dataset and its Augment in its ``--workers`` workers, as a user's
would. Modes, one after the other, ``--rounds`` times in turn:

  own         each job its own DataLoader;
  store       the same DataLoaders through ``share(..., store=True)``, a budget that holds
              the union;
  store-half  the same with ``cache_bytes=`` half of the union's blocks (evictions, and
              decodes again).

Every process pads its heap (``workload.pad_heap``: the jobs, their loaders' workers, the
calibration), as ``shared_prefix.py`` explains: an unpadded process gives memory back to
the kernel after a step and faults it in again in the next. Calibrated in the run (this
process, one thread, thread CPU time; before the first mode and after the last,
medians): Ld per sample, each job's La_k per sample, and T_k per
sample (its 1, 2 or 4 steps over a batch, / the batch). With E epochs and |S_k| samples
per epoch for job k, the CPU of the jobs on their own is sum_k E |S_k| (Ld + La_k + T_k);
of the shared run, ideally, Ld |union| + sum_k E |S_k| (La_k + T_k). The ideal ratio is
the first over the second: on a CPU-bound machine the aggregate samples/s of the shared
run over the own run's, and the CPU per sample of the own run over the shared run's.

Measured per mode, in each job's training window (its first ``next()`` to the end of
its last step: what the ideal counts, no interpreter start nor imports): aggregate
samples/s (the sum over jobs of each job's samples over its window) and CPU per sample
(each job's CPU and its loader workers' over the window, getrusage); and over the whole
run (first start to last end: the same starts in each mode) the same two, start-up
included. Decodes (every ``__getitem__`` of the dataset, by any process, appends a byte
to a file); each job's time waiting in ``next()`` per epoch over its wall time, and for
the fastest job's warm epochs (after its first) the part of its waiting while the machine
had a core idle (``/proc/stat`` polled every 0.25 s: waiting that CPU contention does not
explain); each job's batch ids (own and store modes must give the same, job by job,
epoch by epoch: checked, every id); peak RSS (the sum over the mode's processes of VmHWM,
and the largest sum of VmRSS at one poll) and the /dev/shm the processes map, against the
store's budget.

Console: progress on stderr; on stdout the calibration, a table and the ratios against
their ideals. JSON (``--json PATH``, default ``benchmarks/results/<date>-store-jobs-
<machine>.json``), schema ``tensorsocket-store-jobs/1``.

The script runs itself with the hidden role ``_job`` for each job.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is not a package
from bench_common import (  # noqa: E402
    HERE, children_cpu_seconds, dispatch, div, fmt, harness, log, machine_info, median,
    read_text, report, start_watchdog, stop_all, write_json,
)
from collocated_children import _set_threads  # noqa: E402 - one thread, as there
from shared_prefix import TreePoller  # noqa: E402

MODES = ("own", "store", "store-half")
SUBSETS = ("all", "half", "quarter")
STEPS = (1, 2, 4)  # SGD steps per batch: the jobs' training costs 1x, 2x, 4x
AUGMENTS = ((64, True, 0.4), (56, False, 0.2), (48, True, 0.1))  # as shared_prefix.py
IMAGES = 2000
EPOCHS = 3
STAGGER = 5.0
BATCH = 32
WORKERS = 1
ROUNDS = 1
QUICK = dict(images=96, epochs=2, stagger=1.0, rounds=1)
SEED = 0
MODE_TIMEOUT = 900.0
MB = 1024 * 1024
HEAP_PAD = 16 << 20  # every process's heap (workload.pad_heap), as in shared_prefix.py


def _workload():
    import workload

    return workload


# -- a job ---------------------------------------------------------------------------------


class CountedDataset:
    """workload.DecodedDataset whose every __getitem__ appends a byte to `log` (the
    decodes of every process of every job add up in one file)."""

    def __new__(cls, root: str, log_path: str):
        w = _workload()

        class Counted(w.DecodedDataset):
            def __getitem__(self, i: int):
                fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    os.write(fd, b".")
                finally:
                    os.close(fd)
                return super().__getitem__(i)

        return Counted(root)


class OwnAugmented:
    """A job's own dataset: the decode, then its augmentation (its DataLoader's workers
    draw its randomness as they do)."""

    def __init__(self, base, augment) -> None:
        self.base, self.augment = base, augment

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        img, label, sample_id = self.base[i]
        return self.augment(img), label, sample_id


def job_loader(k: int, dataset, batch: int, workers: int, seed: int):
    """Job k's DataLoader over `dataset` (its subset, its sampler, its generator)."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader, Subset, SubsetRandomSampler

    g = torch.Generator()
    g.manual_seed(seed)
    n = len(dataset)
    pad = functools.partial(_workload().pad_heap, HEAP_PAD, strict=False)
    common = dict(batch_size=batch, num_workers=workers, generator=g, worker_init_fn=pad)
    if SUBSETS[k] == "all":
        return DataLoader(dataset, shuffle=True, **common)
    if SUBSETS[k] == "half":
        half = np.sort(np.random.default_rng(0).permutation(n)[: n // 2]).tolist()
        return DataLoader(Subset(dataset, half), shuffle=True, **common)
    return DataLoader(dataset, sampler=SubsetRandomSampler(list(range(0, n, 4)), generator=g),
                      **common)


def job_main(argv: list[str]) -> int:
    """One job: its loader (own or through the store), its epochs, its record."""
    p = argparse.ArgumentParser()
    for name in ("mode", "root", "decodes", "name"):
        p.add_argument(f"--{name}", required=True)
    for name in ("index", "epochs", "batch", "workers", "cache-bytes", "seed"):
        p.add_argument(f"--{name}", type=int, required=True)
    a = p.parse_args(argv[1:])
    started = time.time()
    _set_threads()
    start_watchdog(MODE_TIMEOUT, f"job {a.index}")
    w = _workload()
    w.pad_heap(HEAP_PAD, strict=False)
    augment = w.Augment(*AUGMENTS[a.index])
    base = CountedDataset(a.root, a.decodes)
    seed = a.seed * 100 + a.index
    if a.mode == "own":
        loader = job_loader(a.index, OwnAugmented(base, augment), a.batch, a.workers, seed)
    else:
        import tensorsocket as ts

        options = {"cache_bytes": a.cache_bytes} if a.cache_bytes else {}
        loader = ts.share(job_loader(a.index, base, a.batch, a.workers, seed), name=a.name,
                          store=True, transform=augment, seed=seed, **options)
    trainer = w.Trainer(seed=seed)
    epochs = []
    train_started, cpu0 = time.monotonic(), _cpu_with_children()
    for _ in range(a.epochs):
        t0, waited, ids, samples, waits = time.perf_counter(), 0.0, [], 0, []
        it = iter(loader)
        while True:
            w0, m0 = time.perf_counter(), time.monotonic()
            try:
                x, y, sample_ids = next(it)
            except StopIteration:
                break
            waited += time.perf_counter() - w0
            waits.append((m0, time.monotonic()))
            ids.append(sample_ids.tolist())
            samples += len(sample_ids)
            for _ in range(STEPS[a.index]):
                trainer.step(x, y % w.NUM_CLASSES)
        epochs.append({"ids": ids, "samples": samples, "wall_s": time.perf_counter() - t0,
                       "wait_s": waited, "waits": waits})
    train_ended, cpu1 = time.monotonic(), _cpu_with_children()
    info = loader.store_info() if a.mode != "own" else {}
    if a.mode != "own":
        loader.close()
    report({"role": "job", "index": a.index, "started": started, "ended": time.time(),
            "train_started": train_started, "train_ended": train_ended,
            "train_cpu_s": cpu1 - cpu0, "epochs": epochs, "store": info})
    return 0


def _cpu_with_children() -> float:
    """CPU seconds of this process and of its children it reaped (its loader's workers of
    ended epochs)."""
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


# -- calibration -----------------------------------------------------------------------------


def calibrate(root: Path, batch: int, samples: int = 24) -> dict:
    """Ld, La_k and T_k per sample in ms (thread CPU time, this process, one thread), and
    the bytes of one stored sample's block."""
    import torch

    from tensorsocket.store.codec import arena_block, encode

    _set_threads()
    w = _workload()
    w.pad_heap(HEAP_PAD, strict=False)
    ds = w.DecodedDataset(root)
    ds[0]
    c0 = time.thread_time()
    decoded = [ds[i] for i in range(samples)]
    ld = (time.thread_time() - c0) / samples
    la, t = [], []
    for k in range(3):
        augment = w.Augment(*AUGMENTS[k])
        torch.manual_seed(k)
        augment(decoded[0][0])
        c0 = time.thread_time()
        out = [augment(img) for img, _, _ in decoded]
        la.append((time.thread_time() - c0) / samples)
        x = torch.stack([out[i % samples] for i in range(batch)])
        y = torch.arange(batch) % w.NUM_CLASSES
        trainer = w.Trainer(seed=k)
        trainer.step(x, y)
        c0 = time.thread_time()
        for _ in range(2 * STEPS[k]):
            trainer.step(x, y)
        t.append((time.thread_time() - c0) / 2 / batch)
    nbytes, _ = encode(decoded[0])
    block = arena_block(nbytes)
    return {"ld_ms": 1000 * ld, "la_ms": [1000 * v for v in la], "t_ms": [1000 * v for v in t],
            "sample_bytes": nbytes, "block_bytes": block}


def ideal_ratio(cal: dict, sizes: list[int], union: int, epochs: int) -> float:
    """The own run's CPU over the shared run's (module docstring)."""
    own = sum(epochs * n * (cal["ld_ms"] + cal["la_ms"][k] + cal["t_ms"][k])
              for k, n in enumerate(sizes))
    shared = cal["ld_ms"] * union + sum(epochs * n * (cal["la_ms"][k] + cal["t_ms"][k])
                                        for k, n in enumerate(sizes))
    return own / shared


# -- a mode ----------------------------------------------------------------------------------


def run_mode(mode: str, args: argparse.Namespace, root: Path, tmp: Path, budget: int,
             round_no: int) -> dict:
    """Start the three jobs `stagger` apart, wait for them; the mode's record."""
    decodes = tmp / f"decodes-{mode}-{round_no}"
    name = f"storebench{os.getpid()}{mode.replace('-', '')}{round_no}"
    poller = TreePoller()
    procs, rec = [], {"mode": mode, "round": round_no, "ok": False, "error": None}
    cpu0, t0 = children_cpu_seconds(), time.monotonic()
    env = harness().child_env(threads=1)
    for var in ("TENSORSOCKET_NAME", "TENSORSOCKET_CACHE_BYTES"):
        env.pop(var, None)
    try:
        poller.start()
        for k in range(3):
            while time.monotonic() < t0 + k * args.stagger:
                time.sleep(0.01)
            argv = [sys.executable, str(Path(__file__).resolve()), "_job", "--mode", mode,
                    "--root", str(root), "--decodes", str(decodes), "--name", name,
                    "--index", str(k), "--epochs", str(args.epochs), "--batch",
                    str(args.batch), "--workers", str(args.workers), "--seed", str(round_no),
                    "--cache-bytes", str(budget if mode == "store-half" else 0)]
            out, err = open(tmp / f"{mode}{k}.out", "wb"), open(tmp / f"{mode}{k}.err", "wb")
            with out, err:
                p = harness().spawn(argv, stdout=out, stderr=err, env=env, label=f"job{k}")
            procs.append(p)
            poller.add(p.pid, "job")
        for p in procs:
            p.wait(MODE_TIMEOUT)
            if p.returncode != 0:
                raise RuntimeError(f"{mode} {p.label} exited {p.returncode}: "
                                   f"{read_text(tmp / f'{mode}{procs.index(p)}.err', 1500)}")
        rec["jobs"] = [json.loads(read_text(tmp / f"{mode}{k}.out").strip().splitlines()[-1])
                       for k in range(3)]
        rec["ok"] = True
    except Exception as e:  # noqa: BLE001 - a failed mode is a result
        rec["error"] = str(e) or type(e).__name__
    finally:
        stop_all(procs)
        poller.stop()
    rec["cpu_s"] = children_cpu_seconds() - cpu0
    rec["decodes"] = decodes.stat().st_size if decodes.exists() else 0
    rec["peak_rss_total_mb"] = sum(poller.hwm_kb.values()) / 1024
    rec["peak_rss_concurrent_mb"] = poller.rss_peak_kb / 1024
    rec["shm_mapped_peak_mb"] = poller.shm_peak[1] / MB
    if rec["ok"]:
        jobs = rec["jobs"]
        samples = sum(e["samples"] for j in jobs for e in j["epochs"])
        span = max(j["ended"] for j in jobs) - min(j["started"] for j in jobs)
        rec["samples"] = samples
        rec["span_s"] = span
        rec["samples_per_s"] = samples / span
        rec["cpu_ms_per_sample"] = 1000 * rec["cpu_s"] / samples
        # The training window of each job (its first next() to its last batch's end):
        # what the ideal counts (no interpreter start, no imports).
        rec["train_samples_per_s"] = sum(
            sum(e["samples"] for e in j["epochs"]) / (j["train_ended"] - j["train_started"])
            for j in jobs)
        rec["train_cpu_ms_per_sample"] = 1000 * sum(j["train_cpu_s"] for j in jobs) / samples
        rec["wait_fraction"] = [[e["wait_s"] / e["wall_s"] for e in j["epochs"]] for j in jobs]
        # The fastest job's waiting once the store is warm (its epochs after the first),
        # all of it and the part while the machine had a core idle (not CPU contention).
        fast = jobs[0]
        warm = fast["epochs"][1:]
        wall = sum(e["wall_s"] for e in warm)
        rec["fast_warm_wait_fraction"] = div(sum(e["wait_s"] for e in warm), wall)
        rec["fast_warm_wait_uncontended_fraction"] = div(
            uncontended(poller.busy, [w for e in warm for w in e["waits"]]), wall)
        rec["fast_overlaps_slow"] = fast["train_ended"] > jobs[2]["train_started"]
        rec["store"] = [j["store"] for j in jobs]
        for j in jobs:
            for e in j["epochs"]:
                del e["waits"]
    log(f"{mode} round {round_no}: {'ok' if rec['ok'] else rec['error']}")
    return rec


def uncontended(busy: list[tuple[float, float]], waits: list) -> float:
    """Seconds of the `waits` ((start, end) monotonic) that fell in polls of `busy` (the
    machine's busy CPU seconds at each poll) where the machine had a core idle: waiting
    that CPU contention does not explain."""
    cores = len(os.sched_getaffinity(0))
    total = 0.0
    for (t0, c0), (t1, c1) in zip(busy, busy[1:]):
        if t1 <= t0 or (c1 - c0) / (t1 - t0) >= cores - 0.5:
            continue  # saturated: every core busy (within a poll's resolution)
        for a, b in waits:
            total += max(0.0, min(b, t1) - max(a, t0))
    return total


# -- the run ----------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=IMAGES)
    p.add_argument("--epochs", type=int, default=EPOCHS)
    p.add_argument("--stagger", type=float, default=STAGGER)
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--workers", type=int, default=WORKERS)
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--quick", action="store_true", help="a short run: " + str(QUICK))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    w = _workload()
    root = w.ensure_images(args.images, w.IMAGE_SIZE, progress=log)
    n = args.images
    sizes = [n, n // 2, len(range(0, n, 4))]
    union = n
    cals = [calibrate(root, args.batch)]
    half_budget = union * cals[0]["block_bytes"] // 2
    tmp = Path(tempfile.mkdtemp(prefix="store-jobs-"))
    modes = []
    try:
        for r in range(args.rounds):
            for mode in MODES:
                modes.append(run_mode(mode, args, root, tmp, half_budget, r))
        cals.append(calibrate(root, args.batch))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cal = {"ld_ms": median(c["ld_ms"] for c in cals),
           "la_ms": [median(c["la_ms"][k] for c in cals) for k in range(3)],
           "t_ms": [median(c["t_ms"][k] for c in cals) for k in range(3)],
           "block_bytes": cals[0]["block_bytes"], "repeats": cals}
    ideal = ideal_ratio(cal, sizes, union, args.epochs)
    doc = summarize(args, cal, ideal, modes, sizes, union, half_budget)
    print_summary(doc)
    path = args.json or str(HERE / "results" / (
        f"{datetime.date.today()}-store-jobs-{machine_tag()}.json"))
    write_json(path, doc)
    return 0 if all(m["ok"] for m in modes) and doc["ids_equal"] else 1


def machine_tag() -> str:
    info = machine_info()
    return f"{info.get('cpus', os.cpu_count())}cpu"


def summarize(args: argparse.Namespace, cal: dict, ideal: float, modes: list[dict],
              sizes: list[int], union: int, half_budget: int) -> dict:
    """The result document: config, calibration, modes, ratios (medians over rounds)."""
    by = {m: [r for r in modes if r["mode"] == m and r["ok"]] for m in MODES}
    ids_equal = True
    for own, store in zip(by["own"], by["store"]):
        for k in range(3):
            own_ids = [e["ids"] for e in own["jobs"][k]["epochs"]]
            for other in (store,) + tuple(h for h in by["store-half"]
                                          if h["round"] == own["round"]):
                ids_equal &= own_ids == [e["ids"] for e in other["jobs"][k]["epochs"]]
    for mode_rec in modes:  # the ids compared: a digest of each epoch's is kept
        for job in mode_rec.get("jobs", []):
            for e in job["epochs"]:
                e["ids_digest"] = _digest(e.pop("ids"))
    ratios = {}
    for mode in ("store", "store-half"):
        rounds = [(s, o) for s in by[mode] for o in by["own"] if o["round"] == s["round"]]
        ratio = {
            "samples_per_s": median(s["train_samples_per_s"] / o["train_samples_per_s"]
                                    for s, o in rounds),
            "cpu_per_sample": median(o["train_cpu_ms_per_sample"] / s["train_cpu_ms_per_sample"]
                                     for s, o in rounds),
            "span_samples_per_s": median(s["samples_per_s"] / o["samples_per_s"]
                                         for s, o in rounds),
            "span_cpu_per_sample": median(o["cpu_ms_per_sample"] / s["cpu_ms_per_sample"]
                                          for s, o in rounds)}
        ratios[mode] = {**ratio, **{f"{k}_of_ideal": div(v, ideal) for k, v in ratio.items()}}
    return {"schema": "tensorsocket-store-jobs/1", "argv": sys.argv,
            "config": {"images": args.images, "epochs": args.epochs, "stagger_s": args.stagger,
                       "batch": args.batch, "workers": args.workers, "rounds": args.rounds,
                       "subset_sizes": sizes, "union": union, "steps": STEPS,
                       "half_budget": half_budget},
            "machine": machine_info(), "calibration": cal, "ideal_ratio": ideal,
            "modes": modes, "ratios": ratios, "ids_equal": ids_equal}


def _digest(ids: list) -> str:
    """A short digest of an epoch's batch ids (the document keeps it, not the ids)."""
    import hashlib

    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def print_summary(doc: dict) -> None:
    """The calibration, a row per mode and the ratios, on stdout."""
    cal = doc["calibration"]
    print(f"calibration (ms per sample): Ld {cal['ld_ms']:.2f}  La "
          f"{' '.join(f'{v:.2f}' for v in cal['la_ms'])}  T "
          f"{' '.join(f'{v:.2f}' for v in cal['t_ms'])}")
    print(f"ideal ratio (own CPU / shared CPU): {doc['ideal_ratio']:.2f}")
    print(f"{'mode':<11} {'round':>5} {'samples/s':>10} {'cpu ms/s':>9} {'decodes':>8} "
          f"{'evict':>6} {'fast wait':>9} {'idle-core':>9} {'RSS MB':>8} {'shm MB':>7}")
    for m in doc["modes"]:
        if not m["ok"]:
            print(f"{m['mode']:<11} {m['round']:>5} FAILED: {m['error']}")
            continue
        evictions = max((s.get("evictions", 0) for s in m["store"]), default=0)
        print(f"{m['mode']:<11} {m['round']:>5} {fmt(m['train_samples_per_s'], '.1f', 10)} "
              f"{fmt(m['train_cpu_ms_per_sample'], '.2f', 9)} {m['decodes']:>8} {evictions:>6} "
              f"{fmt(m['fast_warm_wait_fraction'], '.3f', 9)} "
              f"{fmt(m['fast_warm_wait_uncontended_fraction'], '.3f', 9)} "
              f"{fmt(m['peak_rss_concurrent_mb'], '.0f', 8)} "
              f"{fmt(m['shm_mapped_peak_mb'], '.1f', 7)}")
    for mode, r in doc["ratios"].items():
        print(f"{mode} vs own, training windows: samples/s x{fmt(r['samples_per_s'], '.2f')} "
              f"({fmt(r['samples_per_s_of_ideal'], '.2f')} of ideal), CPU per sample "
              f"x{fmt(r['cpu_per_sample'], '.2f')} ({fmt(r['cpu_per_sample_of_ideal'], '.2f')} "
              "of ideal)")
        print(f"{mode} vs own, first start to last end (interpreters' start included): "
              f"samples/s x{fmt(r['span_samples_per_s'], '.2f')} "
              f"({fmt(r['span_samples_per_s_of_ideal'], '.2f')} of ideal), CPU per sample "
              f"x{fmt(r['span_cpu_per_sample'], '.2f')} "
              f"({fmt(r['span_cpu_per_sample_of_ideal'], '.2f')} of ideal)")
    print(f"index sequences equal to the own DataLoaders': {doc['ids_equal']}")


if __name__ == "__main__":
    dispatch({"_job": job_main}, main)
