"""A shared decoded prefix, each job its own augmentation: N jobs, three ways, one run.

    python benchmarks/shared_prefix.py [--jobs 3] [--epochs 3] [--images 2000]
                                       [--workers 1] [--rounds 3] [--quick] [--json PATH]

The collocated benchmark's workload (``workload.py``) split in two: the decode part Ld
(``workload.DecodedDataset``: read a 512x512 JPEG, decode, resize to 80x80, uint8 CHW:
the shared prefix) and the augmentation part La (``workload.Augment``, per job and per
sample, plain torch ops: a random resized crop to 64, 56 or 48, flip on or off, a
brightness/contrast jitter of strength 0.4, 0.2 or 0.1, to float and normalised), then
the training step T (each job its own ``workload.SmallResNet``, one thread per process).
N jobs (real processes, started together) train ``--epochs`` epochs of ``--images``
samples each, in three modes measured one after the other in the same run, all three
``--rounds`` times in turn (the ratios are the medians over the rounds):

  own           each job its own DataLoader (``--workers`` workers) running Ld + La
                (``workload.AugmentedDataset``): N x Ld per sample;
  shared        ``tensorsocket.share(loader_of_Ld, transform=<the job's La>, seed=...,
                transform_workers=K, min_consumers=N)``: one producer decodes each sample
                once, each job augments it in its own process;
  shared+cache  the same with share()'s ``cache_bytes=`` large
                enough for the decoded dataset:
                epochs 2+ are served from the producer's cache, without decoding.

Fairness: the own mode has N x ``--workers`` loader workers; the shared modes give the
one loader as many (``--producer-workers``, default N x ``--workers``) and each job
``--transform-workers`` (default 0: La runs in the training process, as a DataLoader
with num_workers=0 would; CPU is the bottleneck on a 2-core machine, so where La runs
changes little). Every process pads its heap the same way, the jobs' training processes
(hence share()'s producer, forked from one), every loader's workers
(``make_loader(worker_top_pad=16 MiB)``) and the calibration's (workload.pad_heap): an
unpadded training process gives memory back to the kernel after a step and faults it in
again in the next (on the 2-core machine: 137-2763 page faults and 1.2-1.4x the CPU a
step), so a calibration padded and jobs not would compare two different costs.

Calibration (in one forked process, one thread, heap padded as the jobs'): Ld, each
job's La and each job's T per sample (T over 4 different batches in turn), thread CPU
time; ``--repeats`` repeats before every mode and after the last, and the median of them
all, since a shared host's speed drifts over the minutes of a run. On a CPU-bound
machine the throughput ratios are ratios of CPU costs: N jobs on their own cost sum_j
(Ld + La_j + T_j) per N samples (one for each job), sharing the prefix costs Ld + sum_j
(La_j + T_j), and serving it from the cache sum_j (La_j + T_j). Hence the ideal ratios
shared/own = sum_j (Ld + La_j + T_j) / (Ld + sum_j (La_j + T_j)) (with equal jobs
N(Ld+La+T)/(Ld+N(La+T))) in epoch 1, and cache/own = sum_j (Ld + La_j + T_j) / sum_j
(La_j + T_j) from epoch 2 on.

Measured per mode: aggregate samples/s (the sum over jobs of each job's samples / its
time) in epoch 1 (after ``--warmup`` batches, which hold the processes' start) and in
epochs 2+ (from the end of its epoch 1 to the end of its last); CPU-seconds per sample
(every process of the mode, the producer and all workers included: this process is a
child subreaper, so share()'s double-forked producer is re-parented to it and reaped here;
``getrusage(RUSAGE_CHILDREN)``, interpreter start-up included, over every sample trained);
the jobs' training processes' own CPU per sample split into the training step (T as it
runs there, against its calibration) and the rest (``job_process_cpu``);
peak RSS (sum over the mode's processes of VmHWM, polled, and each job's own at its exit;
each epoch's loader workers are new processes, so this adds their peaks one after the
other), the largest sum of VmRSS seen at one poll (``peak_rss_concurrent_mb``) and of
PSS (``peak_pss_total_mb``, shared pages split between the processes that map them: the
producer is forked from a job and shares its pages);
shared memory: the largest total of /dev/shm objects the mode's processes map
(``shm_mapped_peak_mb``) and the peak of /proc/meminfo's Shmem minus its value before
the mode (``shmem_delta_peak_mb``; the producer's cache is a memfd, counted there and not
under /dev/shm; other work on the machine counts in it too). Every job
checks that it got every sample id exactly once per epoch, with the right label; a failed
check fails the mode.

Console: progress on stderr; on stdout the calibration, a table and the ratios against
their ideals. JSON (``--json PATH``, default ``benchmarks/results/<date>-shared-prefix-
<machine>.json``), schema ``tensorsocket-shared-prefix/1``: argv, config, machine,
calibration {ld_ms, la_ms [per job], t_ms [per job], repeats [... each with its phase]},
ideal {shared_vs_own, cache_vs_own}, modes [{mode, round, ok, error, wall_s,
epoch1_samples_per_s, later_samples_per_s, cpu_s_total, cpu_ms_per_sample, samples,
epoch1_window and later_window {seconds, samples, cpu_ms_per_sample, run_cores,
other_load_cores: the polled CPU of the mode's processes while every job is in that
phase}, cpu_s_polled {job, forked}, processes, peak_rss_total_mb, peak_rss_concurrent_mb,
peak_pss_total_mb, shm_mapped_peak_mb, shmem_delta_peak_mb, run_cores, other_load_cores,
job_process_cpu {epoch1, later: {step_ms, rest_ms}}, jobs [...]}], ratios
{shared_vs_own_epoch1, cache_vs_own_later, cache_vs_shared_later (medians over the
rounds), each over its ideal, and the same ratios in CPU per sample of the polled windows,
``cpu_*``: what the throughput ratios would be if every mode got the same cores, which a
machine with other work on it does not give; rounds [each round's ratios]}.

The script runs itself with the hidden role ``_job`` for each job.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is not a package
from bench_common import (  # noqa: E402
    HERE, children_cpu_seconds, dispatch, div, fmt, harness, json_reports, log,
    machine_info, median, read_text, remove_leftovers, report, start_watchdog, stop_all,
    unwind_on_sigterm, vm_kb, write_json,
)
from collocated_children import _set_threads  # noqa: E402 - one thread, as there
from collocated_poller import Poller  # noqa: E402

MODES = ("own", "shared", "shared+cache")
JOBS = 3
EPOCHS = 3
IMAGES = 2000
IMAGE_SIZE = 512
BATCH = 32
WARMUP = 2  # batches of epoch 1 not timed (the processes' and the producer's start)
REPEATS = 2  # calibration repeats before every mode and after the last
CAL_BATCHES = 4  # different batches T is calibrated over
ROUNDS = 3
QUICK = dict(images=96, epochs=2, warmup=1, repeats=1, image_size=128, rounds=1)
SEED = 0
HEAP_PAD = 16 << 20  # every loader worker's (workload.make_loader), as tensorsocket's
# Each job's augmentation: (crop, flip, jitter); job i takes AUGMENTS[i % 3].
AUGMENTS = ((64, True, 0.4), (56, False, 0.2), (48, True, 0.1))
PR_SET_CHILD_SUBREAPER = 36
MODE_TIMEOUT_MIN = 180.0
REAP_TIMEOUT = 60.0  # the producer ends once its consumers read every epoch
FAILED_REAP_TIMEOUT = 5.0  # after a failed mode, the producer is killed sooner
ATTACH_TIMEOUT = 120.0
MB = 1024 * 1024


def _workload():
    import workload

    return workload


def augment_of(index: int):
    """Job `index`'s augmentation (workload.Augment)."""
    return _workload().Augment(*AUGMENTS[index % len(AUGMENTS)])


