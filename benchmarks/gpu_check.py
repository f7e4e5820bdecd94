"""GPU check: verify tensorsocket's GPU ring end to end on a real GPU, and measure it.

    python benchmarks/gpu_check.py [--consumers 3] [--batches 200]
        [--batch-shape 256,3,224,224] [--json out.json] [--require-gpu]
    python benchmarks/gpu_check.py --quick [--checks a,b] [--json out.json]
    python benchmarks/gpu_check.py --fake LIBFAKECUDA|build [--checks a,b] [--json out.json]
    python benchmarks/gpu_check.py --smoke

``--quick`` runs only the correctness checks of benchmarks/gpu_checks.py (the same
functions tests/test_gpu_real.py runs): the orderings of issue 23 (pinned views under
``non_blocking`` copies, reads on other streams joined into the current one, a
non-default current stream, ``__dlpack__(stream=-1)`` on several streams, releases during
a CUDA graph capture, a consumer idle past ``release_timeout``), a DataLoader with
non-persistent workers over 3 epochs, device memory back to its baseline after several
producer and consumer cycles, and where the hardware allows, peer import,
``peer_access=False``, ``CUDA_VISIBLE_DEVICES`` reordering and MIG (skipped with the
reason otherwise); then the consumer's own cost per batch (step 3 below, 60 batches;
``--no-overhead`` leaves it out); then the checks of issue 34 in
benchmarks/gpu_driver_checks.py (30 exits with a kept batch and a queued 200 ms kernel,
20 producers that never touch torch's CUDA, a capture on another thread, the step time
with and without a context synchronize per ``next()``, two consumers in one process, a
consumer in the producer's process, a raw-pointer copy, ``copy=True`` with torch's cache
at 95%); sized to take under 5 minutes on one GPU (issue 34's checks have not run on one
yet). It prints a table of check / result / seconds /
figure and exits 1 if any check failed. ``--fake`` runs only the issue-34 checks, in
their quick form, on the CUDA driver test double (csrc/tests/fake_cuda.c; ``build``
compiles it with tests/fakecuda.py into a temporary directory), with no GPU: the same
table (tests/test_gpu_driver_script.py runs it in CI). ``--smoke`` runs the checks' own
machinery on a host ring (no GPU needed).

Without ``--quick``:

Without a usable GPU it prints one line, ``SKIPPED: <reason>``, and exits 0
(2 with ``--require-gpu``). On a GPU it runs, in real processes (this script
re-invoked with the hidden roles ``_producer``, ``_consumer`` and ``_baseline``):

1. verify   One producer with ``device="cuda:0"`` and N consumers. Every consumer
            checks every batch on the GPU (batch i is ``x`` uint8 filled with
            i % 251 and ``y`` int64 filled with i), that its tensors are CUDA
            tensors on the ring's GPU, and that ``stats()["zero_copy_gpu"]`` is True.
2. copies   In the same run, torch.profiler (CUPTI) records K batches in the
            producer and in consumer 0: the producer must show one "Memcpy HtoD"
            per batch (the C core's cuMemcpyHtoDAsync) and the consumer none. The
            producer's ``bytes_copied`` / bytes of the batches is reported too (the
            fallback evidence when the profiler sees no device activity).
3. overhead One producer, one consumer. Before each timed ``next()`` the consumer
            waits (untimed) until the batch is published, so what is timed is its
            own cost per batch: median and p90 of ``next()`` in microseconds
            (target < 50 us), and of dropping the batch (its GPU-safe release).
4. throughput  N consumers each with its own ``DataLoader(pin_memory=True)`` and
            ``.cuda(non_blocking=True)`` (the baseline) against one producer whose
            DataLoader feeds N consumers; the same dataset, whose items cost
            ``--work-ms`` of CPU-bound numpy work each (decoding, simulated), with
            ``--workers`` loader workers per DataLoader. Batches/s per consumer
            (median over consumers, then over ``--repeats``), the ratio, and the CPU
            seconds all processes used.

Only measured numbers are printed. Exit status: 0 if every check passed (the
overhead target is reported, not enforced), 1 if a check failed, 2 for SKIPPED
with --require-gpu (with --quick too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("verify", "overhead", "throughput")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_checks  # noqa: E402  (the checks of --quick, shared with tests/test_gpu_real.py)
import gpu_driver_checks  # noqa: E402  (issue 34's, after them; --fake runs them alone)
from bench_common import (  # noqa: E402
    children_cpu_seconds, dispatch, harness, import_tensorsocket, machine_info,
    remove_leftovers, report, write_json,
)
TARGET_NEXT_US = 50.0
WORK_ELEMS = 4096  # float64 elements the simulated decode works on (fits in L1/L2)
VALUE_MOD = 251  # x of batch i holds i % 251 (uint8)
STRUCTURE_ALLOWANCE = 4096  # bytes per batch beyond its tensors: alignment, structure blob

# Timeouts (seconds). Every wait in this script has one.
ATTACH_TIMEOUT = 60.0  # consumer -> producer handshake (CUDA init included)
START_TIMEOUT = 120.0  # producer waits this long for its consumers
BATCH_TIMEOUT = 120.0  # consumer waits this long for one batch
PUBLISH_TIMEOUT = 120.0  # producer waits this long for a free slot
JOIN_TIMEOUT = 120.0  # producer waits this long for the consumers to drain
READY_TIMEOUT = 300.0  # a child prints its 'ready' line within this
RUN_TIMEOUT = 900.0  # one whole run, from the orchestrator
POLL_TIMEOUT = 60.0  # overhead step: a batch is published within this
KILL_GRACE = 5.0


# -- the data ----------------------------------------------------------------------------


def batch_nbytes(shape: tuple[int, ...]) -> int:
    """Bytes of tensor data in one batch: x uint8 `shape` and y int64 (shape[0],)."""
    n = 1
    for d in shape:
        n *= d
    return n + 8 * shape[0]


def make_batch(i: int, shape: tuple[int, ...], out: dict | None = None) -> dict:
    """Batch i: x uint8 filled with i % 251, y int64 filled with i (into `out` if given)."""
    import torch

    if out is None:
        out = {"x": torch.empty(shape, dtype=torch.uint8),
               "y": torch.empty(shape[0], dtype=torch.int64)}
    out["x"].fill_(i % VALUE_MOD)
    out["y"].fill_(i)
    return out


def expected_sums(batches: int, shape: tuple[int, ...], start: int = 0) -> tuple[int, int]:
    """(sum of every x element, sum of every y element) over batches start..batches-1."""
    per_x = batch_nbytes(shape) - 8 * shape[0]
    return (sum((i % VALUE_MOD) * per_x for i in range(start, batches)),
            sum(i * shape[0] for i in range(start, batches)))


def cpu_work(iters: int) -> float:
    """Fixed CPU-bound numpy work (single-threaded elementwise ops): simulated decoding."""
    import numpy as np

    buf = np.linspace(1.0, 2.0, WORK_ELEMS)
    for _ in range(iters):
        np.sqrt(buf, out=buf)
        buf += 1.0
    return float(buf[0])


def calibrate_work(work_ms: float) -> int:
    """Iterations of cpu_work that take `work_ms` on this (idle) machine."""
    if work_ms <= 0:
        return 0
    probe = 200
    cpu_work(probe)  # warm up
    samples = []
    for _ in range(7):
        t0 = time.perf_counter()
        cpu_work(probe)
        samples.append((time.perf_counter() - t0) / probe)
    return max(1, round(work_ms / 1e3 / statistics.median(samples)))


class SyntheticLoader:
    """`batches` batches with no loader cost: one buffer, refilled per batch (the producer
    copies a batch into the ring before the loader is asked for the next one)."""

    def __init__(self, batches: int, shape: tuple[int, ...]) -> None:
        self.batches = batches
        self.shape = shape
        self.batch_size = shape[0]

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        buf = None
        for i in range(self.batches):
            buf = make_batch(i, self.shape, buf)
            yield buf


class BatchDataset:
    """Map-style dataset whose item i is batch i, after `work_iters` of CPU work (used
    with DataLoader(batch_size=None), so a loader worker makes a whole batch)."""

    def __init__(self, batches: int, shape: tuple[int, ...], work_iters: int) -> None:
        self.batches = batches
        self.shape = shape
        self.work_iters = work_iters

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.batches:
            raise IndexError(i)
        cpu_work(self.work_iters)
        return make_batch(i, self.shape)


def make_dataloader(args: argparse.Namespace, pin_memory: bool):
    """The DataLoader of the throughput step (the producer's, or a baseline consumer's)."""
    import torch

    dataset = BatchDataset(args.batches, parse_shape(args.shape), args.work_iters)
    kw = {"prefetch_factor": 2} if args.workers > 0 else {}
    return torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=False,
                                       num_workers=args.workers, pin_memory=pin_memory, **kw)


def parse_shape(text: str) -> tuple[int, ...]:
    shape = tuple(int(d) for d in text.split(",") if d.strip())
    if not shape or any(d <= 0 for d in shape):
        raise ValueError(f"--batch-shape {text!r}: positive integers, comma-separated")
    return shape


# -- profiling ------------------------------------------------------------------------------

HTOD = re.compile(r"memcpy\s*htod", re.IGNORECASE)


def start_profiler(device: str):
    """torch.profiler recording CPU ops and CUDA activity (CUPTI), started now, once
    the work already queued on `device` is done (so that none of it is counted)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.set_device(device)
    torch.cuda.synchronize(device)
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.start()
    return prof


