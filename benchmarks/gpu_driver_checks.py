"""The real-GPU checks of issue 34 (docs/gpu.md, "Orderings on the GPU path"), runnable on
a real GPU (backend "torch") or on the CUDA driver double (backend "fake", no GPU: CI).

Shared by ``benchmarks/gpu_check.py --quick`` (after the issue-23 checks of gpu_checks.py),
``gpu_check.py --fake LIB`` (these checks only, on the double), tests/test_gpu_real.py
(test_issue34_check, on a GPU) and tests/test_gpu_driver_script.py (the quick form on
the double, in CI). Every check is a function ``check_<name>(opts) -> CheckResult``
(registered in CHECKS), built like gpu_checks.py's: real producer and consumer
processes (this file re-invoked with the hidden ``_role`` argument, each a new
interpreter, so exit handlers run as in a training script), reports judged here.

The two backends run the same scenarios. On "torch", a consumer's GPU work is torch's:
queued work is ``torch.cuda._sleep`` (calibrated to milliseconds once per process), a
capture is ``torch.cuda.graph``, a raw-pointer copy is ``cuMemcpyDtoDAsync_v2`` of the
real libcuda. On "fake", the consumer stands in for torch.cuda with the double
(tests/fakecuda.py, as tests/test_gpu_driver_rules.py does): its tensors are the DLPack
capsules of the slot's GPU copy exported on its "current" stream, queued work is
``fakecuda_launch_sleep``/``launch_read``, a capture is ``fakecuda_begin_capture``, and
the double's call log says what happened at exit. Where the fake's verdict would depend
on timing, it uses a gate (``launch_gate``) instead: a correct core passes however slow
the machine is. A check that makes no sense on the double says so (skipped).

The checks (the issue's list):

- exit_kept_batch: consumers exit without close() holding a batch with a 200 ms kernel
  queued on it; each exits 0 in time (fake: no driver call after the driver's teardown);
- producer_without_torch_cuda: producers of a GPU ring that never initialise torch's
  CUDA exit 0 (fake: the driver never unloaded after cuInit, nor called after teardown);
- capture_other_thread: thread A captures a CUDA graph while thread B takes batches and
  drops them every 10 ms: the capture stands, the graph replays right, no slot stays held;
- step_time: 15 ms of queued GPU work per step; the median step as is against one with
  a context synchronize at each next() (what the pre-12.5 release path did);
- two_consumers_one_process: two consumers of one ring in one process, then one of them
  closed: every batch right in both, zero-copy;
- consumer_in_producer_process: the documented fallback (GPUFallbackWarning, host copy);
- data_ptr_copy: a view read only through its raw pointer (SlotView.data_ptr) by a copy
  queued behind slow work on the legacy default stream: the slot is not refilled under it;
- copy_cache_95: TensorConsumer(copy=True) with torch's caching allocator holding 95% of
  the free device memory: right batches, copies out of torch's cache (torch only).

Batches are gpu_checks.ValueLoader's: batch b of epoch e is ``x`` float32 and ``y`` int64
filled with e * 1000 + b. Nothing here needs a GPU, torch's CUDA or the double to import.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import gpu_checks
from gpu_checks import (
    ATTACH_TIMEOUT, BATCH_TIMEOUT, LINE_TIMEOUT, MEMORY_TOLERANCE, CheckResult, Procs,
    ValueLoader, batch_value, no_gpu_ring, role_errors, role_producer, run_check, sums_ok,
    verdict,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TESTS = ROOT / "tests"  # tests/fakecuda.py: the double's ctypes wrapper and log reader

EXIT_TIMEOUT = 30.0  # a consumer exits within this once it reported (its handler: <= 10 s)
FLUSH_WAIT_MS = 10_000  # Ring.flush_releases(wait_ms): the releases finish within this
REFILL_TIMEOUT = 30.0  # the producer refills the slots a consumer dropped within this
HOLD_MS = 300.0  # torch: the queued work next() must not wait for (step_time)
HOLD_LIMIT_S = 20.0  # fake: the gate next() must not wait for opens by itself after this
CALIBRATION_CYCLES = 20_000_000  # torch.cuda._sleep cycles timed once per process
STEP_THRESHOLD = 0.9  # step_time: as-is median below this fraction of the synchronized one
SLOTS = 4  # ring slots, where a check does not need another number
FAKE_OLD_DRIVER = "12040"  # CUDA 12.4: no cuCtxRecordEvent (the old core synchronized there)


@dataclass
class DriverOptions:
    """Knobs of a run of the issue-34 checks (see torch_options and fake_options)."""

    backend: str = "torch"  # "torch": a real GPU; "fake": the driver double at lib
    lib: str | None = None  # the double (libfakecuda.so), backend "fake"
    device: int = 0  # the producer's GPU
    gpu_ring: bool = True  # the GPU has CUDA IPC events (gpu_checks.no_gpu_ring)
    exits: int = 30  # consumer processes of exit_kept_batch
    producer_runs: int = 20  # producer processes of producer_without_torch_cuda
    parallel: int = 6  # role processes of those two checks running at once
    kernel_ms: float = 200.0  # the kernel queued on a kept batch at exit
    steps: int = 40  # timed steps per phase of step_time
    gpu_ms: float = 15.0  # queued GPU work per step
    cpu_ms: float = 8.0  # CPU work per step
    batches: int = 16  # batches of data_ptr_copy (torch) and copy_cache_95
    sleep_ms: float = 50.0  # torch: the slow kernel ahead of each raw-pointer copy
    gate_s: float = 2.0  # fake: a gate the bug would open early opens after this
    take: int = 3 * SLOTS  # batches thread B takes during the capture (three rounds)
    shape: list[int] = field(default_factory=lambda: [64, 3, 32, 32])  # of x


def torch_options(device: int = 0) -> DriverOptions:
    """The issue's figures on real GPU `device` (gpu_ring from what tensorsocket sees)."""
    return DriverOptions(device=device, gpu_ring=gpu_checks.default_options(device).gpu_ring)


def fake_options(lib: str | Path) -> DriverOptions:
    """The quick form on the driver double `lib`: 3 exits, 3 producers, short loops, small
    batches (the double copies them with memcpy)."""
    return DriverOptions(backend="fake", lib=str(lib), exits=3, producer_runs=3, parallel=3,
                         steps=15, shape=[8, 3, 8, 8])


CHECKS: dict[str, Callable[[DriverOptions], CheckResult]] = {}
check = gpu_checks.register(CHECKS)  # this file's checks (issue 34)