def job_seed(index: int) -> int:
    return 1000 + index


# -- a job (hidden role) -----------------------------------------------------------------


class _Record:
    """What one job saw: per epoch its samples, the time its first timed batch was asked
    for and its end, and whether every sample id came once with the right label."""

    def __init__(self, samples: int, warmup: int) -> None:
        self.samples, self.warmup = samples, warmup
        self.epochs: list[dict] = []

    def epoch(self, batches, trainer) -> None:
        import numpy as np

        seen, label_errors, timed, n, done, step_cpu = [], 0, 0, 0, [], 0.0
        t_first = t_timed = time.monotonic()
        cpu0 = time.process_time()
        for n, (x, y, ids) in enumerate(batches, 1):
            s0 = time.thread_time()
            trainer.step(x, y)
            step_cpu += time.thread_time() - s0
            done.append(time.monotonic())
            ids_l = ids.tolist()
            seen.extend(ids_l)
            label_errors += sum(1 for i, lab in zip(ids_l, y.tolist()) if lab != i % 10)
            if self.epochs or n > self.warmup:
                timed += len(ids_l)
            if not self.epochs and n == self.warmup:
                t_timed = time.monotonic()
            del x, y, ids
        counts = np.bincount(np.asarray(seen, dtype=np.int64), minlength=self.samples)
        self.epochs.append({
            "t_first": t_first, "t_timed": t_timed, "t_end": time.monotonic(),
            "cpu_s": time.process_time() - cpu0, "step_cpu_s": step_cpu,
            "batches": n, "samples": len(seen), "timed_samples": timed, "done_times": done,
            "ok": len(seen) == self.samples and bool((counts == 1).all())
            and label_errors == 0,
            "missing": int((counts == 0).sum()), "label_errors": label_errors})


def _shared_batches(args: argparse.Namespace, wl):
    """The share() consumer of a shared mode (one for every epoch)."""
    import tensorsocket

    loader = wl.make_loader(wl.DecodedDataset(args.image_dir, args.images), args.batch,
                            args.producer_workers, seed=SEED, worker_top_pad=HEAP_PAD)
    return tensorsocket.share(
        loader, name=args.name, transform=augment_of(args.index), seed=job_seed(args.index),
        transform_workers=args.transform_workers, min_consumers=args.jobs, start_grace=0,
        epochs=args.epochs, timeout=ATTACH_TIMEOUT, batch_timeout=ATTACH_TIMEOUT,
        # shared: no cache (nor TENSORSOCKET_CACHE_BYTES: the orchestrator drops it)
        cache_bytes=args.cache_bytes or 0)