def stop_profiler(prof, device: str, batches: int) -> dict:
    """Wait for the device, stop, and count device activity over `batches` batches."""
    import torch

    torch.cuda.synchronize(device)  # every stream of the context: the C core's copies too
    prof.stop()
    counts = count_device_activity(prof)
    counts["batches"] = batches
    return counts


def count_device_activity(prof) -> dict:
    """Host-to-device memcpys, kernels and all device events the profiler saw: from its
    events, or from its Chrome trace where the events hold no device activity."""
    from torch.autograd import DeviceType

    htod = kernels = device = 0
    for ev in prof.events():
        if ev.device_type != DeviceType.CUDA:
            continue
        device += 1
        if HTOD.search(ev.name):
            htod += 1
        elif not ev.name.lower().startswith(("memcpy", "memset")):
            kernels += 1
    if device > 0:
        return {"htod": htod, "kernels": kernels, "device_events": device,
                "source": "profiler events"}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    for ev in trace.get("traceEvents", []) if isinstance(trace, dict) else trace:
        cat, name = str(ev.get("cat", "")).lower(), str(ev.get("name", ""))
        if cat in ("gpu_memcpy", "gpu_memset", "kernel"):
            device += 1
            htod += cat == "gpu_memcpy" and HTOD.search(name) is not None
            kernels += cat == "kernel"
    return {"htod": htod, "kernels": kernels, "device_events": device,
            "source": "chrome trace"}