def run_checks(names: list[str] | None = None, opts: DriverOptions | None = None,
               progress: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    """Run the named checks of this file (all by default) in order, with `opts` (default:
    the issue's figures on GPU 0); their results."""
    return gpu_checks.run_checks(names, opts or torch_options(), progress, CHECKS)


# -- the orchestrator's side of a backend ---------------------------------------------------


class Backend:
    """Where one check's roles run: their environment and, on the double, its call log
    (a file of this check's own) and what the processes left in /dev/shm."""

    def __init__(self, name: str, opts: DriverOptions) -> None:
        """A fresh log directory on the double; nothing on a GPU."""
        self.opts = opts
        self.fake = opts.backend == "fake"
        self.dir = Path(tempfile.mkdtemp(prefix=f"gdc-{name[:16]}-")) if self.fake else None

    @property
    def fakecuda(self) -> Any:
        """tests/fakecuda.py (imported on first use: the double's log and shm objects)."""
        if str(TESTS) not in sys.path:
            sys.path.insert(0, str(TESTS))
        import fakecuda

        return fakecuda

    def env(self, **extra: str) -> dict:
        """The environment of a role process (on the double: the library and its log)."""
        if not self.fake:
            return dict(extra)
        assert self.dir is not None and self.opts.lib is not None
        return {"TENSORSOCKET_LIBCUDA": self.opts.lib, "FAKECUDA_LOG": str(self.dir / "cuda.log"),
                **extra}

    def ops(self, pid: int, op: str) -> list:
        """The double's log lines of op by process pid ([] on a GPU)."""
        if not self.fake:
            return []
        assert self.dir is not None
        return self.fakecuda.select(self.fakecuda.parse_log(self.dir / "cuda.log"), op, pid=pid)

    def count(self, runs: list[dict], op: str) -> int:
        """The double's log lines of op by the processes of `runs` (their "pid")."""
        return sum(len(self.ops(r["pid"], op)) for r in runs)

    def exit_errors(self, pid: int, who: str) -> list[str]:
        """On the double: what process pid's exit did wrong (no teardown seen, a driver
        call after the teardown, the driver unloaded after cuInit)."""
        if not self.fake:
            return []
        errors = []
        if not self.ops(pid, "teardown"):
            errors.append(f"{who} {pid}: the driver's exit teardown did not run (no exit())")
        late = [ln.get("op") for ln in self.ops(pid, "after_teardown")]
        if late:
            errors.append(f"{who} {pid}: driver calls after the driver's teardown: {late[:5]}")
        if self.ops(pid, "unloaded_after_init"):
            errors.append(f"{who} {pid}: the driver was unloaded after cuInit")
        return errors

    def finish(self, pids: list[int]) -> list[str]:
        """Remove what the processes in the log left in /dev/shm; the objects of `pids`
        (processes that must have ended cleanly) as errors."""
        if not self.fake:
            return []
        assert self.dir is not None
        logged = {ln.pid for ln in self.fakecuda.parse_log(self.dir / "cuda.log")}
        errors = []
        for pid in sorted(logged):
            left = self.fakecuda.cleanup_shm(pid)
            if left and pid in pids:
                errors.append(f"process {pid} left device memory or events behind: {left}")
        return errors

    def close(self) -> None:
        """Remove the log directory."""
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


def _run(name: str, opts: DriverOptions,
         body: Callable[[Procs, Backend], tuple[list[str], str, dict, list[int]]]) -> CheckResult:
    """Run body(procs, backend) -> (errors, figure, data, pids that must end clean) as
    check `name` (gpu_checks.run_check, roles of this file); on the double, leftovers in
    /dev/shm of those pids fail it."""
    backend = Backend(name, opts)
    pids: list[int] = []

    def run(procs: Procs) -> CheckResult:
        """body's verdict (gpu_checks.run_check's fn)."""
        errors, figure, data, clean = body(procs, backend)
        pids.extend(clean)
        return verdict(name, errors, figure, data)

    try:
        res = run_check(name, run, Path(__file__).resolve())
        left = backend.finish(pids)
    finally:
        backend.close()
    if left and res.ok:
        res.ok, res.detail = False, "\n".join(left)
    return res


def _consumer_args(procs: Procs, opts: DriverOptions, scenario: str, **extra: Any) -> dict:
    """The arguments of a consumer role running `scenario` on opts' backend."""
    return {"name": procs.name, "scenario": scenario, "backend": opts.backend, "lib": opts.lib,
            "device": opts.device, **extra}


def _producer_args(procs: Procs, opts: DriverOptions, batches: int, **extra: Any) -> dict:
    """The arguments of a producer role (gpu_checks.role_producer) of a GPU ring."""
    return {"name": procs.name, "device": f"cuda:{opts.device}", "batches": batches,
            "slots": SLOTS, "shape": opts.shape, **extra}


def _pair(procs: Procs, backend: Backend, producer: dict, consumer: dict,
          consumer_env: dict | None = None) -> tuple[dict, dict, list[int]]:
    """A producer and a consumer started together (unlike gpu_checks._pair, which waits for
    the producer's "ready": the consumer waits for the producer to appear, and the two
    interpreters start up side by side), run to their ends: their reports and pids."""
    p = procs.start("producer", producer, backend.env())
    c = procs.start("consumer", consumer, backend.env(**(consumer_env or {})))
    cr = procs.result(c)
    pr = procs.result(p)
    return pr, cr, [p.pid, c.pid]


def _waves(n: int, width: int) -> list[range]:
    """range(n) cut into consecutive runs of at most width."""
    return [range(i, min(n, i + width)) for i in range(0, n, max(1, width))]


def _skip_on_fake(name: str, opts: DriverOptions, why: str) -> CheckResult | None:
    """A skipped result on the double, with why."""
    if opts.backend == "fake":
        return CheckResult(name, None, skipped=f"not on the driver double: {why}")
    return None


# -- the checks ---------------------------------------------------------------------------


@check
def check_exit_kept_batch(opts: DriverOptions) -> CheckResult:
    """opts.exits consumer processes (new interpreters, opts.parallel at once, each with
    a producer of its own) each keep a batch in a module global, queue a kernel of
    opts.kernel_ms reading it, take the producer's two other batches and exit without
    close(): each exits 0 within EXIT_TIMEOUT, with no driver error on stderr, and its
    producer ends cleanly; on the double, both exits ran the driver's teardown and made
    no driver call after it. On a GPU, most kernels must still have been queued when the
    role finished (the hazard was set up); on the double that is a figure only (a timing)."""
    skipped = no_gpu_ring("exit_kept_batch", opts)
    if skipped:
        return skipped

    def body(procs: Procs, backend: Backend) -> tuple[list[str], str, dict, list[int]]:
        """The roles of this check, run; (errors, figure, data, pids that end clean)."""
        runs: list[dict] = []
        producers: list[dict] = []
        for wave in _waves(opts.exits, opts.parallel):
            names = [f"{procs.name}-{i}" for i in wave]
            ps = [procs.start("producer", _producer_args(procs, opts, 3, name=n),
                              backend.env()) for n in names]
            cs = [procs.start("consumer", _consumer_args(procs, opts, "exit_kept", name=n,
                                                         kernel_ms=opts.kernel_ms),
                              backend.env()) for n in names]
            for p, c in zip(ps, cs):
                r = procs.line(c, "result")["result"]
                t0 = time.monotonic()
                exited = procs.wait_exit(c, EXIT_TIMEOUT)
                r.update(pid=c.pid, exit=c.returncode if exited else None,
                         exit_s=time.monotonic() - t0, stderr=procs.stderr(c))
                runs.append(r)
                producers.append({**procs.result(p), "pid": p.pid})
        errors = role_errors(*runs, *producers)
        for r in runs:
            if r["exit"] is None:
                errors.append(f"consumer {r['pid']} did not exit within {EXIT_TIMEOUT:.0f} s")
            if "Traceback" in r["stderr"]:
                errors.append(f"consumer {r['pid']}: a traceback at exit: "
                              f"{r['stderr'][-300:]}")
            errors += backend.exit_errors(r["pid"], "consumer")
        for r in producers:
            errors += backend.exit_errors(r["pid"], "producer")
        queued = sum(bool(r.get("kernel_queued")) for r in runs)
        if not backend.fake and queued < len(runs) // 2 + 1:  # the double: a figure only
            errors.append(f"only {queued} of {len(runs)} kernels were still queued when the "
                          "role finished: the hazard was not set up")
        ok = sum(r["exit"] == 0 for r in runs)
        worst = max((r["exit_s"] for r in runs), default=0.0)
        fig = (f"{ok}/{len(runs)} exited 0, slowest exit {worst:.2f} s, {queued} with the "
               f"{opts.kernel_ms:.0f} ms kernel still queued; producers exited 0: "
               f"{sum(r['exit'] == 0 for r in producers)}")
        if backend.fake:
            fig += f"; after_teardown calls {backend.count(runs, 'after_teardown')}"
        return errors, fig, {"runs": runs, "producers": producers}, \
            [r["pid"] for r in runs + producers]
    return _run("exit_kept_batch", opts, body)


@check
def check_producer_without_torch_cuda(opts: DriverOptions) -> CheckResult:
    """opts.producer_runs producer processes of a GPU ring (min_consumers=0: they publish
    with nobody attached), none of which initialises torch's CUDA (the driver is loaded
    by tensorsocket only): each ran a GPU ring and exited 0 with no driver error; on the
    double, the driver was never unloaded after cuInit nor called after its teardown."""
    skipped = no_gpu_ring("producer_without_torch_cuda", opts)
    if skipped:
        return skipped

    def body(procs: Procs, backend: Backend) -> tuple[list[str], str, dict, list[int]]:
        """The roles of this check, run; (errors, figure, data, pids that end clean)."""
        runs: list[dict] = []
        for wave in _waves(opts.producer_runs, opts.parallel):
            ps = [procs.start("producer", _producer_args(procs, opts, SLOTS, min_consumers=0,
                                                         name=f"{procs.name}-{i}"),
                              backend.env()) for i in wave]
            for p in ps:
                r = procs.result(p)
                r["pid"] = p.pid
                runs.append(r)
        errors = role_errors(*runs)
        for r in runs:
            if (r.get("stats") or {}).get("device") != f"cuda:{opts.device}":
                errors.append(f"producer {r['pid']} did not run a GPU ring: "
                              f"{(r.get('stats') or {}).get('device')}, {r.get('warnings')}")
            if r.get("torch_cuda"):
                errors.append(f"producer {r['pid']} initialised torch's CUDA")
            errors += backend.exit_errors(r["pid"], "producer")
        ok = sum(r["exit"] == 0 for r in runs)
        rings = sum(str((r.get("stats") or {}).get("device")).startswith("cuda") for r in runs)
        fig = f"{ok}/{len(runs)} exited 0, {rings} ran a GPU ring"
        if backend.fake:
            fig += (f"; unloaded_after_init {backend.count(runs, 'unloaded_after_init')}, "
                    f"after_teardown {backend.count(runs, 'after_teardown')}")
        return errors, fig, {"runs": runs}, [r["pid"] for r in runs]
    return _run("producer_without_torch_cuda", opts, body)


@check
def check_capture_other_thread(opts: DriverOptions) -> CheckResult:
    """Thread A captures a CUDA graph (global capture mode, a stream of its own) and
    keeps the capture open while thread B takes opts.take batches (three rounds of the
    ring), dropping each 10 ms after next(): the capture did not raise and stays valid,
    the graph replays right (torch), no context-wide call was made (fake), B took every
    batch during the capture, and no slot is still held by the consumer after a flush."""
    skipped = no_gpu_ring("capture_other_thread", opts)
    if skipped:
        return skipped

    def body(procs: Procs, backend: Backend) -> tuple[list[str], str, dict, list[int]]:
        """The roles of this check, run; (errors, figure, data, pids that end clean)."""
        pr, cr, pids = _pair(procs, backend, _producer_args(procs, opts, opts.take + SLOTS),
                             _consumer_args(procs, opts, "capture", take=opts.take,
                                            slots=SLOTS))
        errors = role_errors(pr, cr)
        if cr.get("capture_error"):
            errors.append(f"the capture raised: {cr['capture_error']}")
        if cr.get("capture_valid") is False:
            errors.append("the capture was invalidated")
        if not backend.fake and not cr.get("replay_ok") and not cr.get("capture_error"):
            errors.append("the graph replayed wrong")
        if cr.get("taken") != opts.take:
            errors.append(f"thread B took {cr.get('taken')} batches during the capture, "
                          f"expected {opts.take}")
        if cr.get("held_after") != 0:
            errors.append(f"{cr.get('held_after')} slots still held after the capture and a "
                          "flush: the producer could not refill them")
        if cr.get("context_wide"):
            errors.append(f"{cr['context_wide']} context-wide driver calls")
        if backend.fake:
            outcome = "valid" if cr.get("capture_valid") else "invalidated"
        else:
            outcome = "replays " + ("right" if cr.get("replay_ok") else "wrong")
        fig = (f"capture {'raised' if cr.get('capture_error') else 'ok'}, {outcome}, "
               f"{cr.get('taken')} batches taken during it, {cr.get('held_after')} slots "
               "held after")
        if backend.fake:
            fig += f", context-wide calls {cr.get('context_wide')}"
        return errors, fig, {"producer": pr, "consumer": cr}, pids
    return _run("capture_other_thread", opts, body)


@check
def check_step_time(opts: DriverOptions) -> CheckResult:
    """A training loop does opts.cpu_ms of CPU work per step, then queues opts.gpu_ms of
    GPU work on the current stream: the median step as is, and with a context synchronize
    before each next() (what the pre-12.5 release path did: cuCtxSynchronize). On a GPU
    it fails unless the first is below STEP_THRESHOLD of the second (the CPU/GPU overlap
    kept); on both backends, next() must return while work queued before it still runs;
    on the double (a 12.4 driver, no cuCtxRecordEvent) the core makes no context-wide
    call. Since issue 34 there is no separate cuCtxRecordEvent path to measure."""
    skipped = no_gpu_ring("step_time", opts)
    if skipped:
        return skipped

    def body(procs: Procs, backend: Backend) -> tuple[list[str], str, dict, list[int]]:
        """The roles of this check, run; (errors, figure, data, pids that end clean)."""
        warmup = 3
        env = {"FAKECUDA_DRIVER_VERSION": FAKE_OLD_DRIVER} if backend.fake else {}
        pr, cr, pids = _pair(
            procs, backend, _producer_args(procs, opts, 2 * (warmup + opts.steps) + 2 * SLOTS),
            _consumer_args(procs, opts, "steps", steps=opts.steps, warmup=warmup,
                           gpu_ms=opts.gpu_ms, cpu_ms=opts.cpu_ms), env)
        errors = role_errors(pr, cr)
        as_is, synced = cr.get("as_is_ms"), cr.get("synced_ms")
        ratio = as_is / synced if as_is and synced else None
        if not backend.fake and (ratio is None or ratio >= STEP_THRESHOLD):
            errors.append(f"step median {as_is} ms as is against {synced} ms with a context "
                          f"synchronize at each next(): the overlap is lost")
        if not cr.get("overlap"):
            errors.append("next() waited for the GPU work queued before it")
        if cr.get("context_wide"):
            errors.append(f"{cr['context_wide']} context-wide driver calls by the core")
        fig = (f"median step {as_is or 0:.1f} ms as is, {synced or 0:.1f} ms with a context "
               f"sync per next() (pre-12.5 path), ratio "
               f"{'n/a' if ratio is None else f'{ratio:.2f}'}; next() "
               f"{'did not wait' if cr.get('overlap') else 'waited'} for queued work")
        if backend.fake:
            fig += f"; driver 12.4, context-wide calls {cr.get('context_wide')}"
        fig += "; cuCtxRecordEvent: no separate path since issue 34"
        return errors, fig, {"producer": pr, "consumer": cr}, pids
    return _run("step_time", opts, body)


@check
def check_two_consumers_one_process(opts: DriverOptions) -> CheckResult:
    """Two consumers of one GPU ring in one process read epoch 0 in turns (both zero-copy,
    every batch right in both; they share one mapping, the driver counting the opens);
    then one closes and the other reads epoch 1 alone, every batch right (the first
    one's close did not unmap the memory under it)."""
    skipped = no_gpu_ring("two_consumers_one_process", opts)
    if skipped:
        return skipped

    def body(procs: Procs, backend: Backend) -> tuple[list[str], str, dict, list[int]]:
        """The roles of this check, run; (errors, figure, data, pids that end clean)."""
        batches = 2 * SLOTS
        pr, cr, pids = _pair(procs, backend,
                             _producer_args(procs, opts, batches, epochs=2, min_consumers=2),
                             _consumer_args(procs, opts, "two_consumers"))
        errors = role_errors(pr, cr)
        want = [[batch_value({}, 0, b) for b in range(batches)]] * 2
        if cr.get("shared_epoch") != want:
            errors.append(f"epoch 0 values {cr.get('shared_epoch')}, expected {want}")
        alone = [batch_value({}, 1, b) for b in range(batches)]
        if cr.get("alone_epoch") != alone:
            errors.append(f"epoch 1 (after the other closed) {cr.get('alone_epoch')}, "
                          f"expected {alone}")
        if cr.get("zero_copy") != [True, True]:
            errors.append(f"zero_copy_gpu {cr.get('zero_copy')}")
        opens = backend.ops(pids[1], "ipc_open_mem")
        fig = (f"{len(cr.get('shared_epoch') or [[]])} x {batches} batches together, "
               f"{len(cr.get('alone_epoch') or [])} alone after one closed, "
               f"{len(cr.get('errors', []))} wrong; same device pointer "
               f"{cr.get('same_pointer')}")
        if backend.fake:
            cached = sum(ln.get("cached") == "1" for ln in opens)
            fig += f"; {len(opens)} handle opens, {cached} of them cached"
        return errors, fig, {"producer": pr, "consumer": cr}, pids
    return _run("two_consumers_one_process", opts, body)


@check
def check_consumer_in_producer_process(opts: DriverOptions) -> CheckResult:
    """A consumer in the producer's own process (the producer iterating in a thread):
    a GPUFallbackWarning saying it "runs in the producer's own process", host tensors with
    every batch right, and the ring itself still a GPU ring."""
    skipped = no_gpu_ring("consumer_in_producer_process", opts)
    if skipped:
        return skipped

    def body(procs: Procs, backend: Backend) -> tuple[list[str], str, dict, list[int]]:
        """The roles of this check, run; (errors, figure, data, pids that end clean)."""
        batches = 2 * SLOTS
        p = procs.start("same_process", {"name": procs.name, "device": opts.device,
                                         "batches": batches, "shape": opts.shape},
                        backend.env())
        r = procs.result(p)
        errors = role_errors(r)
        if not r.get("fallback_warning"):
            errors.append(f"no GPUFallbackWarning naming the producer's process: "
                          f"{r.get('warnings')}")
        if r.get("values") != [batch_value({}, 0, b) for b in range(batches)]:
            errors.append(f"values {r.get('values')}")
        if r.get("devices") != ["cpu"] or r.get("zero_copy_gpu") is not False:
            errors.append(f"delivered on {r.get('devices')}, zero_copy_gpu "
                          f"{r.get('zero_copy_gpu')}: expected the host copy")
        if r.get("ring_device") != f"cuda:{opts.device}":
            errors.append(f"the producer's ring is on {r.get('ring_device')}")
        fig = (f"fallback warning {bool(r.get('fallback_warning'))}, {len(r.get('values', []))}"
               f" host batches, {len(r.get('errors', []))} wrong, ring on {r.get('ring_device')}")
        return errors, fig, {"role": r}, [p.pid]
    return _run("consumer_in_producer_process", opts, body)


@check
def check_data_ptr_copy(opts: DriverOptions) -> CheckResult:
    """Views handed out as SlotViews and read only through data_ptr (as CuPy, Triton or
    a kernel of one's own would): a copy out of the raw pointer queued on the legacy
    default stream (torch's default current stream) behind slow work (torch:
    torch.cuda._sleep, then cuMemcpyDtoDAsync_v2 of the real driver; fake: a gate, then
    launch_read), the view dropped at once: the producer does not refill the slot under
    the copy, which holds its own batch."""
    skipped = no_gpu_ring("data_ptr_copy", opts)
    if skipped:
        return skipped

    def body(procs: Procs, backend: Backend) -> tuple[list[str], str, dict, list[int]]:
        """The roles of this check, run; (errors, figure, data, pids that end clean)."""
        batches = opts.batches if not backend.fake else 2 * SLOTS
        slots = 2 if not backend.fake else SLOTS
        pr, cr, pids = _pair(procs, backend, _producer_args(procs, opts, batches, slots=slots),
                             _consumer_args(procs, opts, "raw_pointer", slots=slots,
                                            sleep_ms=opts.sleep_ms, gate_s=opts.gate_s,
                                            shape=opts.shape))
        errors = role_errors(pr, cr)
        checked = cr.get("checked", 0)
        if not checked:
            errors.append("no copy was checked")
        if cr.get("pending_at_drop", 0) < (checked + 1) // 2:
            errors.append(f"only {cr.get('pending_at_drop')} of {checked} copies were still "
                          "queued when their view was dropped: the hazard was not set up")
        fig = (f"{checked} {'read' if backend.fake else 'copy'}(s) through data_ptr, "
               f"{cr.get('bad', '?')} wrong, {cr.get('pending_at_drop')} still queued at the "
               "drop")
        return errors, fig, {"producer": pr, "consumer": cr}, pids
    return _run("data_ptr_copy", opts, body)


@check
def check_copy_cache_95(opts: DriverOptions) -> CheckResult:
    """TensorConsumer(copy=True) after torch's caching allocator was made to reserve 95%
    of the device's free memory (tensors allocated, then freed: they stay reserved):
    every batch right, no out-of-memory, and torch's reserved memory does not grow by
    more than MEMORY_TOLERANCE (the copies are torch's, out of its cache)."""
    skipped = no_gpu_ring("copy_cache_95", opts) or _skip_on_fake(
        "copy_cache_95", opts, "copy=True copies with torch (clone()), and CPU torch has no "
        "CUDA caching allocator")
    if skipped:
        return skipped

    def body(procs: Procs, backend: Backend) -> tuple[list[str], str, dict, list[int]]:
        """The roles of this check, run; (errors, figure, data, pids that end clean)."""
        shape = [64, 3, 224, 224]  # 38.5 MB: a copy the cache must hold
        pr, cr, pids = _pair(procs, backend,
                             _producer_args(procs, opts, opts.batches, shape=shape),
                             _consumer_args(procs, opts, "copy_cache"))
        errors = role_errors(pr, cr)
        if cr.get("checked") != opts.batches:
            errors.append(f"checked {cr.get('checked')} batches, expected {opts.batches}")
        if cr.get("reserved_fraction", 0) < 0.9:
            errors.append(f"the cache reserved only {cr.get('reserved_fraction')} of the free "
                          "memory: the condition was not set up")
        if cr.get("reserved_growth", 0) > MEMORY_TOLERANCE:
            errors.append(f"torch's reserved memory grew {cr['reserved_growth'] >> 20} MiB "
                          "while copying: not out of its cache")
        gib = 1 << 30
        fig = (f"cache {cr.get('reserved', 0) / gib:.1f} GiB ({cr.get('reserved_fraction', 0):.0%}"
               f" of free), {cr.get('free_after_fill', 0) / gib:.1f} GiB left; "
               f"{cr.get('checked')} copies, {cr.get('bad', '?')} wrong, reserved "
               f"+{cr.get('reserved_growth', 0) >> 20} MiB")
        return errors, fig, {"producer": pr, "consumer": cr}, pids
    return _run("copy_cache_95", opts, body)


# -- roles (run in child processes) ---------------------------------------------------------


class TorchGpu:
    """A consumer's GPU work as torch does it, on a real GPU (role side)."""

    kind = "torch"

    def __init__(self, device: int) -> None:
        """torch's CUDA initialised on `device`, made current."""
        import torch

        self.torch = torch
        self.device = torch.device("cuda", device)
        torch.cuda.set_device(self.device)
        torch.cuda.init()
        self._cycles_per_ms: float | None = None

    def cycles_per_ms(self) -> float:
        """torch.cuda._sleep cycles per millisecond, timed once with events."""
        if self._cycles_per_ms is None:
            torch = self.torch
            torch.cuda._sleep(1000)  # the kernel loaded before it is timed
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(CALIBRATION_CYCLES)
            end.record()
            end.synchronize()
            self._cycles_per_ms = CALIBRATION_CYCLES / max(start.elapsed_time(end), 1e-3)
        return self._cycles_per_ms

    def sleep(self, ms: float) -> None:
        """Queue ms of GPU work touching nothing on the current stream."""
        self.torch.cuda._sleep(int(ms * self.cycles_per_ms()))

    def read(self, leaf: Any) -> Any:
        """Queue a kernel reading the whole leaf on the current stream."""
        return leaf.sum(dtype=self.torch.float64)

    def slow_read(self, leaf: Any, ms: float) -> Any:
        """Queue ms of GPU work, then a kernel reading leaf, on the current stream."""
        self.sleep(ms)
        return self.read(leaf)

    def mark(self) -> Callable[[], bool]:
        """A question: has the work queued on the current stream so far finished?"""
        event = self.torch.cuda.Event()
        event.record()
        return event.query

    def synchronize(self) -> None:
        """Wait for all the GPU work of the context (torch.cuda.synchronize)."""
        self.torch.cuda.synchronize(self.device)

    def stream_number(self) -> int | None:
        """The DLPack number of the current stream, as the consumer's flush names it."""
        from tensorsocket.data import delivery

        return delivery.current_stream(self.device)

    def pointer(self, leaf: Any) -> int:
        """The device address of a delivered tensor."""
        return leaf.data_ptr()

    def batch_ok(self, batch: Any, v: int) -> bool:
        """Whether the delivered batch holds v everywhere (checked on the GPU)."""
        x, y = batch["x"], batch["y"]
        return sums_ok(x.sum(dtype=self.torch.float64), y.sum(), v, x.numel(), y.numel())

    def hold(self, limit_s: float) -> tuple[Callable[[], bool], Callable[[], None]]:
        """Queue HOLD_MS of work on the current stream: (is it still running?, let it
        go). limit_s is for the double's gate; a kernel ends by itself."""
        self.sleep(HOLD_MS)
        done = self.mark()
        return (lambda: not done()), (lambda: None)


class FakeGpu:
    """The driver double standing in for torch.cuda in a consumer (role side): a primary
    context, a non-blocking "current" stream that the consumer exports its batches to and
    reports as torch's current stream (fakecuda.deliver_device_tensors), and the double's
    test kernels."""

    kind = "fake"

    def __init__(self, lib: str) -> None:
        """Load the double, make its context current here and install the stand-in."""
        if str(TESTS) not in sys.path:
            sys.path.insert(0, str(TESTS))
        import fakecuda
        from tensorsocket.data import delivery

        self.fakecuda = fakecuda
        self.fc = fakecuda.FakeCuda(lib)
        self.ctx = self.fc.setup(0)
        self.stream = self.fc.stream_create(fakecuda.CU_STREAM_NON_BLOCKING)
        fakecuda.deliver_device_tensors(delivery, self.stream)

    def sleep(self, ms: float) -> None:
        """Queue ms of work touching nothing on the current stream."""
        self.fc.launch_sleep(self.stream, int(ms * 1000))

    def read(self, leaf: Any) -> Any:
        """Queue the double's checksum kernel over the leaf on the current stream."""
        return self.fc.launch_read(self.stream, leaf.ptr, leaf.nbytes)

    def slow_read(self, leaf: Any, ms: float) -> Any:
        """Queue a checksum kernel over the leaf that takes ms, on the current stream."""
        return self.fc.launch_read(self.stream, leaf.ptr, leaf.nbytes, int(ms * 1000))

    def mark(self) -> Callable[[], bool]:
        """A question: has the work queued on the current stream so far finished?"""
        event = self.fc.event_create()
        self.fc.event_record(event, self.stream)
        return lambda: self.fc.event_query(event)

    def synchronize(self) -> None:
        """Wait for all the work of the context (cuCtxSynchronize)."""
        self.fc.ctx_synchronize()

    def stream_number(self) -> int:
        """The current stream, as the consumer's flush names it."""
        return self.stream

    def pointer(self, leaf: Any) -> int:
        """The device address of a delivered leaf."""
        return leaf.ptr

    def batch_ok(self, batch: Any, v: int) -> bool:
        """Whether the delivered batch holds v everywhere (its device bytes read back)."""
        import numpy as np

        x, y = batch["x"], batch["y"]
        xs = np.frombuffer(self.fc.read(x.ptr, x.nbytes), np.float32)
        ys = np.frombuffer(self.fc.read(y.ptr, y.nbytes), np.int64)
        return bool((xs == v).all() and (ys == v).all())

    def hold(self, limit_s: float) -> tuple[Callable[[], bool], Callable[[], None]]:
        """A gate on the current stream: (is it still closed?, open it). It opens by
        itself after limit_s, so a core that waits for it is not stuck for good."""
        gate = self.fc.launch_gate(self.stream)
        timer = threading.Timer(limit_s, lambda: setattr(gate, "value", 1))
        timer.start()

        def release() -> None:
            """Open the gate now."""
            gate.value = 1
            timer.cancel()

        return (lambda: gate.value == 0), release

    def context_wide(self) -> int:
        """Context-wide calls made in this process so far (cuCtxRecordEvent, cuCtxSynchronize)."""
        return self.fc.counter("ctx_record_event") + self.fc.counter("ctx_sync")


def _gpu(a: dict) -> TorchGpu | FakeGpu:
    """The role's GPU backend (a["backend"])."""
    return FakeGpu(a["lib"]) if a["backend"] == "fake" else TorchGpu(a["device"])


def _open(a: dict, **kw: Any) -> Any:
    """A TensorConsumer of the check's producer."""
    from tensorsocket import TensorConsumer

    return TensorConsumer(name=a["name"], timeout=ATTACH_TIMEOUT, batch_timeout=BATCH_TIMEOUT,
                          **kw)


def _slots_not_refilled(consumer: Any, published: int) -> int:
    """How many of the slots this consumer dropped the producer could not refill: it
    waits (up to REFILL_TIMEOUT) for `published` batches in all, every slot dropped
    having come round once more; a slot still held stops it short."""
    deadline = time.monotonic() + REFILL_TIMEOUT
    while consumer.ring.info()["published"] < published and time.monotonic() < deadline:
        time.sleep(0.005)
    return max(0, published - consumer.ring.info()["published"])


def _spin(ms: float) -> None:
    """ms of CPU work (a busy loop)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


_KEPT: list = []  # what the exit scenario keeps until the interpreter exits


def _scenario_exit_kept(gpu: TorchGpu | FakeGpu, a: dict) -> dict:
    """Keep a batch (and the consumer) in a module global with a kernel of kernel_ms
    queued on it, take two more batches, and return: the role exits without close()."""
    consumer = _open(a)
    it = iter(consumer)
    batch = next(it)
    read = gpu.slow_read(batch["x"], a["kernel_ms"])
    done = gpu.mark()
    _KEPT.extend([consumer, it, batch, read, next(it), next(it)])
    return {"kernel_queued": not done(), "errors": []}


def _scenario_capture(gpu: TorchGpu | FakeGpu, a: dict) -> dict:
    """Thread A captures (global mode, a stream of its own) while this thread takes
    a["take"] batches, dropping each 10 ms after next(); then a flush, and the slots the
    producer cannot refill counted (it publishes take + slots batches in all); the rest
    of the epoch drained."""
    consumer = _open(a)
    it = iter(consumer)
    began, done = threading.Event(), threading.Event()
    out: dict = {"errors": []}
    capture = _capture_torch if gpu.kind == "torch" else _capture_fake
    thread = threading.Thread(target=capture, args=(gpu, began, done, out))
    thread.start()
    began.wait(LINE_TIMEOUT)
    taken = 0
    try:
        while taken < a["take"] and not out.get("capture_error"):
            batch = next(it)
            time.sleep(0.01)  # pacing, as a training step: no verdict depends on it
            del batch
            taken += 1
    finally:
        done.set()
        thread.join(LINE_TIMEOUT)
    consumer.ring.flush_releases(FLUSH_WAIT_MS, gpu.stream_number())
    out["held_after"] = _slots_not_refilled(consumer, taken + a["slots"])
    out["taken"] = taken
    if isinstance(gpu, FakeGpu):
        out["context_wide"] = gpu.context_wide()
    for batch in it:
        del batch
    consumer.close()
    return out


def _capture_torch(gpu: TorchGpu, began: threading.Event, done: threading.Event,
                   out: dict) -> None:
    """Thread A on a GPU: torch.cuda.graph of a few ops, open until done; then a replay,
    checked."""
    torch = gpu.torch
    try:
        with torch.cuda.device(gpu.device):
            static = torch.ones(1 << 16, device=gpu.device)
            warm = torch.cuda.Stream(gpu.device)  # warm-up on a side stream, as torch asks
            warm.wait_stream(torch.cuda.current_stream(gpu.device))
            with torch.cuda.stream(warm):
                (static * 2.0 + 1.0).relu()
            torch.cuda.current_stream(gpu.device).wait_stream(warm)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # capture_error_mode "global", the strictest
                result = (static * 2.0 + 1.0).relu() + static
                began.set()
                done.wait(LINE_TIMEOUT)
            static.fill_(3.0)
            graph.replay()
            torch.cuda.synchronize(gpu.device)
            out["replay_ok"] = bool((result == 10.0).all().item())
    except Exception as e:  # the capture (or the replay) failed: the verdict says so
        out["capture_error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        began.set()


def _capture_fake(gpu: FakeGpu, began: threading.Event, done: threading.Event,
                  out: dict) -> None:
    """Thread A on the double: a simulated global-mode capture of a stream of its own,
    open until done; whether it is still valid at its end."""
    fakecuda = gpu.fakecuda
    try:
        gpu.fc.ctx_push(gpu.ctx)
        stream = gpu.fc.stream_create(fakecuda.CU_STREAM_NON_BLOCKING)
        gpu.fc.begin_capture(stream, fakecuda.CU_STREAM_CAPTURE_MODE_GLOBAL)
        began.set()
        done.wait(LINE_TIMEOUT)
        out["capture_valid"] = gpu.fc.end_capture(stream)
        out["invalidated"] = gpu.fc.counter("capture_invalidated")
    except Exception as e:  # a failed call of the double: the verdict says so
        out["capture_error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        began.set()


def _scenario_steps(gpu: TorchGpu | FakeGpu, a: dict) -> dict:
    """Two phases of warmup + steps training steps (CPU work, then GPU work and a read of
    the batch queued on the current stream, then the batch dropped): as is, then with a
    context synchronize before each next(); the median time between next() returns. As
    is, a step's CPU work overlaps the previous step's GPU work (max of the two); with the
    synchronize it cannot (their sum). Then whether next() returns while work queued
    before it still runs."""
    consumer = _open(a)
    it = iter(consumer)
    medians: dict = {}
    core_syncs = 0  # the double's cuCtxSynchronize calls made by the core (not by us)
    for phase in ("as_is", "synced"):
        times: list[float] = []
        last = None
        for step in range(a["warmup"] + a["steps"]):
            if phase == "synced":
                gpu.synchronize()
            batch = next(it)
            now = time.perf_counter()
            if last is not None and step > a["warmup"]:
                times.append(now - last)
            last = now
            _spin(a["cpu_ms"])  # the step's CPU side, ahead of its GPU work
            gpu.sleep(a["gpu_ms"])
            gpu.read(batch["x"])
            del batch
        if isinstance(gpu, FakeGpu) and phase == "as_is":
            core_syncs = gpu.fc.counter("ctx_sync")  # ours are the synced phase's
        gpu.synchronize()
        medians[phase] = round(statistics.median(times) * 1e3, 2)
    ours = gpu.fc.counter("ctx_sync") if isinstance(gpu, FakeGpu) else 0
    batch = next(it)
    still_running, release = gpu.hold(HOLD_LIMIT_S)
    gpu.read(batch["x"])
    del batch
    batch = next(it)
    overlap = still_running()
    release()
    del batch
    context_wide = 0
    if isinstance(gpu, FakeGpu):
        core_syncs += gpu.fc.counter("ctx_sync") - ours
        context_wide = core_syncs + gpu.fc.counter("ctx_record_event")
    for batch in it:
        del batch
    consumer.close()
    return {"as_is_ms": medians["as_is"], "synced_ms": medians["synced"], "overlap": overlap,
            "context_wide": context_wide, "errors": []}


def _scenario_two_consumers(gpu: TorchGpu | FakeGpu, a: dict) -> dict:
    """Two consumers in this process read epoch 0 in turns; the first closes; the second
    reads epoch 1 alone. Every batch checked on the device."""
    first, second = _open(a), _open(a)
    errors: list[str] = []
    shared: list[list[int]] = [[], []]
    same_pointer = True
    its = [iter(first), iter(second)]
    b = 0
    while True:
        pair = [next(it, None) for it in its]
        if None in pair:
            break
        v = batch_value({}, 0, b)
        for i, batch in enumerate(pair):
            shared[i].append(v)
            if not gpu.batch_ok(batch, v):
                errors.append(f"consumer {i}, batch {b}: content is not {v}")
        same_pointer &= gpu.pointer(pair[0]["x"]) == gpu.pointer(pair[1]["x"])
        del pair, batch
        b += 1
    for i, batch in enumerate(pair):
        if batch is not None:  # this one goes on where the other ended: read its rest
            shared[i].append(-1)
            del batch
            for batch in its[i]:
                shared[i].append(-1)
                del batch
    zero_copy = [first.stats()["zero_copy_gpu"], second.stats()["zero_copy_gpu"]]
    first.close()
    alone = []
    for b, batch in enumerate(second):
        v = batch_value({}, 1, b)
        alone.append(v)
        if not gpu.batch_ok(batch, v):
            errors.append(f"consumer 1 alone, batch {b}: content is not {v}")
        del batch
    second.close()
    return {"shared_epoch": shared, "alone_epoch": alone, "zero_copy": zero_copy,
            "same_pointer": same_pointer, "errors": errors[:20]}


class _RawView:
    """A device view handed out as it is and read through its raw pointer (data_ptr)."""

    def __init__(self, view: Any) -> None:
        """Read the view's address now (which names the legacy stream for its release)."""
        self.view, self.ptr, self.nbytes = view, view.data_ptr, view.nbytes
        self.shape = tuple(view.shape)
        self.ndim = len(self.shape)


def _scenario_raw_pointer(gpu: TorchGpu | FakeGpu, a: dict) -> dict:
    """Batches delivered as _RawViews; copies out of their raw pointers queued on the
    legacy default stream behind slow work, the views dropped at once (see
    _raw_copies_torch and _raw_copy_fake)."""
    from tensorsocket.data import delivery

    delivery._device_tensors = lambda slot, device: [_RawView(v) for v in
                                                     slot.views(device=True)]
    consumer = _open(a)
    out = (_raw_copies_torch if isinstance(gpu, TorchGpu) else _raw_copy_fake)(gpu, consumer, a)
    consumer.close()
    return out


def _raw_copies_torch(gpu: TorchGpu, consumer: Any, a: dict) -> dict:
    """Per batch: torch.cuda._sleep, then cuMemcpyDtoDAsync_v2 (the real driver, through
    ctypes) from x's raw pointer into a torch tensor, on torch's current stream (the
    legacy default one); the view dropped; with 2 slots the producer comes round. The
    copies are checked at the end."""
    import ctypes

    torch = gpu.torch
    libcuda = ctypes.CDLL("libcuda.so.1")  # the driver torch loaded: the same library
    memcpy = libcuda.cuMemcpyDtoDAsync_v2
    memcpy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    memcpy.restype = ctypes.c_int
    stream = torch.cuda.current_stream(gpu.device)
    copies, pending, errors = [], 0, []
    for b, batch in enumerate(consumer):
        x = batch["x"]
        dst = torch.empty(x.nbytes // 4, dtype=torch.float32, device=gpu.device)
        gpu.sleep(a["sleep_ms"])
        rc = memcpy(dst.data_ptr(), x.ptr, x.nbytes, stream.cuda_stream)
        if rc != 0:
            errors.append(f"batch {b}: cuMemcpyDtoDAsync_v2 returned {rc}")
        done = gpu.mark()
        del batch, x  # the slot goes back while the copy is queued
        pending += not done()
        copies.append((batch_value({}, 0, b), dst))
    gpu.synchronize()
    bad = 0
    for v, dst in copies:
        if not bool((dst == float(v)).all().item()):
            bad += 1
            errors.append(f"batch {v}: its raw-pointer copy does not hold {v} (the slot was "
                          "refilled under the copy)")
    return {"checked": len(copies), "bad": bad, "pending_at_drop": pending,
            "errors": errors[:20]}


def _raw_copy_fake(gpu: FakeGpu, consumer: Any, a: dict) -> dict:
    """Batch 0: a gate, then the double's checksum kernel over x's raw pointer, on the
    legacy default stream; the view dropped; then `slots` more batches, the last one in
    batch 0's slot; the gate opens once the producer published it (the slot came back
    under the kernel: the bug) or after gate_s (it was held). The checksum is checked."""
    import numpy as np

    it = iter(consumer)
    batch = next(it)
    x = batch["x"]
    gate = gpu.fc.launch_gate(0)
    result = gpu.fc.launch_read(0, x.ptr, x.nbytes)
    del batch, x

    def open_when_round() -> None:
        """Open the gate once batch `slots` is published, or after gate_s."""
        deadline = time.monotonic() + a["gate_s"]
        while consumer.ring.info()["published"] <= a["slots"] and time.monotonic() < deadline:
            time.sleep(0.005)
        gate.value = 1

    opener = threading.Thread(target=open_when_round)
    opener.start()
    kept = [next(it) for _ in range(a["slots"])]
    opener.join()
    gpu.fc.stream_synchronize(0)
    want = gpu.fakecuda.fnv1a(np.full(a["shape"], batch_value({}, 0, 0), np.float32).tobytes())
    bad = int(result.value != want)
    del kept
    for batch in it:
        del batch
    return {"checked": 1, "bad": bad, "pending_at_drop": 1,
            "errors": ["batch 0: the raw-pointer read saw other bytes (the slot was refilled "
                       "under it)"] if bad else []}


def _scenario_copy_cache(gpu: TorchGpu | FakeGpu, a: dict) -> dict:
    """TensorConsumer(copy=True): after the first batch (the producer's pool exists),
    torch's cache is filled to 95% of the free memory and emptied (still reserved); every
    batch checked, torch's reserved memory watched."""
    assert isinstance(gpu, TorchGpu), "copy_cache needs torch's caching allocator"
    torch, dev = gpu.torch, gpu.device
    consumer = _open(a, copy=True)
    it = iter(consumer)
    errors: list[str] = []
    checked = bad = 0

    def check_batch(batch: Any, b: int) -> None:
        """Count batch b, and whether its copy holds b's value."""
        nonlocal checked, bad
        checked += 1
        if not gpu.batch_ok(batch, batch_value({}, 0, b)):
            bad += 1
            errors.append(f"batch {b}: its copy does not hold {batch_value({}, 0, b)}")

    check_batch(next(it), 0)
    free0 = torch.cuda.mem_get_info(dev)[0]
    base = torch.cuda.memory_reserved(dev)
    target = int(0.95 * free0)
    blocks, chunk = [], 1 << 30
    while chunk >= 64 << 20:
        if torch.cuda.memory_reserved(dev) - base + chunk > target:
            chunk //= 2
            continue
        try:
            blocks.append(torch.empty(chunk, dtype=torch.uint8, device=dev))
        except torch.cuda.OutOfMemoryError:
            chunk //= 2
    del blocks  # freed to torch's cache, which keeps them reserved
    reserved = torch.cuda.memory_reserved(dev)
    free_after = torch.cuda.mem_get_info(dev)[0]
    try:
        for b, batch in enumerate(it, start=1):
            check_batch(batch, b)
            del batch
    except torch.cuda.OutOfMemoryError as e:
        errors.append(f"out of memory while copying: {e}"[:500])
    growth = torch.cuda.memory_reserved(dev) - reserved
    consumer.close()
    return {"checked": checked, "bad": bad, "errors": errors[:20],
            "reserved": reserved - base, "reserved_fraction": (reserved - base) / free0,
            "free_after_fill": free_after, "reserved_growth": growth}


SCENARIOS: dict[str, Callable[[Any, dict], dict]] = {
    "exit_kept": _scenario_exit_kept, "capture": _scenario_capture, "steps": _scenario_steps,
    "two_consumers": _scenario_two_consumers, "raw_pointer": _scenario_raw_pointer,
    "copy_cache": _scenario_copy_cache,
}


def role_consumer(a: dict) -> dict:
    """A consumer process running scenario a["scenario"] on backend a["backend"]."""
    out = SCENARIOS[a["scenario"]](_gpu(a), a)
    out["role"] = "consumer"
    return out


def role_same_process(a: dict) -> dict:
    """A producer of a GPU ring iterating in a thread of this process, and a consumer
    (default device) in its main thread: the warnings, where batches came, their values."""
    import warnings

    from tensorsocket import TensorProducer

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        producer = TensorProducer(ValueLoader(a["batches"], a["shape"]), name=a["name"],
                                  min_consumers=1, start_grace=0, start_timeout=LINE_TIMEOUT,
                                  device=f"cuda:{a['device']}", device_fallback=False)
        failures: list[str] = []

        def publish() -> None:
            """The producer's epoch (in the thread); a failure is reported."""
            try:
                for _ in producer:
                    pass
            except Exception as e:  # reported: the producer must not fail
                failures.append(f"the producer raised {type(e).__name__}: {e}")
                producer.close()  # the consumer hears of it instead of waiting

        thread = threading.Thread(target=publish)
        thread.start()
        try:
            consumer = _open(a)
            values, devices, errors = [], set(), []
            for b, batch in enumerate(consumer):
                x, y = batch["x"], batch["y"]
                v = int(y[0].item())
                values.append(v)
                devices.add(str(x.device))
                if not (bool((x == float(v)).all()) and bool((y == v).all())):
                    errors.append(f"batch {b}: content is not {v}")
                del batch, x, y
            stats = consumer.stats()
            consumer.close()
        finally:
            thread.join(LINE_TIMEOUT)
            ring_device = producer.stats()["device"]
            producer.join(timeout=60)  # then close()
    messages = [f"{w.category.__name__}: {w.message}" for w in caught]
    return {"role": "same_process", "values": values, "devices": sorted(devices),
            "errors": (failures + errors)[:20], "warnings": messages,
            "fallback_warning": any("GPUFallbackWarning" in m
                                    and "runs in the producer's own process" in m
                                    for m in messages),
            "zero_copy_gpu": stats["zero_copy_gpu"], "ring_device": ring_device}


ROLES: dict[str, Callable[[dict], dict]] = {
    "producer": role_producer, "consumer": role_consumer, "same_process": role_same_process,
}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_role":
        sys.exit(gpu_checks.role_main(sys.argv[2:], ROLES))
    print("usage: python benchmarks/gpu_check.py --quick | --fake LIBFAKECUDA (this module "
          "holds the issue-34 checks)", file=sys.stderr)
    sys.exit(2)
