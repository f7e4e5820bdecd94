"""The GPU ring on a real NVIDIA GPU, end to end, in real processes.

Skipped unless torch sees a CUDA GPU, tensorsocket's C core loads the real driver and
sees one, and TENSORSOCKET_LIBCUDA is unset (with it set, the CUDA driver test double
is loaded instead: tests/test_gpu.py covers that). No GPU is needed to collect this file.

The producer and consumer roles are the functions ``producer_role`` and
``consumer_role`` below. Each test runs them as separate processes
(``python -c "import test_gpu_real; ..."``); every process prints JSON lines on
stdout, the last one being its result. Batch b of epoch e carries the value
v = e * 1000 + b: ``x`` float32 (64, 3, 32, 32) and ``y`` int64 (64,) are filled with it.

The checks of issue 23 (orderings across streams, pinned views under non_blocking
copies, releases during a CUDA graph capture, a consumer idle past release_timeout,
DataLoader workers, device memory, two GPUs, MIG) live in benchmarks/gpu_checks.py, one
function each, shared with ``benchmarks/gpu_check.py --quick``; test_issue23_check runs
each of them here. Those of issue 34 (exits with kept batches, producers that never touch
torch's CUDA, a capture on another thread, the step time, two consumers in one process, a
consumer in the producer's process, a raw-pointer copy, copy=True with torch's cache at
95%) live in benchmarks/gpu_driver_checks.py; test_issue34_check runs them here (with the
real driver; tests/test_gpu_driver_script.py runs them on the driver double).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_checks  # noqa: E402  (imports no torch, needs no GPU)
import gpu_driver_checks  # noqa: E402  (the same)
ROLE_ENV = "TENSORSOCKET_GPU_REAL_ROLE"  # set in role processes: never skip there

BATCH = 64
X_SHAPE = (BATCH, 3, 32, 32)
X_BYTES = BATCH * 3 * 32 * 32 * 4  # float32
Y_BYTES = BATCH * 8  # int64
STRUCTURE_ALLOWANCE = 4096  # per batch: alignment and the structure blob (msgpack)

START_TIMEOUT = 120.0  # producer waits this long for its consumers
ATTACH_TIMEOUT = 60.0  # consumer waits this long for the producer
RESULT_TIMEOUT = 180.0  # a role process finishes within this
LINE_TIMEOUT = 120.0  # a role process prints an expected line within this
EVICTION_DEADLINE = 5.0  # a SIGKILLed consumer stops blocking the others within this


def _skip_reason() -> str | None:
    """Why these tests cannot run here, or None."""
    if os.environ.get("TENSORSOCKET_LIBCUDA"):
        return ("TENSORSOCKET_LIBCUDA is set (the CUDA driver test double is loaded); "
                "these tests need the real driver")
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    import tensorsocket

    status = tensorsocket.gpu_status()
    if not status["available"]:
        return f"no CUDA GPU for tensorsocket (gpu_status(): {status['reason']})"
    return None


if not os.environ.get(ROLE_ENV):
    _REASON = _skip_reason()
    if _REASON is not None:
        pytest.skip(_REASON, allow_module_level=True)

pytestmark = [pytest.mark.timeout(300)] if importlib.util.find_spec("pytest_timeout") else []


# -- roles (run in child processes) -----------------------------------------------------


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def producer_role(a: argparse.Namespace) -> dict:
    """Publish a.epochs epochs of a ValueLoader; the result holds stats() and join()."""
    from tensorsocket import TensorProducer

    kw = {}
    if a.device != "host":
        kw = {"device": a.device, "device_fallback": False}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        producer = TensorProducer(gpu_checks.ValueLoader(a.batches, list(X_SHAPE)), name=a.name,
                                  min_consumers=a.min_consumers, ring_slots=a.slots,
                                  start_timeout=START_TIMEOUT, **kw)
        try:
            _emit({"ready": True, "pid": os.getpid()})
            for _ in range(a.epochs):
                for _ in producer:
                    pass
            stats = producer.stats()
            drained = producer.join(timeout=60)
        finally:
            producer.close()
    return {"stats": stats, "drained": drained,
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


def consumer_role(a: argparse.Namespace) -> dict:
    """Consume a.epochs epochs in one of the modes:

    check: per batch, read the value from y, check x and y on their device, run a
      matmul on x and check it, record the device and how much torch's CUDA allocator
      grew inside next() (0 for zero-copy tensors); optionally stall after N batches.
    sleep: per batch, queue a long kernel (torch.cuda._sleep) and then x.sum() and
      y.sum() on the current stream, and drop the batch at once, without synchronizing;
      the sums are checked at the end against the values the batches must carry.
    """
    import torch

    from tensorsocket import TensorConsumer

    kw = {}
    if a.device is not None:
        kw["device"] = a.device
    if a.pin_memory:
        kw["pin_memory"] = True
    if a.expect != "cpu" or a.pin_memory:
        torch.cuda.init()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        consumer = TensorConsumer(name=a.name, timeout=ATTACH_TIMEOUT, batch_timeout=120, **kw)
        try:
            if a.mode == "sleep":
                out = _consume_sleeping(consumer, a)
            else:
                out = _consume_checking(consumer, a)
            out["stats"] = consumer.stats()
        finally:
            consumer.close()
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    return out


def _consume_checking(consumer, a: argparse.Namespace) -> dict:
    import torch

    gpu = a.expect.startswith("cuda")
    errors: list[str] = []
    values: list[list[int]] = []
    devices: set[str] = set()
    alloc_growth = []  # bytes torch's CUDA allocator grew inside next(), per batch
    weights = torch.ones(3 * 32 * 32, 8, device=a.expect)
    n = 0
    for e in range(a.epochs):
        seen: list[int] = []
        it = iter(consumer)
        while True:
            before = torch.cuda.memory_allocated(a.expect) if gpu else 0
            try:
                batch = next(it)
            except StopIteration:
                break
            if gpu:
                alloc_growth.append(torch.cuda.memory_allocated(a.expect) - before)
            n += 1
            x, y = batch["x"], batch["y"]
            devices.update((str(x.device), str(y.device)))
            v = int(y[0].item())
            seen.append(v)
            if x.dtype != torch.float32 or tuple(x.shape) != X_SHAPE or \
                    y.dtype != torch.int64 or tuple(y.shape) != (BATCH,):
                errors.append(f"epoch {e} batch {len(seen) - 1}: {x.dtype} {tuple(x.shape)}, "
                              f"{y.dtype} {tuple(y.shape)}")
            if str(x.device) != a.expect or str(y.device) != a.expect:
                errors.append(f"epoch {e} batch {len(seen) - 1}: on {x.device}/{y.device}, "
                              f"expected {a.expect}")
            # The content, checked where the tensors are (a GPU reduction on a GPU).
            if not bool((x == float(v)).all().item()) or not bool((y == v).all().item()):
                errors.append(f"epoch {e} batch {len(seen) - 1}: content is not {v}")
            # A small kernel reading the whole batch: (64, 3072) @ (3072, 8).
            prod = x.reshape(BATCH, -1) @ weights.to(x.device)
            want = torch.full_like(prod, float(v) * 3 * 32 * 32)
            if not bool(torch.allclose(prod, want, rtol=1e-3)):
                errors.append(f"epoch {e} batch {len(seen) - 1}: matmul is not {v * 3072}")
            del batch, x, y, prod, want
            if a.stall_after is not None and n == a.stall_after:
                held = next(it)  # keep the next batch (its slot) while we hang
                _emit({"stalled": True, "pid": os.getpid()})
                time.sleep(3600)
                del held
            if a.signal_first and n == 1:
                _emit({"first": True})
        values.append(seen)
    if gpu:
        torch.cuda.synchronize(a.expect)
    return {"values": values, "errors": errors[:20], "devices": sorted(devices),
            "alloc_growth_max": max(alloc_growth, default=None),
            "ended_at": time.monotonic()}  # CLOCK_MONOTONIC: comparable across processes


def _consume_sleeping(consumer, a: argparse.Namespace) -> dict:
    import torch

    results = []  # (value the batch must carry, x sum, y sum, done event), kept to the end
    pending_at_drop = 0
    devices: set[str] = set()
    for e in range(a.epochs):
        for b, batch in enumerate(consumer):
            x, y = batch["x"], batch["y"]
            devices.update((str(x.device), str(y.device)))
            torch.cuda._sleep(a.sleep_cycles)  # a long kernel ahead of the reads
            xs = x.sum(dtype=torch.float64)
            ys = y.sum()
            done = torch.cuda.Event()
            done.record()
            del batch, x, y  # the slot goes back, GPU-safely, while the kernels are queued
            pending_at_drop += not done.query()
            results.append((e * 1000 + b, xs, ys, done))
    torch.cuda.synchronize()
    errors = []
    for v, xs, ys, _ in results:
        want_x, want_y = float(v) * BATCH * 3 * 32 * 32, v * BATCH
        if xs.item() != want_x or ys.item() != want_y:
            errors.append(f"batch {v}: sums {xs.item()}, {ys.item()}; expected "
                          f"{want_x}, {want_y}")
    return {"checked": len(results), "errors": errors[:20], "devices": sorted(devices),
            "pending_at_drop": pending_at_drop}


def role_main(argv: list[str]) -> int:
    """Entry point of a role process: ``producer|consumer [options]``."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    ap = argparse.ArgumentParser(prog="test_gpu_real role")
    ap.add_argument("role", choices=["producer", "consumer"])
    ap.add_argument("--name", required=True)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--slots", type=int)
    ap.add_argument("--min-consumers", type=int, default=1)
    ap.add_argument("--device", help="producer: cuda:N or host; consumer: device=")
    ap.add_argument("--pin-memory", action="store_true")
    ap.add_argument("--mode", choices=["check", "sleep"], default="check")
    ap.add_argument("--expect", default="cuda:0", help="device the tensors must be on")
    ap.add_argument("--stall-after", type=int)
    ap.add_argument("--signal-first", action="store_true")
    ap.add_argument("--sleep-cycles", type=int, default=50_000_000)
    a = ap.parse_args(argv)
    if a.role == "producer":
        a.device = a.device or "cuda:0"
        _emit(producer_role(a))
    else:
        _emit(consumer_role(a))
    return 0