# -- child roles -----------------------------------------------------------------------------


def run_producer(args: argparse.Namespace) -> dict:
    """Publish one epoch (synthetic batches, or the throughput DataLoader); profile the
    publishes of batches [profile_from, profile_from + profile_batches) if asked."""
    ts = import_tensorsocket()
    shape = parse_shape(args.shape)
    if args.loader == "synthetic":
        loader = SyntheticLoader(args.batches, shape)
    else:
        loader = make_dataloader(args, pin_memory=False)
    window = (args.profile_from, args.profile_from + args.profile_batches) \
        if args.profile_batches > 0 else None
    producer = ts.TensorProducer(
        loader, name=args.name, device=args.device, device_fallback=False,
        min_consumers=args.consumers, ring_slots=args.ring_slots,
        start_timeout=START_TIMEOUT, publish_timeout=PUBLISH_TIMEOUT,
    )
    prof = profile = None
    try:
        report({"role": "producer", "ready": True})
        for i, _ in enumerate(producer):  # batch i is published (copy issued) here
            if window and i == window[0] - 1:
                prof = start_profiler(args.device)
            elif prof is not None and i == window[1] - 1:
                profile, prof = stop_profiler(prof, args.device, window[1] - window[0]), None
        if prof is not None:  # the epoch was shorter than the window
            profile = stop_profiler(prof, args.device, args.batches - window[0])
        stats = producer.stats()
        drained = producer.join(timeout=JOIN_TIMEOUT)
    finally:
        producer.close()
    return {"role": "producer", "stats": stats, "drained": drained, "profile": profile}


def _wait_go() -> None:
    """Barrier: say ready, then wait for the orchestrator's 'go' on stdin."""
    report({"ready": True})
    with selectors.DefaultSelector() as sel:
        sel.register(sys.stdin, selectors.EVENT_READ)
        if not sel.select(READY_TIMEOUT) or sys.stdin.readline().strip() != "go":
            raise TimeoutError("no 'go' from the orchestrator")


def verify_consumer(consumer, args: argparse.Namespace) -> dict:
    """Check every batch on its device without synchronizing per batch (the checks are
    collected as GPU booleans, read once at the end); profile a window if asked."""
    import torch

    window = (args.profile_from, args.profile_from + args.profile_batches) \
        if args.profile_batches > 0 else None
    flags, devices, not_cuda = [], set(), 0
    prof = profile = None
    for i, batch in enumerate(consumer):
        x, y = batch["x"], batch["y"]
        devices.update((str(x.device), str(y.device)))
        not_cuda += not (x.is_cuda and y.is_cuda)
        flags.append(torch.stack([(x == i % VALUE_MOD).all(), (y == i).all()]))
        del batch, x, y
        if window and i == window[0] - 1:
            prof = start_profiler(args.device)
        elif prof is not None and i == window[1] - 1:
            profile, prof = stop_profiler(prof, args.device, window[1] - window[0]), None
    if prof is not None:
        profile = stop_profiler(prof, args.device, len(flags) - window[0])
    if torch.cuda.is_initialized():
        torch.cuda.synchronize(args.device)
    ok = torch.stack(flags).cpu().tolist() if flags else []
    bad = [i for i, (x_ok, y_ok) in enumerate(ok) if not (x_ok and y_ok)]
    return {"batches": len(flags), "bad_batches": bad[:20], "bad_count": len(bad),
            "devices": sorted(devices), "not_cuda": not_cuda, "profile": profile}


def overhead_consumer(consumer, args: argparse.Namespace) -> dict:
    """Time next() on batches already published, and dropping them (the release)."""
    import torch

    it = iter(consumer)
    next_ns, drop_ns = [], []
    devices = set()
    for i in range(args.batches):
        deadline = time.monotonic() + POLL_TIMEOUT
        while consumer.stats()["lag"] < 1:  # untimed: until the batch is in the ring
            if time.monotonic() > deadline:
                raise TimeoutError(f"batch {i} not published within {POLL_TIMEOUT} s")
            time.sleep(0.0002)
        t0 = time.perf_counter_ns()
        batch = next(it)
        t1 = time.perf_counter_ns()
        devices.add(str(batch["x"].device))
        t2 = time.perf_counter_ns()
        del batch
        t3 = time.perf_counter_ns()
        if i >= args.warmup:
            next_ns.append(t1 - t0)
            drop_ns.append(t3 - t2)
    for _ in it:  # the end of the epoch
        pass
    if torch.cuda.is_initialized():
        torch.cuda.synchronize(args.device)
    return {"next_us": _percentiles([t / 1e3 for t in next_ns]),
            "drop_us": _percentiles([t / 1e3 for t in drop_ns]),
            "devices": sorted(devices)}


def gpu_step(batch_x, batch_y, acc: list) -> None:
    """The per-batch GPU work of a throughput consumer: read the whole batch (sums)."""
    import torch

    acc[0] += batch_x.sum(dtype=torch.int64)
    acc[1] += batch_y.sum()


