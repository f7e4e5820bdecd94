"""One run of collocated.py: the children of one mode at one N (started, watched,
stopped, their reports collected) and the run's record (throughput, CPU in the common
measured window, memory, the consumers' checks). The orchestrator only imports it."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import (
    children_cpu_seconds, free_ports, harness, json_reports, read_text, remove_leftovers,
    stop_all,
)
from collocated_children import ATTACH_TIMEOUT, SEED
from collocated_poller import Poller

SCRIPT = Path(__file__).resolve().parent / "collocated.py"
PRODUCER_EXIT_GRACE = 30.0  # after the consumers finished
MIN_WINDOW_FRACTION = 0.25  # of the median measured time, for the common CPU window
KILL_GRACE = 5.0
MB = 1024 * 1024


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


def _child_env() -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.pop("TENSORSOCKET_NAME", None)
    return env


class _Children:
    """The processes of one run: each started as collocated.py in a role with its stdout
    and stderr in files of a temporary directory, polled by a Poller, watched until they
    finish, fail or hang, then stopped and their reports read."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.tmp = Path(tempfile.mkdtemp(prefix="collocated-"))
        self.procs: list[subprocess.Popen] = []
        self.logs: dict[int, tuple[str, Path, Path]] = {}  # pid -> (label, stdout, stderr)
        self.poller = Poller()
        self.producer: subprocess.Popen | None = None
        self.consumers: list[subprocess.Popen] = []
        self.common = dict(images=spec.images, samples=spec.samples, batch=spec.batch,
                           workers=spec.workers, warmup=spec.warmup, seed=SEED,
                           timeout=spec.timeout + 30, worker_top_pad=spec.worker_top_pad)

    def spawn(self, python: str, role: str, label: str, **kw) -> subprocess.Popen:
        out, err = self.tmp / f"{label}.out", self.tmp / f"{label}.err"
        cmd = [python, str(SCRIPT), role]
        for k, v in dict(self.common, **kw).items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        with open(out, "wb") as fo, open(err, "wb") as fe:
            p = harness().spawn(cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                cwd=self.tmp, env=_child_env(), label=label)
        self.procs.append(p)
        self.logs[p.pid] = (label, out, err)
        self.poller.add(p.pid, label.rstrip("0123456789"))
        return p

    def start_producer(self, python: str, role: str, **kw) -> None:
        """The producer, then wait until it says it is ready."""
        self.producer = p = self.spawn(python, role, "producer", **kw)
        out = self.logs[p.pid][1]
        deadline = time.monotonic() + ATTACH_TIMEOUT
        while '"ready"' not in out.read_text(errors="replace"):
            if p.poll() is not None:
                raise RuntimeError(f"producer exited early (rc={p.returncode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"producer not ready within {ATTACH_TIMEOUT:.0f} s")
            time.sleep(0.05)

    def start_consumers(self, python: str, role: str, label: str, **kw) -> None:
        for k in range(self.spec.consumers):
            self.consumers.append(self.spawn(python, role, f"{label}{k}", index=k, **kw))

    def wait(self, t0: float) -> None:
        """Until every child exited 0; raises when one failed, the producer outstays its
        consumers by PRODUCER_EXIT_GRACE, or the run its timeout."""
        deadline = t0 + self.spec.timeout
        consumers_done_at = None
        while True:
            now = time.monotonic()
            bad = [p for p in self.procs if p.poll() not in (None, 0)]
            if bad:
                label, _, err = self.logs[bad[0].pid]
                raise RuntimeError(f"{label} exited with rc={bad[0].returncode}: "
                                   f"{read_text(err, 1200)}")
            if all(p.poll() == 0 for p in self.consumers):
                if self.producer is None or self.producer.poll() == 0:
                    return
                consumers_done_at = consumers_done_at or now
                if now - consumers_done_at > PRODUCER_EXIT_GRACE:
                    raise RuntimeError(f"hang: the producer did not exit within "
                                       f"{PRODUCER_EXIT_GRACE:.0f} s after the consumers "
                                       f"finished: "
                                       f"{read_text(self.logs[self.producer.pid][2], 800)}")
            if now > deadline:
                running = [self.logs[p.pid][0] for p in self.procs if p.poll() is None]
                raise TimeoutError(f"hang after {now - t0:.0f} s (still running: "
                                   f"{', '.join(running)})")
            time.sleep(0.1)

    def stop(self) -> None:
        stop_all(self.procs, KILL_GRACE)
        self.poller.stop()

    def reports(self) -> dict[int, dict]:
        """pid -> the last report of that child; then the output files are removed."""
        out = {}
        for pid, (_label, stdout, _err) in self.logs.items():
            lines = json_reports(read_text(stdout, 10**7))
            if lines:
                out[pid] = lines[-1]
        shutil.rmtree(self.tmp, ignore_errors=True)
        return out


def _start(kids: _Children, spec: RunSpec, name: str, record: dict) -> None:
    """The children of spec.mode."""
    if spec.mode == "independent":
        kids.start_consumers(sys.executable, "_trainer", "trainer")
    elif spec.mode == "shared":
        heap = ({} if spec.producer_heap_pad is None
                else {"producer_heap_pad": spec.producer_heap_pad})
        kids.start_producer(sys.executable, "_producer", name=name,
                            workers=spec.producer_workers, consumers=spec.consumers, **heap)
        kids.start_consumers(sys.executable, "_consumer", "consumer", name=name)
    elif spec.mode == "original":
        if spec.original_python is None:
            raise RuntimeError("the original TensorSocket is unavailable")
        ports = ",".join(map(str, free_ports(4)))
        record["ports"] = ports
        kids.start_producer(spec.original_python, "_orig_producer",
                            workers=spec.producer_workers, ports=ports,
                            consumers=spec.consumers)
        kids.start_consumers(spec.original_python, "_orig_consumer", "consumer", ports=ports)
    else:
        raise ValueError(f"unknown mode {spec.mode!r}")


def run_once(spec: RunSpec) -> dict:
    """One run; never raises: failures are recorded in the result."""
    record = {"mode": spec.mode, "consumers": spec.consumers, "repeat": spec.repeat,
              "loader_workers": (spec.workers if spec.mode == "independent"
                                 else spec.producer_workers),
              "ok": False, "error": None, "warnings": []}
    name = f"bench-coll-{os.getpid()}-{spec.mode}-{spec.consumers}-{spec.repeat}"
    kids = _Children(spec)
    cpu0 = children_cpu_seconds()
    own0 = sum(os.times()[:2])
    t0 = time.monotonic()
    try:
        kids.poller.start()
        _start(kids, spec, name, record)
        kids.wait(t0)
        record["wall_s"] = time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - a failed run is a result
        record["error"] = str(e) or type(e).__name__
        record["wall_s"] = time.monotonic() - t0
    finally:
        kids.stop()
        if spec.mode == "shared":
            remove_leftovers(name)
    cpu_total = children_cpu_seconds() - cpu0
    record["orchestrator_cpu_s"] = sum(os.times()[:2]) - own0
    _judge(record, spec, kids, kids.reports(), cpu_total)
    return record


def _judge(record: dict, spec: RunSpec, kids: _Children, reports: dict,
           cpu_total: float) -> None:
    """The run's figures from the children's reports, and whether it is ok."""
    if kids.poller.error:
        record["warnings"].append(f"poller: {kids.poller.error}")
    cons = [reports.get(p.pid) for p in kids.consumers]
    record["producer"] = reports.get(kids.producer.pid) if kids.producer is not None else None
    if record["error"] is None and (not cons or any(c is None for c in cons)):
        record["error"] = "a consumer reported nothing"
    cons = [c for c in cons if c is not None]
    try:
        _metrics(record, spec, cons, kids.poller, reports, cpu_total)
    except Exception as e:  # noqa: BLE001 - a broken report fails the run, not the suite
        record["error"] = record["error"] or f"bad report: {type(e).__name__}: {e}"
        cons = []
    if (record["producer"] or {}).get("drained") is False:
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


def _metrics(record: dict, spec: RunSpec, cons: list[dict], poller: Poller,
             reports: dict, cpu_total: float) -> None:
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
    for key in ("cpu_s_per_sample", "cpu_window", "cpu_window_s", "run_cores",
                "machine_busy_cores", "other_load_cores"):
        record[key] = None
    if complete:
        _cpu_window(record, cons, poller)
        if record["cpu_s_per_sample"] is None:
            record["cpu_s_per_sample"] = record["cpu_s_per_sample_total"]
            record["cpu_window"] = "whole-run"
    _memory(record, cons, poller, reports)


def _cpu_window(record: dict, cons: list[dict], poller: Poller) -> None:
    """CPU per sample in the common measured window: every consumer past its warmup and
    none finished (left unset when the window is too short or the poller missed it)."""
    import numpy as np

    ws = max(c["t_start"] for c in cons)
    we = min(c["t_end"] for c in cons)
    med = statistics.median(c["seconds"] for c in cons)
    c0, c1 = poller.cpu_at(ws), poller.cpu_at(we)
    if we - ws < max(1.0, MIN_WINDOW_FRACTION * med) or c0 is None or c1 is None:
        return
    done = 0.0
    for c in cons:
        ts = [c["t_start"]] + c["done_times"]
        cum = np.concatenate([[0], np.cumsum(c["done_samples"])])
        done += float(np.interp(we, ts, cum) - np.interp(ws, ts, cum))
    if done <= 0:
        return
    record["cpu_s_per_sample"] = (c1 - c0) / done
    record["cpu_window"] = "common"
    record["cpu_window_s"] = we - ws
    record["run_cores"] = (c1 - c0) / (we - ws)
    b0, b1 = poller.cpu_at(ws, poller.busy), poller.cpu_at(we, poller.busy)
    if b0 is not None and b1 is not None:
        record["machine_busy_cores"] = (b1 - b0) / (we - ws)
        record["other_load_cores"] = max(0.0, record["machine_busy_cores"]
                                         - record["run_cores"])


def _memory(record: dict, cons: list[dict], poller: Poller, reports: dict) -> None:
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