# -- running the roles ---------------------------------------------------------------------


class Roles:
    """Role processes of one test; all are killed and reaped at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self._err: dict[int, object] = {}  # pid -> stderr file
        self._out: dict[int, bytes] = {}  # pid -> stdout read but not yet consumed

    def start(self, role: str, *args: str) -> subprocess.Popen:
        code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(HERE)!r}]; "
                "import test_gpu_real as m; sys.exit(m.role_main(sys.argv[1:]))")
        err = tempfile.TemporaryFile()
        p = subprocess.Popen(
            [sys.executable, "-c", code, role, *args],
            stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, cwd=ROOT,
            env={**os.environ, ROLE_ENV: "1"},
        )
        self.procs.append(p)
        self._err[p.pid] = err
        self._out[p.pid] = b""
        return p

    def stderr(self, p: subprocess.Popen) -> str:
        err = self._err[p.pid]
        err.seek(0)
        return err.read()[-6000:].decode(errors="replace")

    def line(self, p: subprocess.Popen, key: str, timeout: float = LINE_TIMEOUT) -> dict:
        """The next JSON line of p on stdout that has `key` (lines before it are dropped)."""
        deadline = time.monotonic() + timeout
        fd = p.stdout.fileno()
        while True:
            buf = self._out[p.pid]
            while b"\n" in buf:
                text, buf = buf.split(b"\n", 1)
                self._out[p.pid] = buf
                if text.startswith(b"{") and key in json.loads(text):
                    return json.loads(text)
            left = deadline - time.monotonic()
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_READ)
                if left <= 0 or not sel.select(left):
                    raise AssertionError(f"no {key!r} line within {timeout} s\n"
                                         f"stderr: {self.stderr(p)}")
            chunk = os.read(fd, 65536)
            if not chunk:
                p.wait(timeout=10)
                raise AssertionError(f"exited ({p.returncode}) before a {key!r} line\n"
                                     f"stderr: {self.stderr(p)}")
            self._out[p.pid] += chunk

    def result(self, p: subprocess.Popen, timeout: float = RESULT_TIMEOUT) -> dict:
        """Wait for p; its last JSON line."""
        try:
            rest, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no result within {timeout} s\nstderr: {self.stderr(p)}") \
                from None
        out = (self._out[p.pid] + rest).decode(errors="replace")
        self._out[p.pid] = b""
        assert p.returncode == 0, f"exit {p.returncode}\nstdout: {out[-3000:]}\n" \
                                  f"stderr: {self.stderr(p)}"
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        assert lines, f"no result line\nstderr: {self.stderr(p)}"
        return json.loads(lines[-1])

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            try:
                p.communicate(timeout=10)
            except Exception:
                pass
            self._err[p.pid].close()


@pytest.fixture
def roles():
    r = Roles()
    yield r
    r.kill_all()


def _run(roles: Roles, name: str, producer: tuple = (), consumers: tuple = ((),), *,
         epochs: int = 1, batches: int = 20) -> tuple[dict, list[dict]]:
    """One producer and len(consumers) consumers (each with its extra options)."""
    p = roles.start("producer", "--name", name, "--epochs", str(epochs), "--batches",
                    str(batches), "--min-consumers", str(len(consumers)), *producer)
    roles.line(p, "ready")
    cs = [roles.start("consumer", "--name", name, "--epochs", str(epochs), *args)
          for args in consumers]
    results = [roles.result(c) for c in cs]
    return roles.result(p), results


def _values(epochs: int, batches: int) -> list[list[int]]:
    return [[e * 1000 + b for b in range(batches)] for e in range(epochs)]


# -- tests ---------------------------------------------------------------------------------


def test_three_consumers_get_zero_copy_cuda_tensors(roles, name):
    """A GPU ring on cuda:0: every consumer gets CUDA tensors on cuda:0, read in place
    (torch's allocator does not grow inside next()), with the right content; a matmul on
    them works; the producer published 2 x 20 batches."""
    prod, results = _run(roles, name, ("--device", "cuda:0"), ((), (), ()),
                         epochs=2, batches=20)
    assert prod["warnings"] == []
    assert prod["stats"]["device"] == "cuda:0"
    assert prod["stats"]["batches"] == 40
    assert prod["drained"] is True
    for r in results:
        assert r["errors"] == []
        assert r["values"] == _values(2, 20)
        assert r["devices"] == ["cuda:0"]
        assert r["stats"]["zero_copy_gpu"] is True
        assert r["stats"]["device"] == "cuda:0"
        assert r["stats"]["device_fallback_reason"] is None
        assert r["alloc_growth_max"] == 0, "next() allocated device memory: not zero-copy"
        assert r["warnings"] == []


def test_slot_is_not_reused_under_a_queued_kernel(roles, name):
    """The consumer queues a long kernel and then sums of the batch, and drops the batch
    at once; with 2 ring slots the producer would overwrite a slot released before those
    kernels ran. Every sum must still be that of the batch's own value."""
    prod, (r,) = _run(roles, name, ("--device", "cuda:0", "--slots", "2"),
                      (("--mode", "sleep"),), epochs=1, batches=16)
    assert r["errors"] == []
    assert r["checked"] == 16
    assert r["devices"] == ["cuda:0"]
    assert r["stats"]["zero_copy_gpu"] is True
    # The hazard was real: the kernels were still queued when the batches were dropped.
    assert r["pending_at_drop"] >= 8, r["pending_at_drop"]
    assert prod["stats"]["batches"] == 16 and prod["drained"] is True


def test_one_host_to_device_copy_per_batch_whatever_the_consumers(roles, name):
    """bytes_copied is one copy of each batch (tensors plus the structure blob) with one
    consumer and with three alike; the host staging memory is page-locked."""
    copied = {}
    for n in (1, 3):
        prod, results = _run(roles, f"{name}-{n}", ("--device", "cuda:0"), ((),) * n,
                             batches=10)
        stats = prod["stats"]
        assert stats["device"] == "cuda:0" and stats["batches"] == 10
        assert stats["host_pinned"] is True
        for r in results:
            assert r["errors"] == [] and r["stats"]["zero_copy_gpu"] is True
        copied[n] = stats["bytes_copied"]
    per_batch = X_BYTES + Y_BYTES
    assert 10 * per_batch <= copied[3] <= 10 * (per_batch + STRUCTURE_ALLOWANCE), copied
    assert copied[1] == copied[3], copied


def test_cpu_consumer_on_a_gpu_ring(roles, name):
    """device='cpu' gets host tensors with the right content, next to a GPU consumer."""
    prod, (cpu, gpu) = _run(roles, name, ("--device", "cuda:0"),
                            (("--device", "cpu", "--expect", "cpu"), ()), batches=12)
    assert prod["stats"]["device"] == "cuda:0"
    assert cpu["errors"] == [] and cpu["values"] == _values(1, 12)
    assert cpu["devices"] == ["cpu"]
    assert cpu["stats"]["device"] == "cpu" and cpu["stats"]["zero_copy_gpu"] is False
    assert cpu["warnings"] == []
    assert gpu["errors"] == [] and gpu["values"] == _values(1, 12)
    assert gpu["stats"]["zero_copy_gpu"] is True


def test_sigkilled_gpu_consumer_does_not_block_the_other(roles, name):
    """A consumer holding a GPU batch is SIGKILLed; the other consumer, blocked behind
    it by the full ring, finishes within EVICTION_DEADLINE; the producer finishes."""
    batches = 30
    p = roles.start("producer", "--name", name, "--device", "cuda:0", "--batches",
                    str(batches), "--slots", "4", "--min-consumers", "2")
    roles.line(p, "ready")
    victim = roles.start("consumer", "--name", name, "--stall-after", "2")
    other = roles.start("consumer", "--name", name, "--signal-first")
    roles.line(victim, "stalled")
    roles.line(other, "first")  # attached, CUDA initialized, reading
    victim.kill()
    killed_at = time.monotonic()
    victim.wait(timeout=10)
    r = roles.result(other)
    assert r["errors"] == [] and r["values"] == _values(1, batches)
    assert r["stats"]["zero_copy_gpu"] is True
    assert r["ended_at"] - killed_at < EVICTION_DEADLINE, r["ended_at"] - killed_at
    prod = roles.result(p)
    assert prod["drained"] is True and prod["stats"]["batches"] == batches


def test_host_ring_to_cuda_with_pinned_memory(roles, name):
    """A host ring; a consumer with device='cuda:0', pin_memory=True copies each batch
    to the GPU itself (torch's allocator grows) and gets the right content there."""
    prod, (r,) = _run(roles, name, ("--device", "host"),
                      (("--device", "cuda:0", "--pin-memory"),), batches=12)
    assert prod["stats"]["device"] == "cpu"
    assert r["errors"] == [] and r["values"] == _values(1, 12)
    assert r["devices"] == ["cuda:0"]
    assert r["stats"]["device"] == "cuda:0" and r["stats"]["zero_copy_gpu"] is False
    assert r["alloc_growth_max"] >= X_BYTES  # the consumer's own copy
    assert r["warnings"] == []


# -- issue 23: the checks shared with benchmarks/gpu_check.py --quick --------------------


@pytest.mark.parametrize("check_name", list(gpu_checks.CHECKS))
def test_issue23_check(check_name):
    """One check of benchmarks/gpu_checks.py (its docstring says what it proves); a check
    whose hardware is missing (a second GPU, MIG) is skipped with its reason."""
    res = gpu_checks.CHECKS[check_name](gpu_checks.default_options())
    if res.ok is None:
        pytest.skip(res.skipped or "skipped")
    assert res.ok, f"{res.name}: {res.figure}\n{res.detail}"


# -- issue 34: the checks shared with benchmarks/gpu_check.py --quick --------------------


@pytest.mark.parametrize("check_name", list(gpu_driver_checks.CHECKS))
def test_issue34_check(check_name):
    """One check of benchmarks/gpu_driver_checks.py on this GPU, with the issue's counts
    (its docstring says what it proves); a check the GPU cannot run is skipped with its
    reason."""
    res = gpu_driver_checks.CHECKS[check_name](gpu_driver_checks.torch_options())
    if res.ok is None:
        pytest.skip(res.skipped or "skipped")
    assert res.ok, f"{res.name}: {res.figure}\n{res.detail}"