def timed_loop(batches_iter, to_gpu, args: argparse.Namespace) -> dict:
    """Take the first batch, meet the others at the barrier, then time the rest;
    the sums of all batches are checked at the end."""
    import torch

    first = next(batches_iter)
    x, y = to_gpu(first)
    on_cuda = x.is_cuda and y.is_cuda
    device = x.device
    acc = [torch.zeros((), dtype=torch.int64, device=device),
           torch.zeros((), dtype=torch.int64, device=device)]
    gpu_step(x, y, acc)
    del first, x, y
    torch.cuda.synchronize(device)
    _wait_go()
    n = 1
    t0 = time.perf_counter()
    for batch in batches_iter:
        x, y = to_gpu(batch)
        gpu_step(x, y, acc)
        del batch, x, y
        n += 1
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    want = expected_sums(args.batches, parse_shape(args.shape))
    return {"batches": n, "seconds": seconds,
            "batches_per_s": (n - 1) / seconds if seconds > 0 else 0.0,
            "content_ok": [int(acc[0].item()), int(acc[1].item())] == list(want),
            "on_cuda": on_cuda}


def run_consumer(args: argparse.Namespace) -> dict:
    """A TensorConsumer in one of the modes verify / overhead / throughput."""
    ts = import_tensorsocket()
    consumer = ts.TensorConsumer(name=args.name, timeout=ATTACH_TIMEOUT,
                                 batch_timeout=BATCH_TIMEOUT)
    try:
        if args.mode == "verify":
            out = verify_consumer(consumer, args)
        elif args.mode == "overhead":
            out = overhead_consumer(consumer, args)
        else:
            out = timed_loop(iter(consumer), lambda b: (b["x"], b["y"]), args)
        out["stats"] = consumer.stats()
    finally:
        consumer.close()
    out["role"] = "consumer"
    return out


def run_baseline(args: argparse.Namespace) -> dict:
    """A consumer with its own DataLoader(pin_memory=True) and .cuda(non_blocking=True)."""
    import torch

    device = torch.device(args.device)
    torch.cuda.set_device(device)
    torch.cuda.init()
    loader = make_dataloader(args, pin_memory=True)

    def to_gpu(batch: dict) -> tuple:
        return (batch["x"].to(device, non_blocking=True),
                batch["y"].to(device, non_blocking=True))

    it = iter(loader)
    try:
        out = timed_loop(it, to_gpu, args)
    finally:
        del it  # shuts the workers down
    out["role"] = "consumer"
    return out


def _percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    return {"n": len(s), "median": statistics.median(s), "p90": s[int(0.9 * (len(s) - 1))],
            "p99": s[int(0.99 * (len(s) - 1))], "min": s[0], "mean": statistics.fmean(s)}


def child_main(argv: list[str]) -> int:
    """Entry point of the hidden roles."""
    role = argv[0]
    # On SIGTERM from the orchestrator, unwind (finally blocks tear down properly).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    ap = argparse.ArgumentParser(prog=f"gpu_check.py {role}")
    ap.add_argument("--name", default="")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--shape", required=True)
    ap.add_argument("--batches", type=int, required=True)
    ap.add_argument("--consumers", type=int, default=1)
    ap.add_argument("--ring-slots", type=int, default=4)
    ap.add_argument("--loader", choices=["synthetic", "dataloader"], default="synthetic")
    ap.add_argument("--mode", choices=["verify", "overhead", "throughput"], default="verify")
    ap.add_argument("--work-iters", type=int, default=0)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--profile-from", type=int, default=1)
    ap.add_argument("--profile-batches", type=int, default=0)
    args = ap.parse_args(argv[1:])
    run = {"_producer": run_producer, "_consumer": run_consumer, "_baseline": run_baseline}
    report(run[role](args))
    return 0


# -- orchestrator ------------------------------------------------------------------------------


def gpu_skip_reason(device: str) -> str | None:
    """Why the GPU check cannot run here (one line), or None."""
    ordinal = int(device.partition(":")[2] or 0)
    why = gpu_checks.skip_reason(ordinal)
    if why is not None:
        return why
    desc = import_tensorsocket().gpu_status()["devices"][ordinal]
    if not desc["ipc_events"]:
        return (f"GPU {ordinal} ({desc['name']}) does not support CUDA IPC events "
                "(MIG instance?): the GPU ring cannot work there")
    return None


