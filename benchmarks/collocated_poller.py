"""collocated.py's measurement of a run's process tree: a thread that polls, every
POLL_S, the CPU time and peak RSS of the run's processes (the orchestrator's children and
their DataLoader workers) and of the whole machine, and every SLOW_POLL_EVERY-th poll
their PSS and the shared-memory objects they map. The orchestrator only imports it."""

from __future__ import annotations

import os
import threading
import time

from bench_common import harness, vm_kb

POLL_S = 0.25  # /proc/<pid>/stat and status of the run's processes
SLOW_POLL_EVERY = 4  # PSS and shared-memory objects every 4th poll (1 s)

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
            c = harness().process_cpu_seconds(pid)
            if c is not None:
                self.cpu[pid] = max(c, self.cpu.get(pid, 0.0))
            hwm = vm_kb(pid).get("VmHWM")
            if hwm:
                self.hwm_kb[pid] = max(hwm, self.hwm_kb.get(pid, 0))
        self.series.append((now, sum(self.cpu.values())))
        busy = harness().machine_busy_seconds()
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