def run_job(args: argparse.Namespace) -> int:
    """One job: train --epochs epochs from its own loader (own) or from share()."""
    _set_threads()
    wl = _workload()
    wl.pad_heap(HEAP_PAD)  # as the calibration's process and every loader worker's
    crop = AUGMENTS[args.index % len(AUGMENTS)][0]
    trainer = wl.Trainer(seed=args.index)
    record = _Record(args.images, args.warmup)
    if args.mode == "own":
        dataset = wl.AugmentedDataset(wl.DecodedDataset(args.image_dir, args.images),
                                      augment_of(args.index), seed=job_seed(args.index))
        for epoch in range(args.epochs):
            record.epoch(wl.make_loader(dataset, args.batch, args.workers,
                                        seed=job_seed(args.index), epoch=epoch,
                                        worker_top_pad=HEAP_PAD), trainer)
    else:
        consumer = _shared_batches(args, wl)
        try:
            for _ in range(args.epochs):
                record.epoch(consumer, trainer)
        finally:
            consumer.close()
    report({"role": "job", "index": args.index, "pid": os.getpid(), "crop": crop,
            "epochs": record.epochs, "vmhwm_kb": vm_kb().get("VmHWM", 0)})
    return 0


def job_main(argv: list[str]) -> int:
    """This script started as the hidden role ``_job``: its options, a watchdog, the job."""
    parser = argparse.ArgumentParser(prog="shared_prefix.py _job")
    for opt in ("--mode", "--name", "--image-dir"):
        parser.add_argument(opt, required=True)
    for opt in ("--index", "--jobs", "--epochs", "--images", "--batch", "--warmup",
                "--workers", "--producer-workers", "--transform-workers", "--cache-bytes"):
        parser.add_argument(opt, type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    args = parser.parse_args(argv[1:])
    start_watchdog(args.timeout, f"shared_prefix.py job {args.index}")
    unwind_on_sigterm()
    return run_job(args)


# -- calibration -------------------------------------------------------------------------


def _per_sample_ms(fn, n: int) -> float:
    """Thread CPU ms per call of fn(i), i in range(n)."""
    c0 = time.thread_time()
    for i in range(n):
        fn(i)
    return (time.thread_time() - c0) / n * 1e3


def _calibrate_once(image_dir: str, jobs: int, batch: int, samples: int,
                    images: list) -> dict:
    """Ld, each job's La and T per sample (thread CPU ms), once. La and T run over
    `images` (decoded samples), T over CAL_BATCHES different batches in turn, as a job
    trains on a new batch every step."""
    import torch

    wl = _workload()
    ds = wl.DecodedDataset(image_dir)
    ld = _per_sample_ms(lambda i: ds[i % len(ds)], samples)
    la, t = [], []
    y = torch.arange(batch) % wl.NUM_CLASSES
    for j in range(jobs):
        aug = augment_of(j)
        torch.manual_seed(j)
        la.append(_per_sample_ms(lambda i: aug(images[i % len(images)]), 4 * samples))
        trainer = wl.Trainer(seed=j)
        xs = [torch.stack([aug(images[(k * batch + i) % len(images)]) for i in range(batch)])
              for k in range(CAL_BATCHES)]
        trainer.step(xs[-1], y)  # warm-up
        t.append(_per_sample_ms(lambda i: trainer.step(xs[i % len(xs)], y),
                                max(2, samples // batch)) / batch)
    return {"ld_ms": ld, "la_ms": la, "t_ms": t}


def _calibrate_in_child(image_dir: str, jobs: int, batch: int, samples: int,
                        repeats: int) -> list[dict]:
    """Every repeat, in this (forked, one-thread) process with its heap padded as every
    loader worker's."""
    wl = _workload()
    _set_threads()
    wl.pad_heap(HEAP_PAD)
    ds = wl.DecodedDataset(image_dir)
    images = [ds[i][0] for i in range(min(len(ds), CAL_BATCHES * batch))]
    _calibrate_once(image_dir, jobs, batch, max(4, samples // 4), images)  # warm-up
    return [_calibrate_once(image_dir, jobs, batch, samples, images)
            for _ in range(repeats)]


def calibrate(image_dir: str, jobs: int, batch: int, samples: int, repeats: int,
              phase: str) -> list[dict]:
    """`repeats` calibrations (Ld, La_j, T_j per sample, thread CPU ms) in one forked
    process (workload._pool), each marked with the `phase` of the run it was taken in."""
    with _workload()._pool(1) as pool:
        reps = pool.apply(_calibrate_in_child, (image_dir, jobs, batch, samples, repeats))
    return [dict(r, phase=phase) for r in reps]


def calibration_medians(reps: list[dict], samples: int) -> dict:
    """The medians over every repeat of every phase: the costs the ideals are made of."""
    jobs = len(reps[0]["la_ms"])
    return {
        "clock": "thread CPU time, ms per sample",
        "ld_ms": median(r["ld_ms"] for r in reps),
        "la_ms": [median(r["la_ms"][j] for r in reps) for j in range(jobs)],
        "t_ms": [median(r["t_ms"][j] for r in reps) for j in range(jobs)],
        "samples_per_repeat": samples,
        "repeats": reps,
    }


def ideal_ratios(cal: dict) -> dict:
    """The CPU-bound ideals: shared/own in epoch 1, cache/own from epoch 2 on."""
    ld, suffix = cal["ld_ms"], sum(a + t for a, t in zip(cal["la_ms"], cal["t_ms"]))
    own = len(cal["la_ms"]) * ld + suffix
    return {"shared_vs_own": own / (ld + suffix), "cache_vs_own": own / suffix,
            "own_ms_per_sample": own / len(cal["la_ms"]),
            "shared_ms_per_sample": (ld + suffix) / len(cal["la_ms"]),
            "cache_ms_per_sample": suffix / len(cal["la_ms"])}


# -- one mode ----------------------------------------------------------------------------


def _shmem_kb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1])
    return 0


class TreePoller(Poller):
    """collocated_poller.Poller over every process below this one (share()'s producer is
    re-parented here, to the subreaper, so it and its workers are found), and the peak of
    /proc/meminfo's Shmem."""

    def __init__(self) -> None:
        super().__init__()
        self.shmem0_kb = self.shmem_peak_kb = _shmem_kb()
        self.rss_peak_kb = 0  # the largest sum of VmRSS over the processes at one poll

    def pids(self, discover: bool) -> list[int]:
        if discover:
            found = harness().descendants(os.getpid())
            with self._lock:
                for pid in found:
                    self.roles.setdefault(pid, "forked")
        return list(self.roles)

    def sample(self, slow: bool) -> None:
        super().sample(slow)
        self.shmem_peak_kb = max(self.shmem_peak_kb, _shmem_kb())
        with self._lock:
            pids = list(self.roles)
        rss = sum(vm_kb(pid).get("VmRSS", 0) for pid in pids)
        self.rss_peak_kb = max(self.rss_peak_kb, rss)


def _reap_orphans(deadline: float) -> list[int]:
    """Reap every process re-parented here (the producer) until none is left; past
    `deadline` SIGKILL what is still below this process. The pids killed."""
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return []
        if pid == 0:
            time.sleep(0.05)
    killed = harness().kill_tree(os.getpid(), signal.SIGKILL, include_root=False)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return killed


class ModeRun:
    """One mode: its N jobs started together, watched, their reports and the mode's CPU,
    memory and shared memory."""

    def __init__(self, args: argparse.Namespace, mode: str, image_dir: str,
                 timeout: float) -> None:
        self.args, self.mode, self.timeout = args, mode, timeout
        self.name = f"bench-prefix-{os.getpid()}-{mode.replace('+', '-')}"
        self.tmp = Path(tempfile.mkdtemp(prefix="shared-prefix-"))
        self.common = {
            "mode": mode, "name": self.name, "image-dir": image_dir, "jobs": args.jobs,
            "epochs": args.epochs, "images": args.images, "batch": args.batch,
            "warmup": args.warmup, "workers": args.workers,
            "producer-workers": args.producer_workers,
            "transform-workers": args.transform_workers,
            "cache-bytes": args.cache_bytes if mode == "shared+cache" else 0,
            "timeout": timeout + 30}
        self.procs: list = []
        self.poller = TreePoller()

    def spawn(self, index: int):
        argv = [sys.executable, str(Path(__file__).resolve()), "_job", "--index", str(index)]
        for k, v in self.common.items():
            argv += [f"--{k}", str(v)]
        env = harness().child_env(threads=1)
        for var in ("TENSORSOCKET_NAME", "TENSORSOCKET_CACHE_BYTES",
                    "TENSORSOCKET_MIN_CONSUMERS"):
            env.pop(var, None)
        out = open(self.tmp / f"job{index}.out", "wb")
        err = open(self.tmp / f"job{index}.err", "wb")
        with out, err:
            p = harness().spawn(argv, stdout=out, stderr=err, env=env, cwd=self.tmp,
                                label=f"job{index}")
        self.procs.append(p)
        self.poller.add(p.pid, "job")

    def wait(self, t0: float) -> None:
        """Until every job exited 0; raises when one failed or the mode timed out."""
        while any(p.poll() is None for p in self.procs):
            bad = [p for p in self.procs if p.poll() not in (None, 0)]
            if bad:
                break
            if time.monotonic() - t0 > self.timeout:
                raise TimeoutError(f"{self.mode}: still running after {self.timeout:.0f} s")
            time.sleep(0.1)
        for p in self.procs:
            if p.poll() != 0:
                err = read_text(self.tmp / f"{p.label}.err", 1500)
                raise RuntimeError(f"{p.label} exited with rc={p.returncode}: {err}")

    def run(self) -> dict:
        """The mode's record (never raises: a failure is recorded)."""
        rec = {"mode": self.mode, "ok": False, "error": None, "warnings": []}
        cpu0, busy0 = children_cpu_seconds(), harness().machine_busy_seconds()
        t0 = time.monotonic()
        try:
            self.poller.start()
            for j in range(self.args.jobs):
                self.spawn(j)
            self.wait(t0)
        except Exception as e:  # noqa: BLE001 - a failed mode is a result
            rec["error"] = str(e) or type(e).__name__
        finally:
            stop_all(self.procs)
            killed = _reap_orphans(time.monotonic() + (
                REAP_TIMEOUT if rec["error"] is None else FAILED_REAP_TIMEOUT))
            if killed:
                rec["warnings"].append(f"killed {len(killed)} processes left after the "
                                       f"jobs (the producer did not end)")
            self.poller.stop()
            if self.mode != "own":
                remove_leftovers(self.name)
        rec["wall_s"] = time.monotonic() - t0
        rec["cpu_s_total"] = children_cpu_seconds() - cpu0
        busy1 = harness().machine_busy_seconds()
        rec["machine_busy_cores"] = div(busy1 - busy0, rec["wall_s"]) \
            if busy0 is not None and busy1 is not None else None
        self.judge(rec)
        return rec

    def reports(self) -> list[dict | None]:
        out = []
        for p in self.procs:
            lines = json_reports(read_text(self.tmp / f"{p.label}.out", 10**7), "job")
            out.append(lines[-1] if lines else None)
        shutil.rmtree(self.tmp, ignore_errors=True)
        return out

    def judge(self, rec: dict) -> None:
        """Throughput, CPU, memory and the samples check, from the jobs' reports."""
        jobs = self.reports()  # (the jobs' output files are removed: read errors first)
        if rec["error"] is None and any(j is None for j in jobs):
            rec["error"] = "a job reported nothing"
        jobs = [j for j in jobs if j is not None]
        rec["jobs"] = jobs
        _throughput(rec, jobs, self.args.jobs)
        rec["job_process_cpu"] = _job_process_cpu(jobs)
        hwm = dict(self.poller.hwm_kb)
        for j in jobs:
            hwm[j["pid"]] = max(hwm.get(j["pid"], 0), j["vmhwm_kb"])
        rec["processes"] = len(hwm)
        rec["cpu_s_polled"] = {role: sum(c for pid, c in self.poller.cpu.items()
                                         if self.poller.roles.get(pid) == role)
                               for role in ("job", "forked")}
        rec["peak_rss_total_mb"] = sum(hwm.values()) / 1024 if hwm else None
        rec["peak_rss_concurrent_mb"] = self.poller.rss_peak_kb / 1024
        rec["peak_pss_total_mb"] = self.poller.pss_peak_kb / 1024
        rec["shm_mapped_peak_mb"] = self.poller.shm_peak[1] / MB
        rec["shmem_delta_peak_mb"] = (self.poller.shmem_peak_kb - self.poller.shmem0_kb) / 1024
        rec["run_cores"] = div(rec["cpu_s_total"], rec["wall_s"])
        if len(jobs) == self.args.jobs:
            rec["epoch1_window"] = _window(self.poller, jobs, self.args.batch,
                                           lambda j: j["epochs"][0]["t_timed"],
                                           lambda j: j["epochs"][0]["t_end"])
            rec["later_window"] = _window(self.poller, jobs, self.args.batch,
                                          lambda j: j["epochs"][0]["t_end"],
                                          lambda j: j["epochs"][-1]["t_end"])
        if rec["machine_busy_cores"] is not None:
            rec["other_load_cores"] = max(0.0, rec["machine_busy_cores"] - rec["run_cores"])
        bad = [e for j in jobs for e in j["epochs"] if not e["ok"]]
        if rec["error"] is None and bad:
            rec["error"] = (f"check failed: {len(bad)} job-epochs with missing, repeated or "
                            f"mislabelled samples (first: {bad[0]})")
        rec["ok"] = rec["error"] is None


def _samples_by(job: dict, batch: int, t: float) -> float:
    """Samples `job` had trained by time `t` (interpolated between its batches)."""
    import numpy as np

    times = [e["t_first"] for e in job["epochs"][:1]] + [
        x for e in job["epochs"] for x in e["done_times"]]
    sizes = [0] + [batch] * (len(times) - 1)  # the last batch of an epoch may be short:
    return float(np.interp(t, times, np.cumsum(sizes)))  # within one batch of the truth


def _window(poller: Poller, jobs: list[dict], batch: int, start, end) -> dict | None:
    """CPU ms per sample of the mode's processes (polled), and the other load on the
    machine, in the window where every job is between start(job) and end(job): None where
    the jobs never overlap so (or the poller missed it)."""
    ws, we = max(start(j) for j in jobs), min(end(j) for j in jobs)
    c0, c1 = poller.cpu_at(ws), poller.cpu_at(we)
    if we - ws < 1.0 or c0 is None or c1 is None:
        return None
    samples = sum(_samples_by(j, batch, we) - _samples_by(j, batch, ws) for j in jobs)
    b0, b1 = poller.cpu_at(ws, poller.busy), poller.cpu_at(we, poller.busy)
    other = (max(0.0, (b1 - b0 - (c1 - c0)) / (we - ws))
             if b0 is not None and b1 is not None else None)
    return {"seconds": we - ws, "samples": samples, "cpu_ms_per_sample": div(
        (c1 - c0) * 1e3, samples), "run_cores": (c1 - c0) / (we - ws),
        "other_load_cores": other}


def _job_process_cpu(jobs: list[dict]) -> dict:
    """Where the jobs' training processes spend their CPU, ms per sample over all jobs, in
    epoch 1 and in epochs 2+: the training step (T, in place) and the rest (own mode:
    taking batches from its loader's workers; shared modes: taking them from the ring and
    La); the loader's and the producer's processes are not in it."""
    def part(epochs: list[dict]) -> dict | None:
        samples = sum(e["samples"] for e in epochs)
        if not samples:
            return None
        step = sum(e["step_cpu_s"] for e in epochs)
        return {"step_ms": step * 1e3 / samples,
                "rest_ms": (sum(e["cpu_s"] for e in epochs) - step) * 1e3 / samples}
    return {"epoch1": part([j["epochs"][0] for j in jobs if j["epochs"]]),
            "later": part([e for j in jobs for e in j["epochs"][1:]])}


def _throughput(rec: dict, jobs: list[dict], n: int) -> None:
    """Aggregate samples/s in epoch 1 and in epochs 2+, CPU ms per sample."""
    complete = len(jobs) == n and jobs
    first = [e["epochs"][0] for e in jobs if e["epochs"]]
    rec["epoch1_samples_per_s"] = sum(
        e["timed_samples"] / (e["t_end"] - e["t_timed"]) for e in first) if complete else None
    later = [(sum(e["samples"] for e in j["epochs"][1:]),
              j["epochs"][-1]["t_end"] - j["epochs"][0]["t_end"])
             for j in jobs if len(j["epochs"]) > 1]
    rec["later_samples_per_s"] = (sum(s / t for s, t in later)
                                  if complete and len(later) == n else None)
    rec["samples"] = sum(e["samples"] for j in jobs for e in j["epochs"])
    rec["cpu_ms_per_sample"] = div(rec["cpu_s_total"] * 1e3, rec["samples"])


# -- the run -----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=JOBS)
    parser.add_argument("--epochs", type=int, default=None, help=f"default {EPOCHS}")
    parser.add_argument("--images", type=int, default=None,
                        help=f"JPEGs = samples per epoch (default {IMAGES})")
    parser.add_argument("--image-size", type=int, default=None,
                        help=f"side of the JPEGs (default {IMAGE_SIZE})")
    parser.add_argument("--workers", type=int, default=1,
                        help="DataLoader workers of each job's own loader (default 1)")
    parser.add_argument("--producer-workers", type=int, default=None,
                        help="workers of the shared loader (default jobs x workers)")
    parser.add_argument("--transform-workers", type=int, default=0,
                        help="transform_workers= of each shared job (default 0)")
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"untimed batches of epoch 1 (default {WARMUP})")
    parser.add_argument("--repeats", type=int, default=None,
                        help="calibration repeats before every mode and after the last "
                        f"(default {REPEATS})")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"the modes run this many times in turn; the ratios are the "
                        f"medians over the rounds (default {ROUNDS})")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: 96 small images, 2 epochs, 1 calibration repeat, "
                        "1 round")
    parser.add_argument("--json", metavar="PATH", help="where the results go (default "
                        "benchmarks/results/<date>-shared-prefix-<machine>.json)")
    a = parser.parse_args(argv)
    quick = QUICK if a.quick else {}
    a.epochs = a.epochs or quick.get("epochs", EPOCHS)
    a.images = a.images or quick.get("images", IMAGES)
    a.image_size = a.image_size or quick.get("image_size", IMAGE_SIZE)
    a.warmup = a.warmup if a.warmup is not None else quick.get("warmup", WARMUP)
    a.repeats = a.repeats or quick.get("repeats", REPEATS)
    a.rounds = a.rounds or quick.get("rounds", ROUNDS)
    a.producer_workers = (a.producer_workers if a.producer_workers is not None
                          else a.jobs * a.workers)
    a.modes = [m for m in a.modes.split(",") if m]
    if any(m not in MODES for m in a.modes) or min(a.jobs, a.epochs, a.rounds) < 1:
        parser.error(f"need --modes within {','.join(MODES)}, --jobs, --epochs and --rounds "
                     ">= 1")
    if a.images < a.batch * (a.warmup + 2):
        parser.error("--images must hold at least --warmup + 2 batches")
    a.cache_bytes = 2 * a.images * 3 * 80 * 80 + (64 << 20)  # the decoded set, twice, + 64 MiB
    return a


def _machine() -> dict:
    info = machine_info(packages=("torch", "numpy", "zmq", "PIL"))
    try:
        out = subprocess.run(["git", "-C", str(HERE), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        info["commit"] = out.stdout.strip() or None
    except Exception:  # noqa: BLE001 - informational
        info["commit"] = None
    return info


def _mode_timeout(args: argparse.Namespace, cal: dict, cores: int) -> float:
    """Generous: ten times the own mode's CPU over the cores, at least MODE_TIMEOUT_MIN."""
    own_ms = ideal_ratios(cal)["own_ms_per_sample"]
    expect = args.jobs * args.epochs * args.images * own_ms / 1e3 / max(1, cores)
    return max(MODE_TIMEOUT_MIN, 10 * expect)


def _ratios(by_mode: dict, ideal: dict) -> dict:
    own, sh, ca = (by_mode.get(m) or {} for m in MODES)
    out = {
        "shared_vs_own_epoch1": div(sh.get("epoch1_samples_per_s"),
                                    own.get("epoch1_samples_per_s")),
        "cache_vs_own_later": div(ca.get("later_samples_per_s"),
                                  own.get("later_samples_per_s")),
        "cache_vs_shared_later": div(ca.get("later_samples_per_s"),
                                     sh.get("later_samples_per_s")),
        "cache_vs_own_epoch1": div(ca.get("epoch1_samples_per_s"),
                                   own.get("epoch1_samples_per_s")),
    }
    _over_ideal(out, ideal)
    # The same ratios in CPU per sample (own's over the mode's, in the polled windows):
    # what the throughput ratio would be if every mode got the same cores, which a
    # machine with other work on it does not give.
    def cpu(r: dict, window: str) -> float | None:
        return (r.get(window) or {}).get("cpu_ms_per_sample")
    out["cpu_shared_vs_own_epoch1"] = div(cpu(own, "epoch1_window"), cpu(sh, "epoch1_window"))
    out["cpu_cache_vs_own_later"] = div(cpu(own, "later_window"), cpu(ca, "later_window"))
    out["cpu_cache_vs_shared_later"] = div(cpu(sh, "later_window"), cpu(ca, "later_window"))
    return out


def _over_ideal(ratios: dict, ideal: dict) -> None:
    """Add to `ratios` each measured throughput ratio over its ideal."""
    ratios["shared_epoch1_of_ideal"] = div(ratios["shared_vs_own_epoch1"],
                                           ideal["shared_vs_own"])
    ratios["cache_later_of_ideal"] = div(ratios["cache_vs_own_later"], ideal["cache_vs_own"])


def _round_ratios(modes: list[dict], ideal: dict, rounds: int) -> dict:
    """Each round's ratios (``rounds``), and the medians over the rounds of the measured
    ratios, each over its ideal."""
    per_round = [_ratios({r["mode"]: r for r in modes if r["round"] == k}, ideal)
                 for k in range(1, rounds + 1)]
    out = {key: median(r[key] for r in per_round) for key in per_round[0]
           if not key.endswith("_of_ideal")}
    _over_ideal(out, ideal)
    out["rounds"] = per_round
    return out


def print_report(args: argparse.Namespace, cal: dict, ideal: dict, modes: list[dict],
                 ratios: dict) -> None:
    la = ", ".join(f"{a:.3f}" for a in cal["la_ms"])
    t = ", ".join(f"{x:.3f}" for x in cal["t_ms"])
    print(f"calibration (thread CPU ms per sample, median of {len(cal['repeats'])} repeats: "
          f"{args.repeats} before each mode and after the last): Ld "
          f"{cal['ld_ms']:.3f}, La [{la}], T [{t}]: Ld / mean(La + T) = "
          f"{cal['ld_ms'] * len(cal['la_ms']) / sum(cal['la_ms'] + cal['t_ms']):.2f}")
    print(f"CPU ms per sample, ideal: own {ideal['own_ms_per_sample']:.2f}, shared "
          f"{ideal['shared_ms_per_sample']:.2f}, cached {ideal['cache_ms_per_sample']:.2f}")
    def name(r: dict) -> str:
        return f"{r['mode']} {r['round']}" if args.rounds > 1 else r["mode"]

    print(f"{'mode':<15} {'epoch 1':>9} {'epochs 2+':>9} {'CPU ms/sample':^20} "
          f"{'peak RSS MB':^15} {'PSS MB':>7} {'/dev/shm':>9} {'Shmem':>7} {'other':>6} "
          f"{'wall':>6}  status")
    print(f"{'':<15} {'samples/s':>9} {'samples/s':>9} {'all':>6} {'ep. 1':>6} {'2+':>6} "
          f"{'sum HWM':>7} {'at once':>7} {'at once':>7} {'mapped MB':>9} {'+MB':>7} "
          f"{'cores':>6} {'s':>6}")
    for r in modes:
        ep1, later = r.get("epoch1_window") or {}, r.get("later_window") or {}
        print(f"{name(r):<15} {fmt(r.get('epoch1_samples_per_s'), '.1f', 9)} "
              f"{fmt(r.get('later_samples_per_s'), '.1f', 9)} "
              f"{fmt(r.get('cpu_ms_per_sample'), '.2f', 6)} "
              f"{fmt(ep1.get('cpu_ms_per_sample'), '.2f', 6)} "
              f"{fmt(later.get('cpu_ms_per_sample'), '.2f', 6)} "
              f"{fmt(r.get('peak_rss_total_mb'), '.0f', 7)} "
              f"{fmt(r.get('peak_rss_concurrent_mb'), '.0f', 7)} "
              f"{fmt(r.get('peak_pss_total_mb'), '.0f', 7)} "
              f"{fmt(r.get('shm_mapped_peak_mb'), '.1f', 9)} "
              f"{fmt(r.get('shmem_delta_peak_mb'), '.1f', 7)} "
              f"{fmt(r.get('other_load_cores'), '.2f', 6)} {fmt(r.get('wall_s'), '.1f', 6)}  "
              + ("ok" if r["ok"] else f"FAILED: {(r['error'] or '')[:200]}"))
    t_mean = sum(cal["t_ms"]) / len(cal["t_ms"])
    la_mean = sum(cal["la_ms"]) / len(cal["la_ms"])
    print(f"jobs' training processes, CPU ms per sample (calibrated: T {t_mean:.2f}, "
          f"La {la_mean:.2f}):")
    print(f"{'mode':<15} {'step (T)':^15} {'the rest':^15}   the rest: the batches in, and")
    print(f"{'':<15} {'ep. 1':>7} {'2+':>7} {'ep. 1':>7} {'2+':>7}   La where the job runs it")
    for r in modes:
        e1, e2 = ((r.get("job_process_cpu") or {}).get(k) or {} for k in ("epoch1", "later"))
        print(f"{name(r):<15} {fmt(e1.get('step_ms'), '.2f', 7)} "
              f"{fmt(e2.get('step_ms'), '.2f', 7)} {fmt(e1.get('rest_ms'), '.2f', 7)} "
              f"{fmt(e2.get('rest_ms'), '.2f', 7)}")
    if args.rounds > 1:
        for k, r in enumerate(ratios["rounds"], 1):
            print(f"round {k}: shared/own, epoch 1 {fmt(r['shared_vs_own_epoch1'], '.2f')}x "
                  f"({fmt(r['shared_epoch1_of_ideal'], '.2f')} of ideal); cache/own, epochs "
                  f"2+ {fmt(r['cache_vs_own_later'], '.2f')}x "
                  f"({fmt(r['cache_later_of_ideal'], '.2f')} of ideal); cache/no cache "
                  f"{fmt(r['cache_vs_shared_later'], '.2f')}x")
        print(f"the medians over the {args.rounds} rounds:")
    print(f"shared/own, epoch 1:       {fmt(ratios['shared_vs_own_epoch1'], '.2f')}x samples/s "
          f"({fmt(ratios['cpu_shared_vs_own_epoch1'], '.2f')}x in CPU per sample), ideal "
          f"N(Ld+La+T)/(Ld+N(La+T)) = {ideal['shared_vs_own']:.2f}x: "
          f"{fmt(ratios['shared_epoch1_of_ideal'], '.2f')} of ideal (target >= 0.9)")
    print(f"cache/own, epochs 2+:      {fmt(ratios['cache_vs_own_later'], '.2f')}x samples/s "
          f"({fmt(ratios['cpu_cache_vs_own_later'], '.2f')}x in CPU per sample), ideal "
          f"N(Ld+La+T)/(N(La+T)) = {ideal['cache_vs_own']:.2f}x: "
          f"{fmt(ratios['cache_later_of_ideal'], '.2f')} of ideal (target >= 0.9)")
    print(f"cache/no cache, epochs 2+: {fmt(ratios['cache_vs_shared_later'], '.2f')}x samples/s "
          f"({fmt(ratios['cpu_cache_vs_shared_later'], '.2f')}x in CPU per sample; target >= 1)",
          flush=True)


def _default_json(machine: dict) -> Path:
    cores = machine.get("cpus_usable") or machine.get("cpus")
    cpu = "-".join((machine.get("cpu_model") or "cpu").lower().split()[:3])
    cpu = "".join(ch for ch in cpu if ch.isalnum() or ch == "-")
    day = datetime.date.today().isoformat()
    return HERE / "results" / f"{day}-shared-prefix-{cores}cpu-{cpu}.json"


def _enable_subreaper() -> None:
    """Orphans below this process (share()'s double-forked producer) come to it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _enable_subreaper()
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    machine = _machine()
    wl = _workload()
    image_dir = str(wl.ensure_images(args.images, args.image_size, progress=log))
    samples = 64 if args.quick else 256
    reps: list[dict] = []

    def calibrate_now(phase: str) -> None:
        log(f"calibrating {phase} (Ld, La, T per sample; {args.repeats} repeats) ...")
        reps.extend(calibrate(image_dir, args.jobs, args.batch, samples, args.repeats,
                              phase))

    def label(mode: str, rnd: int) -> str:
        return f"{mode}, round {rnd}" if args.rounds > 1 else mode

    calibrate_now("before " + label(args.modes[0], 1))
    timeout = _mode_timeout(args, calibration_medians(reps, samples),
                            machine.get("cpus_usable") or 1)
    print(f"shared prefix benchmark: {machine['cpu_model']}, {machine['cpus_usable']} "
          f"usable cores; {args.jobs} jobs x {args.epochs} epochs x {args.images} samples "
          f"({args.image_size}px JPEGs -> 80x80 uint8), batch {args.batch}; own: "
          f"{args.workers} worker(s) per job; shared: {args.producer_workers} producer "
          f"workers, transform_workers={args.transform_workers}; cache_bytes="
          f"{args.cache_bytes}", flush=True)
    modes: list[dict] = []
    for rnd in range(1, args.rounds + 1):
        for mode in args.modes:
            if modes:
                calibrate_now("before " + label(mode, rnd))
            log(f"{label(mode, rnd)}: {args.jobs} jobs ...")
            modes.append(dict(ModeRun(args, mode, image_dir, timeout).run(), round=rnd))
            log(f"{label(mode, rnd)}: {modes[-1]['wall_s']:.1f} s, "
                + ("ok" if modes[-1]["ok"] else f"FAILED: {modes[-1]['error']}"))
    calibrate_now("after the last mode")
    cal = calibration_medians(reps, samples)
    ideal = ideal_ratios(cal)
    ratios = _round_ratios(modes, ideal, args.rounds)
    print_report(args, cal, ideal, modes, ratios)
    machine["loadavg_end"] = harness().loadavg()
    doc = {"schema": "tensorsocket-shared-prefix/1", "started": started,
           "argv": sys.argv[1:] if argv is None else argv,
           "config": {k: v for k, v in vars(args).items() if k != "json"},
           "augments": [dict(zip(("crop", "flip", "jitter"), a)) for a in AUGMENTS],
           "machine": machine, "calibration": cal, "ideal": ideal, "modes": modes,
           "ratios": ratios}
    write_json(args.json or _default_json(machine), doc)
    return 0 if all(r["ok"] for r in modes) else 1


if __name__ == "__main__":
    dispatch({"_job": job_main}, main)