class Children:
    """Child processes of one run: started, read, and always reaped (with timeouts); the
    processes themselves come from tools.harness."""

    def __init__(self, name: str) -> None:
        self.name = name
        import_tensorsocket()
        self.harness = harness()
        self.group = self.harness.Children()
        self._err: dict[int, object] = {}

    @property
    def procs(self) -> list:
        return self.group.procs

    def start(self, role: str, *args: str, stdin: bool = False):
        err = tempfile.TemporaryFile()
        p = self.group.spawn(self.harness.python_argv(os.path.abspath(__file__), role, *args),
                             stdout=subprocess.PIPE, stderr=err, text=False, cwd=ROOT,
                             stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, label=role)
        self._err[p.pid] = err
        return p

    def stderr(self, p) -> str:
        err = self._err[p.pid]
        err.seek(0)
        return err.read()[-4000:].decode(errors="replace")

    def wait_line(self, p, key: str, timeout: float = READY_TIMEOUT) -> dict:
        """The next JSON line of p on stdout with `key`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                obj = p.read_json(max(0.0, deadline - time.monotonic()), what=f"its {key!r} line")
            except self.harness.ChildFailed as e:
                raise RuntimeError(f"{e}\n{self.stderr(p)}") from None
            if key in obj:
                return obj

    def release(self, procs: list) -> None:
        """Barrier: wait for every 'ready' line, then tell them all 'go'."""
        for p in procs:
            self.wait_line(p, "ready")
        for p in procs:
            p.stdin.write(b"go\n")
            p.stdin.flush()

    def result(self, p, deadline: float) -> dict:
        """Wait for p; its last JSON line with a role."""
        try:
            rest, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"a child did not finish in time:\n{self.stderr(p)}") from None
        lines = [ln for ln in self.harness.json_lines(rest.decode(errors="replace"))
                 if "role" in ln and "ready" not in ln]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"a child failed (rc={p.returncode}):\n{self.stderr(p)}")
        return lines[-1]

    def close(self) -> None:
        """Terminate, then kill, every child still running (process trees); reap all;
        remove leftovers."""
        self.group.stop_all(KILL_GRACE)
        for p in self.procs:
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()
            self._err[p.pid].close()
        if self.name:
            import_tensorsocket()
            remove_leftovers(self.name)


def _common(args: argparse.Namespace, batches: int) -> list[str]:
    return ["--device", args.device, "--shape", args.batch_shape, "--batches", str(batches),
            "--ring-slots", str(args.ring_slots)]


def run_tensorsocket(args: argparse.Namespace, consumers: int, batches: int, mode: str,
                     loader: str = "synthetic", profile: tuple[int, int] | None = None,
                     barrier: bool = False) -> dict:
    """One producer and `consumers` consumers; their results."""
    name = f"gpucheck-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    kids = Children(name)
    deadline = time.monotonic() + RUN_TIMEOUT
    prof = ["--profile-from", str(profile[0]), "--profile-batches", str(profile[1])] \
        if profile else []
    try:
        producer = kids.start("_producer", "--name", name, *_common(args, batches),
                              "--consumers", str(consumers), "--loader", loader,
                              "--work-iters", str(args.work_iters),
                              "--workers", str(args.workers), *prof)
        kids.wait_line(producer, "ready")
        cons = [kids.start("_consumer", "--name", name, *_common(args, batches),
                           "--mode", mode, "--warmup", str(args.warmup),
                           *(prof if i == 0 else []), stdin=barrier)
                for i in range(consumers)]
        if barrier:
            kids.release(cons)
        results = [kids.result(c, deadline) for c in cons]
        return {"producer": kids.result(producer, deadline), "consumers": results}
    finally:
        kids.close()


def run_baseline_consumers(args: argparse.Namespace, consumers: int) -> dict:
    """`consumers` processes, each with its own DataLoader, released together."""
    kids = Children("")
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        cons = [kids.start("_baseline", *_common(args, args.batches),
                           "--work-iters", str(args.work_iters),
                           "--workers", str(args.workers), stdin=True)
                for _ in range(consumers)]
        kids.release(cons)
        return {"consumers": [kids.result(c, deadline) for c in cons]}
    finally:
        kids.close()


def step_verify(args: argparse.Namespace) -> dict:
    """Steps 1 and 2: content, CUDA and zero-copy in every consumer; copies per batch."""
    start = max(1, min(args.warmup, args.batches // 4))
    count = max(0, min(args.profile_batches, args.batches - start))
    run = run_tensorsocket(args, args.consumers, args.batches, "verify",
                           profile=(start, count) if count > 0 else None)
    shape = parse_shape(args.batch_shape)
    prod = run["producer"]
    consumers = []
    for i, c in enumerate(run["consumers"]):
        consumers.append({
            "consumer": i, "batches": c["batches"], "bad_batches": c["bad_batches"],
            "bad_count": c["bad_count"], "devices": c["devices"], "not_cuda": c["not_cuda"],
            "zero_copy_gpu": c["stats"]["zero_copy_gpu"],
            "device_fallback_reason": c["stats"]["device_fallback_reason"],
            "ok": (c["batches"] == args.batches and c["bad_count"] == 0 and c["not_cuda"] == 0
                   and c["devices"] == [args.device] and c["stats"]["zero_copy_gpu"] is True),
        })
    copied, one = prod["stats"]["bytes_copied"], batch_nbytes(shape) * args.batches
    copies = {"bytes_copied": copied, "batch_bytes": batch_nbytes(shape),
              "bytes_ratio": copied / one,
              "bytes_one_copy": one <= copied <= one + STRUCTURE_ALLOWANCE * args.batches,
              "producer_profile": prod["profile"],
              "consumer_profile": run["consumers"][0]["profile"],
              "host_pinned": prod["stats"]["host_pinned"]}
    copies.update(_judge_copies(copies))
    return {"producer_device": prod["stats"]["device"],
            "producer_batches": prod["stats"]["batches"], "drained": prod["drained"],
            "consumers": consumers, "copies": copies,
            "ok": (all(c["ok"] for c in consumers) and prod["drained"] and copies["ok"]
                   and prod["stats"]["device"] == args.device
                   and prod["stats"]["batches"] == args.batches)}


def _judge_copies(c: dict) -> dict:
    """Copies per batch from the profiles, or the bytes ratio where they saw nothing."""
    pp, cp = c["producer_profile"], c["consumer_profile"]
    bytes_ok = c["bytes_one_copy"]
    if pp and pp["device_events"] > 0 and pp["batches"] > 0:
        per_batch = pp["htod"] / pp["batches"]
        method = f"torch.profiler ({pp['source']}) in the producer over {pp['batches']} batches"
        ok = per_batch == 1.0
    else:
        per_batch = None
        method = ("the profiler saw no device activity in the producer: falling back to "
                  "bytes_copied / batch bytes")
        ok = bytes_ok
    cons_per_batch = None
    if cp and cp["device_events"] > 0 and cp["batches"] > 0:
        cons_per_batch = cp["htod"] / cp["batches"]
        ok = ok and cons_per_batch == 0.0
    return {"producer_htod_per_batch": per_batch, "consumer_htod_per_batch": cons_per_batch,
            "method": method, "ok": ok and bytes_ok}


def step_overhead(args: argparse.Namespace) -> dict:
    """Step 3: the consumer's own cost of next() on a batch already in the ring."""
    batches = max(args.batches, args.warmup + 20)
    run = run_tensorsocket(args, 1, batches, "overhead")
    c = run["consumers"][0]
    return {"batches": batches, "warmup": args.warmup, "next_us": c["next_us"],
            "drop_us": c["drop_us"], "devices": c["devices"],
            "zero_copy_gpu": c["stats"]["zero_copy_gpu"],
            "meets_target": c["next_us"].get("median", float("inf")) < TARGET_NEXT_US}


def step_throughput(args: argparse.Namespace) -> dict:
    """Step 4: batches/s per consumer, tensorsocket vs one DataLoader per consumer."""
    runs: dict[str, list[dict]] = {"tensorsocket": [], "baseline": []}
    for rep in range(args.repeats):
        for mode in ("baseline", "tensorsocket") if rep % 2 else ("tensorsocket", "baseline"):
            cpu0, t0 = children_cpu_seconds(), time.perf_counter()
            if mode == "tensorsocket":
                res = run_tensorsocket(args, args.consumers, args.batches, "throughput",
                                       loader="dataloader", barrier=True)
            else:
                res = run_baseline_consumers(args, args.consumers)
            cons = res["consumers"]
            runs[mode].append({
                "batches_per_s": statistics.median(c["batches_per_s"] for c in cons),
                "per_consumer": [c["batches_per_s"] for c in cons],
                "cpu_seconds": children_cpu_seconds() - cpu0,
                "wall_seconds": time.perf_counter() - t0,
                "content_ok": all(c["content_ok"] for c in cons),
                "on_cuda": all(c["on_cuda"] for c in cons),
                "zero_copy_gpu": [c["stats"]["zero_copy_gpu"] for c in cons if "stats" in c],
            })
            print(f"  [{rep + 1}/{args.repeats}] {mode:>12}: "
                  f"{runs[mode][-1]['batches_per_s']:8.2f} batches/s per consumer, "
                  f"{runs[mode][-1]['cpu_seconds']:7.1f} CPU s", flush=True)
    out = {m: {"batches_per_s": statistics.median(r["batches_per_s"] for r in rs),
               "cpu_seconds": statistics.median(r["cpu_seconds"] for r in rs), "runs": rs}
           for m, rs in runs.items()}
    base = out["baseline"]["batches_per_s"]
    out["ratio"] = out["tensorsocket"]["batches_per_s"] / base if base > 0 else None
    out["ok"] = all(r["content_ok"] and r["on_cuda"] for rs in runs.values() for r in rs) \
        and all(all(r["zero_copy_gpu"]) for r in runs["tensorsocket"])
    return out


def print_report(env: dict, results: dict) -> None:
    """The summary table."""
    print()
    print(f"{'check':<44} {'measured':<34} {'expected':<10} result")
    print("-" * 98)

    def row(what: str, measured: str, expected: str, ok: bool | None) -> None:
        verdict = "-" if ok is None else ("OK" if ok else "FAIL")
        print(f"{what:<44} {measured:<34} {expected:<10} {verdict}")

    v = results.get("verify")
    if v:
        good = sum(c["ok"] for c in v["consumers"])
        row("content + CUDA + zero-copy, every batch", f"{good}/{len(v['consumers'])} consumers "
            f"x {v['producer_batches']} batches", "all", v["ok"])
        c = v["copies"]
        ppb, cpb = c["producer_htod_per_batch"], c["consumer_htod_per_batch"]
        row("HtoD memcpys per batch, producer (profiler)",
            "not seen" if ppb is None else f"{ppb:.2f}", "1", None if ppb is None else ppb == 1)
        row("HtoD memcpys per batch, consumer 0",
            "not seen" if cpb is None else f"{cpb:.2f}", "0", None if cpb is None else cpb == 0)
        row("producer bytes_copied / batch bytes", f"{c['bytes_ratio']:.4f}", "1 (+blob)",
            c["bytes_one_copy"])
        row("producer staging memory page-locked", str(c["host_pinned"]), "True", None)
        print(f"  copies judged by {c['method']}")
    o = results.get("overhead")
    if o:
        n, d = o["next_us"], o["drop_us"]
        row("consumer next() on a published batch (us)",
            f"median {n['median']:.1f}, p90 {n['p90']:.1f}", f"< {TARGET_NEXT_US:.0f}",
            o["meets_target"])
        row("dropping the batch (GPU-safe release, us)",
            f"median {d['median']:.1f}, p90 {d['p90']:.1f}", "", None)
    t = results.get("throughput")
    if t:
        ts, base = t["tensorsocket"], t["baseline"]
        row("batches/s per consumer, tensorsocket", f"{ts['batches_per_s']:.2f}", "", None)
        row("batches/s per consumer, DataLoader each", f"{base['batches_per_s']:.2f}", "", None)
        ratio = "n/a" if t["ratio"] is None else f"{t['ratio']:.2f}x"
        row("ratio tensorsocket / DataLoader each", ratio, "", None)
        row("CPU seconds per run, tensorsocket / each",
            f"{ts['cpu_seconds']:.1f} / {base['cpu_seconds']:.1f}", "", None)
        row("throughput runs: content and zero-copy", "", "all", t["ok"])
    loaders = (f", work {env['work_ms']} ms per batch on {env['workers']} workers per "
               f"DataLoader, {env['repeats']} repeats") if t else ""
    print(f"(medians; {env['consumers']} consumers, {env['batches']} batches of "
          f"{env['batch_mb']:.1f} MB{loaders})")


def environment(args: argparse.Namespace) -> dict:
    """What this run ran on (no CUDA context is created here)."""
    import torch

    status = import_tensorsocket().gpu_status()

    ordinal = int(args.device.partition(":")[2] or 0)
    dev = (status["devices"] or [{}])[ordinal]
    return {
        "gpu": dev.get("name"), "gpu_uuid": dev.get("uuid"),
        "driver_version": status.get("driver_version"), "libcuda": status.get("library"),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "device": args.device, "consumers": args.consumers, "batches": args.batches,
        "batch_shape": list(parse_shape(args.batch_shape)),
        "batch_mb": batch_nbytes(parse_shape(args.batch_shape)) / 1e6,
        "work_ms": args.work_ms, "work_iters": args.work_iters, "workers": args.workers,
        "repeats": args.repeats, "ring_slots": args.ring_slots,
        "machine": machine_info(),
    }


def quick_overhead(args: argparse.Namespace) -> gpu_checks.CheckResult:
    """The consumer's own cost per batch (step 3, 60 batches): a figure, not a verdict
    (its target is reported, as in the full run); a failure to measure is a failure."""
    import copy

    t0 = time.monotonic()
    small = copy.copy(args)
    small.batches, small.warmup, small.work_iters = 60, 10, 0
    try:
        o = step_overhead(small)
    except Exception as e:  # could not measure: a failed row, with the cause
        first = (str(e).splitlines() or [""])[0]
        return gpu_checks.CheckResult("next_overhead", False,
                                      figure=f"{type(e).__name__}: {first}"[:120],
                                      detail=str(e)[-3000:], seconds=time.monotonic() - t0)
    n, d = o["next_us"], o["drop_us"]
    fig = (f"next() median {n['median']:.1f} us, p90 {n['p90']:.1f} (target < "
           f"{TARGET_NEXT_US:.0f}: {'met' if o['meets_target'] else 'not met'}); drop median "
           f"{d['median']:.1f} us; zero-copy {o['zero_copy_gpu']}")
    return gpu_checks.CheckResult("next_overhead", o["zero_copy_gpu"] is True, figure=fig,
                                  seconds=time.monotonic() - t0, data=o)


def _progress(r: gpu_checks.CheckResult) -> None:
    """One line per finished check, as the run goes."""
    shown = "SKIP" if r.ok is None else ("OK" if r.ok else "FAIL")
    print(f"  {r.name}: {shown} ({r.seconds:.1f} s)", flush=True)


def run_quick(args: argparse.Namespace) -> int:
    """--quick: the checks of gpu_checks.py, then gpu_driver_checks.py's; a table, exit 1
    on a failure."""
    args.work_iters = 0  # no throughput step here
    env = environment(args)
    print(f"GPU checks on {env['gpu']} ({args.device}), driver {env['driver_version']}, "
          f"torch {env['torch']} (CUDA {env['torch_cuda']}), {env['cpus']} CPUs", flush=True)
    device = int(args.device.partition(":")[2])
    opts = gpu_checks.default_options(device)
    opts.cycles = args.cycles
    t0 = time.monotonic()
    names = [c for c in args.checks if c in gpu_checks.CHECKS]
    results = gpu_checks.run_checks(names, opts, _progress) if names else []
    if not args.no_overhead and opts.gpu_ring:
        results.append(quick_overhead(args))
        _progress(results[-1])
    names = [c for c in args.checks if c in gpu_driver_checks.CHECKS]
    if names:
        results += gpu_driver_checks.run_checks(names, gpu_driver_checks.torch_options(device),
                                                _progress)
    return _report(args, env, results, t0)


def run_fake(args: argparse.Namespace) -> int:
    """--fake: the issue-34 checks, quick form, on the CUDA driver double; a table, exit 1
    on a failure."""
    t0 = time.monotonic()
    lib, built_in = args.fake, None
    if lib == "build":
        sys.path.insert(0, str(ROOT / "tests"))
        import fakecuda

        built_in = tempfile.mkdtemp(prefix="fakecuda-")
        lib = str(fakecuda.build(Path(built_in)))
    if not Path(lib).is_file():
        print(f"--fake {lib}: no such file (build it with tests/fakecuda.py, or pass build)",
              file=sys.stderr)
        return 2
    env = {"backend": "the CUDA driver double", "lib": lib, "cpus": os.cpu_count(),
           "python": platform.python_version()}
    print(f"issue-34 checks on the CUDA driver double {lib}, {env['cpus']} CPUs", flush=True)
    names = [c for c in args.checks if c in gpu_driver_checks.CHECKS]
    try:
        results = gpu_driver_checks.run_checks(names, gpu_driver_checks.fake_options(lib),
                                               _progress)
    finally:
        if built_in is not None:
            shutil.rmtree(built_in, ignore_errors=True)
    return _report(args, env, results, t0)


def _report(args: argparse.Namespace, env: dict, results: list, t0: float) -> int:
    """Print the table of results and the verdict (and write --json); the exit status."""
    print()
    print(gpu_checks.format_table(results))
    failed = [r for r in results if r.ok is False]
    for r in failed:
        print(f"\n{r.name} FAILED:\n{r.detail}")
    verdict = "FAILED: " + ", ".join(r.name for r in failed) if failed else "PASSED"
    print(f"{verdict} ({time.monotonic() - t0:.0f} s)")
    if args.json:
        doc = {"environment": env, "checks": gpu_checks.results_json(results),
               "verdict": verdict}
        write_json(args.json, doc)
    return 1 if failed else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--consumers", type=int, default=3)
    ap.add_argument("--batches", type=int, default=200, help="batches per run")
    ap.add_argument("--batch-shape", default="256,3,224,224",
                    help="shape of x (uint8); y is int64 (shape[0],)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    ap.add_argument("--require-gpu", action="store_true",
                    help="exit 2 instead of 0 when there is no usable GPU")
    ap.add_argument("--device", default="cuda:0", help="the producer's GPU (default cuda:0)")
    ap.add_argument("--work-ms", type=float, default=10.0,
                    help="CPU work per batch in the throughput step (simulated decoding)")
    ap.add_argument("--workers", type=int, default=4, help="workers per DataLoader")
    ap.add_argument("--repeats", type=int, default=3, help="throughput repeats")
    ap.add_argument("--ring-slots", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=10, help="batches not timed / profiled")
    ap.add_argument("--profile-batches", type=int, default=20,
                    help="batches recorded by torch.profiler in the verify step")
    ap.add_argument("--steps", default=",".join(STEPS),
                    help=f"comma-separated subset of {','.join(STEPS)}")
    ap.add_argument("--quick", action="store_true",
                    help="run only the correctness checks, gpu_checks.py's (issue 23) then "
                         "gpu_driver_checks.py's (issue 34), sized for under 5 minutes on "
                         "one GPU, and print their table")
    known = [*gpu_checks.CHECKS, *gpu_driver_checks.CHECKS]
    ap.add_argument("--checks", default=None,
                    help=f"with --quick or --fake: comma-separated subset of {','.join(known)}")
    ap.add_argument("--cycles", type=int, default=3,
                    help="with --quick: producer + consumer cycles of memory_cycles")
    ap.add_argument("--no-overhead", action="store_true",
                    help="with --quick: skip the per-batch cost of next() (60 batches)")
    ap.add_argument("--fake", metavar="LIBFAKECUDA",
                    help="run only the issue-34 checks of gpu_driver_checks.py, quick form, "
                         "on the CUDA driver double at this path (build: compile it first); "
                         "no GPU needed")
    ap.add_argument("--smoke", action="store_true",
                    help="run the checks' machinery on a host ring (no GPU needed) and exit")
    args = ap.parse_args(argv)
    args.checks = [c for c in (args.checks or ",".join(known)).split(",") if c]
    for c in args.checks:
        if c not in known:
            ap.error(f"--checks: unknown check {c!r} (known: {', '.join(known)})")
    if args.cycles < 2:
        ap.error("--cycles >= 2 (a leak shows as the difference between cycles)")
    args.steps = [s for s in args.steps.split(",") if s]
    for s in args.steps:
        if s not in STEPS:
            ap.error(f"unknown step {s!r}")
    try:
        parse_shape(args.batch_shape)
    except ValueError as e:
        ap.error(str(e))
    if args.consumers < 1 or args.batches < 2 or args.repeats < 1:
        ap.error("--consumers >= 1, --batches >= 2 and --repeats >= 1")
    kind, _, index = args.device.partition(":")
    if kind != "cuda" or not (index.isdigit() or index == ""):
        ap.error(f"--device {args.device!r}: use cuda or cuda:N")
    args.device = f"cuda:{index or 0}"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        res = gpu_checks.smoke_host_ring()
        print(gpu_checks.format_table([res]))
        if not res.ok:
            print(res.detail)
        return 0 if res.ok else 1
    if args.fake:
        return run_fake(args)
    if args.quick:  # runs on a MIG instance too (the GPU-ring checks say they skip)
        reason = gpu_checks.skip_reason(int(args.device.partition(":")[2]))
    else:
        reason = gpu_skip_reason(args.device)
    if reason is not None:
        print(f"SKIPPED: {reason}", flush=True)
        return 2 if args.require_gpu else 0
    if args.quick:
        return run_quick(args)
    args.work_iters = calibrate_work(args.work_ms) if "throughput" in args.steps else 0
    env = environment(args)
    print(f"GPU check on {env['gpu']} ({args.device}), driver {env['driver_version']}, "
          f"torch {env['torch']} (CUDA {env['torch_cuda']}), {env['cpus']} CPUs; "
          f"batch {env['batch_shape']} uint8 + labels = {env['batch_mb']:.1f} MB", flush=True)
    results: dict = {}
    steps = {"verify": step_verify, "overhead": step_overhead, "throughput": step_throughput}
    failed = []
    for name in args.steps:
        print(f"step {name} ...", flush=True)
        try:
            results[name] = steps[name](args)
        except Exception as e:  # a failed step is reported; the others still run
            results[name] = {"ok": False, "error": str(e)}
            print(f"step {name} FAILED: {e}", flush=True)
        if results[name].get("ok") is False:
            failed.append(name)
    print_report(env, {k: v for k, v in results.items() if "error" not in v})
    verdict = "FAILED: " + ", ".join(failed) if failed else "PASSED"
    print(verdict)
    if args.json:
        doc = {"environment": env, "results": results, "verdict": verdict}
        write_json(args.json, doc)
    return 1 if failed else 0


if __name__ == "__main__":
    dispatch({role: child_main for role in ("_producer", "_consumer", "_baseline")}, main)
