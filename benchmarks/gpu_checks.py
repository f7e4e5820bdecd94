"""The real-GPU forms of issue 23's orderings, shared by tests/test_gpu_real.py and
benchmarks/gpu_check.py (``--quick``): each fact is checked in one place, here.

Every check is a function ``check_<name>(opts) -> CheckResult`` (registered in CHECKS). It
starts real producer and consumer processes (this file re-invoked with the hidden
``_role`` argument) over real shared memory and the real CUDA driver, through the public
API only (TensorProducer, TensorConsumer), except where named (the ``__dlpack__(stream=-1)``
check patches the consumer's export hook), and judges what they report. A check whose
hardware is missing (a second GPU, MIG) returns a skipped result with the reason.

The semantics checked (docs/gpu.md):

- once next() returns, a batch is readable from any stream of the consumer's device;
- a released view's slot (a device view, or a page-locked host view with
  ``pin_memory=True``) is not reused until the work queued on the streams its views were
  used on has finished: the stream it was exported to (torch's current stream at next()),
  the stream current at the consumer's next call, and the legacy default stream for
  views exported with DLPack stream -1; work on another stream is covered once it is
  joined into the current one before the next call
  (``torch.cuda.current_stream().wait_stream(side)``, as timm's PrefetchLoader does);
- a release while a CUDA graph is being captured does not invalidate the capture;
- the producer keeps its device memory until every importer has closed or died; device
  memory is back to its baseline once producers and consumers are gone;
- peer access is checked, an impossible peer falls back to host delivery with
  GPUFallbackWarning; devices are matched by UUID (CUDA_VISIBLE_DEVICES reordering, MIG).

Batch b of epoch e carries v = e * 1000 + b (``values="epoch"``) or b (``values="index"``,
the DataLoader check): ``x`` float32 filled with v, ``y`` int64 (batch,) filled with v.
Sums are taken in float64 / int64 and compared exactly.

Nothing here needs a GPU to import; ``skip_reason()`` says why the checks cannot run.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from bench_common import import_tensorsocket, report

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# Timeouts (seconds): every wait here has one.
ATTACH_TIMEOUT = 60.0  # consumer -> producer handshake (CUDA initialisation included)
START_TIMEOUT = 120.0  # producer waits this long for its consumers
BATCH_TIMEOUT = 120.0  # consumer waits this long for one batch
LINE_TIMEOUT = 120.0  # a role prints an expected line within this
RESULT_TIMEOUT = 180.0  # a role finishes within this after it was told to
MEMORY_SETTLE = 20.0  # device memory comes back to its baseline within this
KILL_GRACE = 5.0

SLEEP_CYCLES = 100_000_000  # torch.cuda._sleep: some 50 ms on an H100 (1.98 GHz)
MEMORY_TOLERANCE = 32 << 20  # bytes of device memory drift allowed (allocator caches)
# A documented fallback names the driver's error on stderr (log.warning): not a failure.
FALLBACK_WORDS = ("GPU ring unavailable", "cannot read the producer's GPU ring",
                  "GPUFallbackWarning", "falling back", "host ring")


@dataclass
class CheckResult:
    """What one check found. ok None: skipped (skipped says why)."""

    name: str
    ok: bool | None
    figure: str = ""  # the measured facts, one line
    detail: str = ""  # why it failed (or what it saw), several lines
    skipped: str | None = None
    seconds: float = 0.0
    data: dict = field(default_factory=dict)  # the roles' reports


@dataclass
class Options:
    """Knobs of a run (gpu_check.py sets them from its command line)."""

    device: int = 0  # the producer's GPU (CUDA ordinal in this process's numbering)
    batches: int = 16  # per epoch, in the ordering checks
    sleep_cycles: int = SLEEP_CYCLES
    cycles: int = 3  # producer + consumer cycles of the memory check
    release_timeout: float = 1.0  # the idle-consumer check's producer
    gpu_ring: bool = True  # the GPU has CUDA IPC events (not a MIG instance): GPU rings work


def default_options(device: int = 0) -> Options:
    """Options for GPU `device`, with gpu_ring from what tensorsocket sees of it."""
    devices = import_tensorsocket().gpu_status()["devices"] or []
    ipc = device < len(devices) and bool(devices[device].get("ipc_events"))
    return Options(device=device, gpu_ring=ipc)


def no_gpu_ring(name: str, opts: Any) -> CheckResult | None:
    """A skipped result where GPU rings cannot work on the device (no CUDA IPC events:
    a MIG instance); the mig check covers that case. opts: Options, or any options with
    its device and gpu_ring (gpu_driver_checks.DriverOptions)."""
    if opts.gpu_ring:
        return None
    return CheckResult(name, None, skipped=f"GPU {opts.device} has no CUDA IPC events (a MIG "
                       "instance?): GPU rings fall back to the host ring there (check mig)")


CHECKS: dict[str, Callable[[Options], CheckResult]] = {}


def register(registry: dict[str, Callable]) -> Callable[[Callable], Callable]:
    """A decorator that registers a check in `registry` under its name (check_<name>)."""
    def add(fn: Callable) -> Callable:
        registry[fn.__name__.removeprefix("check_")] = fn
        return fn
    return add


check = register(CHECKS)  # this file's checks (issue 23)


# -- where the checks can run -------------------------------------------------------------


def skip_reason(device: int = 0) -> str | None:
    """Why the checks cannot run here (one line), or None."""
    if os.environ.get("TENSORSOCKET_LIBCUDA"):
        return ("TENSORSOCKET_LIBCUDA is set (the CUDA driver test double is loaded); "
                "these checks need the real driver")
    try:
        import torch
    except ImportError as e:
        return f"torch cannot be imported ({e})"
    why = []
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        why.append(f"torch.cuda.is_available() is False (torch {torch.__version__}, {build})")
    try:
        status = import_tensorsocket().gpu_status()
    except ImportError as e:
        return f"tensorsocket cannot be imported ({e}); build it with pip install -e ."
    if not status["available"]:
        why.append(f"tensorsocket.gpu_status(): {status['reason']}")
    if why:
        return "no usable GPU: " + "; ".join(why)
    devices = status["devices"] or []
    if device >= len(devices) or device >= torch.cuda.device_count():
        return f"no GPU {device} ({len(devices)} visible)"
    return None


def gpu_count() -> int:
    """GPUs tensorsocket sees (no CUDA context is created)."""
    status = import_tensorsocket().gpu_status()
    return len(status["devices"] or [])


def mig_devices() -> list[str]:
    """MIG instance UUIDs nvidia-smi lists (empty without nvidia-smi or MIG)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = []
    for line in out.splitlines():
        if "MIG-" in line and "UUID:" in line:
            found.append(line.rsplit("UUID:", 1)[1].strip().rstrip(")").strip())
    return found


def device_memory_used(device: int = 0) -> tuple[int | None, str]:
    """Bytes of device memory in use on GPU `device` (tensorsocket's numbering) from
    nvidia-smi, matched by UUID; (None, why) where it cannot tell. Read with no process
    of this run alive, it is the machine's baseline."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None, "nvidia-smi not found"
    devices = import_tensorsocket().gpu_status()["devices"] or []
    if device >= len(devices):
        return None, f"no GPU {device}"
    want = str(devices[device]["uuid"]).lower().replace("-", "")
    try:
        out = subprocess.run([smi, "--query-gpu=uuid,memory.used", "--format=csv,noheader,"
                              "nounits"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"nvidia-smi failed: {e}"
    for line in out.splitlines():
        uid, _, used = line.partition(",")
        if uid.strip().lower().removeprefix("gpu-").replace("-", "") == want:
            return int(used.strip()) << 20, "nvidia-smi memory.used"
    return None, f"nvidia-smi lists no GPU with UUID {want}"


def settle_memory(baseline: int | None, device: int) -> tuple[int | None, str]:
    """Poll device memory in use until it is back within MEMORY_TOLERANCE of `baseline`
    or MEMORY_SETTLE seconds passed (the driver frees an exited process's memory
    asynchronously); (bytes above the baseline, how it was read)."""
    if baseline is None:
        return None, "no baseline"
    deadline = time.monotonic() + MEMORY_SETTLE
    while True:
        used, how = device_memory_used(device)
        if used is None:
            return None, how
        if used - baseline <= MEMORY_TOLERANCE or time.monotonic() > deadline:
            return used - baseline, how
        time.sleep(0.2)


# -- role processes -------------------------------------------------------------------------


class Procs:
    """Role processes of one check: started, read, and always reaped (with timeouts).
    A role is `script` (default: this file) run as ``_role <role> '<json args>'``."""

    def __init__(self, name: str, script: Path | None = None) -> None:
        self.name = name
        self.script = script or Path(__file__).resolve()
        self.procs: list[subprocess.Popen] = []
        self._err: dict[int, Any] = {}  # pid -> stderr file
        self._out: dict[int, bytes] = {}  # pid -> stdout read but not yet consumed

    def start(self, role: str, args: dict, env: dict | None = None) -> subprocess.Popen:
        """Start `role` with `args` (JSON); its stdin is a pipe (go())."""
        err = tempfile.TemporaryFile()
        path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        p = subprocess.Popen(
            [sys.executable, str(self.script), "_role", role, json.dumps(args)],
            stdout=subprocess.PIPE, stderr=err, stdin=subprocess.PIPE, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": path, **(env or {})},
        )
        self.procs.append(p)
        self._err[p.pid] = err
        self._out[p.pid] = b""
        return p

    def stderr(self, p: subprocess.Popen) -> str:
        err = self._err[p.pid]
        err.seek(0)
        return err.read()[-4000:].decode(errors="replace")

    def go(self, p: subprocess.Popen, word: str = "go") -> None:
        """Tell p to go on (a line on its stdin)."""
        assert p.stdin is not None
        p.stdin.write(word.encode() + b"\n")
        p.stdin.flush()

    def line(self, p: subprocess.Popen, key: str, timeout: float = LINE_TIMEOUT) -> dict:
        """The next JSON line of p with `key` (lines before it are dropped)."""
        deadline = time.monotonic() + timeout
        assert p.stdout is not None
        fd = p.stdout.fileno()
        while True:
            buf = self._out[p.pid]
            while b"\n" in buf:
                text, buf = buf.split(b"\n", 1)
                self._out[p.pid] = buf
                if text.startswith(b"{"):
                    obj = json.loads(text)
                    if key in obj:
                        return obj
                    if "error" in obj:
                        raise RuntimeError(f"role failed: {obj['error']}\n{self.stderr(p)}")
            left = deadline - time.monotonic()
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_READ)
                if left <= 0 or not sel.select(left):
                    raise TimeoutError(f"no {key!r} line within {timeout} s\n{self.stderr(p)}")
            chunk = os.read(fd, 65536)
            if not chunk:
                p.wait(timeout=10)
                raise RuntimeError(f"exited ({p.returncode}) before a {key!r} line\n"
                                   f"{self.stderr(p)}")
            self._out[p.pid] += chunk

    def result(self, p: subprocess.Popen, timeout: float = RESULT_TIMEOUT) -> dict:
        """Wait for p; its last JSON line (with "exit": its exit status)."""
        obj = self.line(p, "result", timeout)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"did not exit within {timeout} s after its result\n"
                               f"{self.stderr(p)}") from None
        out = obj["result"]
        out["exit"] = p.returncode
        out["stderr"] = self.stderr(p)
        return out

    def wait_exit(self, p: subprocess.Popen, timeout: float) -> bool:
        """True if p exited within `timeout` seconds."""
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def close(self) -> None:
        """Terminate, then kill, every role still running; reap all; remove leftovers."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + KILL_GRACE
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()
            self._err[p.pid].close()
        try:
            from tensorsocket.cli.clean import leftovers, remove_leftovers

            for n in {item.name for item in leftovers()
                      if item.name == self.name or item.name.startswith(self.name + "-")}:
                remove_leftovers(n)
        except Exception:  # leftovers are a convenience here, never a verdict
            pass


def _unique(check_name: str) -> str:
    """A producer name for one run of a check (unique, short enough for socket paths)."""
    return f"gc-{check_name[:12]}-{uuid.uuid4().hex[:8]}"


def run_check(name: str, fn: Callable[[Procs], CheckResult],
              script: Path | None = None) -> CheckResult:
    """Run fn with a fresh Procs (roles of `script`, default this file), timing it; an
    exception is a failed check."""
    procs = Procs(_unique(name), script)
    t0 = time.monotonic()
    try:
        res = fn(procs)
    except Exception as e:  # a check that cannot finish is a failure, with the cause
        first = (str(e).splitlines() or [""])[0]
        res = CheckResult(name, False, figure=f"{type(e).__name__}: {first}"[:120],
                          detail=str(e)[-3000:])
    finally:
        procs.close()
    res.seconds = time.monotonic() - t0
    return res


# -- the checks ---------------------------------------------------------------------------


def role_errors(*reports: dict) -> list[str]:
    """The errors the roles reported (content, exceptions, driver errors on stderr)."""
    out: list[str] = []
    for r in reports:
        out += r.get("errors", [])
        if r.get("exit") not in (0, None):
            out.append(f"{r.get('role')} exited {r.get('exit')}")
        driver = [ln for ln in r.get("stderr", "").splitlines() if "CUDA_ERROR" in ln
                  and not any(w in ln for w in FALLBACK_WORDS)]
        if driver:
            out.append(f"{r.get('role')}: a CUDA driver error on stderr: {driver[0][:300]}")
    return out


def _line_with(text: str, word: str) -> str:
    return next((ln for ln in text.splitlines() if word in ln), "")[:300]


def verdict(name: str, errors: list[str], figure: str, data: dict) -> CheckResult:
    """The result of check `name`: passed if `errors` is empty (they are its detail)."""
    return CheckResult(name, not errors, figure=figure, detail="\n".join(errors[:20]),
                       data=data)


def _pair(procs: Procs, producer: dict, consumer: dict,
          consumer_env: dict | None = None, producer_env: dict | None = None
          ) -> tuple[dict, dict]:
    """One producer and one consumer, run to their ends; their reports."""
    p = procs.start("producer", {"name": procs.name, **producer}, producer_env)
    procs.line(p, "ready")
    c = procs.start("consumer", {"name": procs.name, **consumer}, consumer_env)
    cr = procs.result(c)
    pr = procs.result(p)
    return pr, cr


@check
def check_pinned_nonblocking(opts: Options) -> CheckResult:
    """Item 1: pin_memory=True on a host ring; each page-locked view is copied with
    x.cuda(non_blocking=True) on the current stream (where torch queues it) behind a slow
    kernel, then dropped at once; with 2 slots the producer comes round to each slot.
    Every copy holds its own batch (the release waits for the current stream)."""
    def run(procs: Procs) -> CheckResult:
        pr, cr = _pair(procs, {"device": "host", "batches": opts.batches, "slots": 2},
                       {"mode": "pinned", "sleep_cycles": opts.sleep_cycles,
                        "device": "cpu", "pin_memory": True, "gpu": opts.device})
        errors = role_errors(pr, cr)
        if cr.get("checked") != opts.batches:
            errors.append(f"checked {cr.get('checked')} batches, expected {opts.batches}")
        if cr.get("pending_at_drop", 0) < opts.batches // 2:
            errors.append(f"only {cr.get('pending_at_drop')} copies were still queued when "
                          "their view was dropped: the hazard was not set up (raise "
                          "sleep_cycles)")
        if pr.get("stats", {}).get("batches") != opts.batches:
            errors.append(f"the producer published {pr.get('stats', {}).get('batches')}")
        fig = (f"{cr.get('checked')} copies, {cr.get('bad', '?')} wrong, "
               f"{cr.get('pending_at_drop')} queued at drop, pinned views "
               f"{cr.get('pinned_views')}")
        return verdict("pinned_nonblocking", errors, fig, {"producer": pr, "consumer": cr})
    return run_check("pinned_nonblocking", run)


def _stream_check(name: str, opts: Options, consumer: dict, producer: dict | None = None
                  ) -> CheckResult:
    """A GPU ring; the consumer reads each batch (sums) on the streams `consumer` says,
    right after next() and behind a slow kernel, drops it at once; sums checked at the end
    (the producer came round to every slot: 2 slots)."""
    skipped = no_gpu_ring(name, opts)
    if skipped:
        return skipped

    def run(procs: Procs) -> CheckResult:
        prod = {"device": f"cuda:{opts.device}", "batches": opts.batches, "slots": 2,
                "shape": [64, 3, 224, 224], **(producer or {})}
        pr, cr = _pair(procs, prod, {"mode": "streams", "sleep_cycles": opts.sleep_cycles,
                                     "expect": f"cuda:{opts.device}", **consumer})
        errors = role_errors(pr, cr)
        if cr.get("checked") != opts.batches:
            errors.append(f"checked {cr.get('checked')} batches, expected {opts.batches}")
        if cr.get("pending_at_drop", 0) < opts.batches // 2:
            errors.append(f"only {cr.get('pending_at_drop')} reads were still queued when "
                          "the batch was dropped: the hazard was not set up")
        if cr.get("stats", {}).get("zero_copy_gpu") is not True:
            errors.append("the consumer did not read the GPU ring in place "
                          f"({cr.get('stats', {}).get('device_fallback_reason')})")
        fig = (f"{cr.get('checked')} batches, early reads wrong {cr.get('bad_early', '?')}, "
               f"late reads wrong {cr.get('bad_late', '?')}, {cr.get('pending_at_drop')} "
               f"queued at drop; next() median {cr.get('next_us_median', 0):.0f} us")
        return verdict(name, errors, fig, {"producer": pr, "consumer": cr})
    return run_check(name, run)


@check
def check_side_stream(opts: Options) -> CheckResult:
    """Item 2: next() on the default stream, the batch read inside
    torch.cuda.stream(side) right after it (must see the whole batch) and again behind a
    slow kernel queued on the side stream; the side stream is then joined into the
    current one (current_stream().wait_stream(side), as timm's PrefetchLoader does) and
    the batch dropped: the slot must not be reused under the side stream's reads. Since
    issue 34 a release waits for the current stream, not the whole context: work on a
    side stream that is never joined is not covered (docs/gpu.md)."""
    return _stream_check("side_stream", opts, {"current": "default", "read": "side",
                                               "join": True})


@check
def check_nondefault_current_stream(opts: Options) -> CheckResult:
    """next() and the reads all on a non-default current stream."""
    return _stream_check("nondefault_current_stream", opts,
                         {"current": "side", "read": "current"})


@check
def check_dlpack_stream_minus1(opts: Options) -> CheckResult:
    """Views exported with __dlpack__(stream=-1) (no ordering asked of the export), read
    on three side streams in turn: read right after next(), the batch is whole on each;
    each side stream is joined into the current one before the drop, and the slot is not
    reused under the reads queued behind a slow kernel there. Since issue 34 a -1 export's
    release waits for the legacy default stream and the stream current at the next call
    (no longer the whole context), so reads on a stream joined into neither are not
    covered. Patches tensorsocket.data.delivery._device_tensors (the consumer's export
    hook) to pass stream=-1."""
    return _stream_check("dlpack_stream_minus1", opts,
                         {"current": "default", "read": "rotate", "streams": 3,
                          "dlpack_minus1": True, "join": True})


@check
def check_graph_capture(opts: Options) -> CheckResult:
    """Item 3: batches released while a CUDA graph is captured (torch.cuda.graph, global
    capture mode; from the capturing thread and from another thread): the capture is not
    invalidated (a deleter makes no driver call; the releases are flushed at the next
    next(), after the capture), the graph replays correctly on the following batches."""
    skipped = no_gpu_ring("graph_capture", opts)
    if skipped:
        return skipped

    def run(procs: Procs) -> CheckResult:
        pr, cr = _pair(procs, {"device": f"cuda:{opts.device}", "batches": opts.batches,
                               "slots": 4},
                       {"mode": "graph", "expect": f"cuda:{opts.device}"})
        errors = role_errors(pr, cr)
        if cr.get("capture_error"):
            errors.append(f"the capture failed: {cr['capture_error']}")
        if cr.get("replays", 0) < opts.batches - 3:
            errors.append(f"{cr.get('replays')} replays, expected {opts.batches - 3}")
        fig = (f"capture {'failed' if cr.get('capture_error') else 'ok'}, "
               f"{cr.get('replays')} replays, {cr.get('bad_replays', '?')} wrong, "
               f"{cr.get('released_in_capture', 0)} releases during the capture")
        return verdict("graph_capture", errors, fig, {"producer": pr, "consumer": cr})
    return run_check("graph_capture", run)


@check
def check_idle_past_release_timeout(opts: Options) -> CheckResult:
    """Item 4: the consumer holds its last batch and idles past the producer's short
    release_timeout while the producer closes: the batch it holds still reads right, its
    next access ends the epoch or raises a clear tensorsocket error (never a driver
    error), nothing on stderr says device memory was freed under it, and device memory
    is back to its baseline once both are gone."""
    skipped = no_gpu_ring("idle_past_release_timeout", opts)
    if skipped:
        return skipped

    def run(procs: Procs) -> CheckResult:
        baseline, how = device_memory_used(opts.device)
        rt = opts.release_timeout
        p = procs.start("producer", {"name": procs.name, "device": f"cuda:{opts.device}",
                                     "batches": 6, "slots": 3, "release_timeout": rt,
                                     "join": False})
        procs.line(p, "ready")
        c = procs.start("consumer", {"name": procs.name, "mode": "idle",
                                     "expect": f"cuda:{opts.device}"})
        procs.line(c, "holding")
        procs.line(p, "published")
        # The idle time is the point of this check: past release_timeout, or until the
        # producer process is gone, whichever comes first. The producer closes right after
        # "published" (join=False): a producer that frees its pool at release_timeout and
        # exits (the old behaviour) is waited for, so the verdict does not depend on this
        # machine's speed; one that keeps the pool for the consumer is still closing.
        exited = procs.wait_exit(p, rt + 3.0)
        procs.go(c)
        cr = procs.result(c)
        pr = procs.result(p)
        above, how = settle_memory(baseline, opts.device)
        errors = role_errors(pr, cr)
        if not cr.get("held_ok"):
            errors.append(f"the batch held across the producer's close read wrong: "
                          f"{cr.get('held')}")
        after = cr.get("after", "")
        if not (after == "StopIteration" or cr.get("after_clear")):
            errors.append(f"next() after the idle time: {after} (expected the end of the "
                          "epoch or a clear tensorsocket error)")
        if "freeing it anyway" in pr.get("stderr", ""):
            errors.append("the producer freed device memory a consumer still mapped: "
                          + _line_with(pr["stderr"], "freeing it anyway"))
        if above is not None and above > MEMORY_TOLERANCE:
            errors.append(f"device memory {above >> 20} MiB above the baseline after both "
                          f"exited ({how})")
        fig = (f"producer {'exited' if exited else 'still closing'} after {rt + 3.0:.0f} s; "
               f"next(): {after}; memory "
               + ("n/a (" + how + ")" if above is None else f"{above / 2**20:+.0f} MiB"))
        return verdict("idle_past_release_timeout", errors, fig,
                        {"producer": pr, "consumer": cr, "memory_above": above})
    return run_check("idle_past_release_timeout", run)


@check
def check_producer_killed(opts: Options) -> CheckResult:
    """Item 4, where the producer must go: it is SIGKILLed mid-epoch while the consumer
    holds a batch (and maps the pool). The consumer's next accesses give only right
    batches, then end with a clear tensorsocket error (or the epoch's end) within its
    batch_timeout, never a hang or a driver error; what the held batch reads afterwards
    is reported (the driver's rule for an exited exporter's memory); device memory is
    back to its baseline once the consumer is gone."""
    skipped = no_gpu_ring("producer_killed", opts)
    if skipped:
        return skipped

    def run(procs: Procs) -> CheckResult:
        baseline, how = device_memory_used(opts.device)
        p = procs.start("producer", {"name": procs.name, "device": f"cuda:{opts.device}",
                                     "batches": 12, "slots": 3, "join": False})
        procs.line(p, "ready")
        c = procs.start("consumer", {"name": procs.name, "mode": "idle", "hold_at": 5,
                                     "batch_timeout": 20.0,
                                     "expect": f"cuda:{opts.device}"})
        procs.line(c, "holding")
        p.kill()
        p.wait(timeout=30)
        procs.go(c)
        cr = procs.result(c)
        above, how = settle_memory(baseline, opts.device)
        errors = role_errors(cr)
        after = cr.get("after", "")
        if not (after == "StopIteration" or cr.get("after_clear")):
            errors.append(f"after the producer's death: {after} (expected a clear "
                          "tensorsocket error, within batch_timeout)")
        if above is not None and above > MEMORY_TOLERANCE:
            errors.append(f"device memory {above >> 20} MiB above the baseline after both "
                          f"exited ({how})")
        fig = (f"{cr.get('after_batches')} batches after the kill, then {after[:60]}; "
               f"held batch: {'right' if cr.get('held_ok') else cr.get('held', '')[:60]}; "
               "memory " + ("n/a (" + how + ")" if above is None
                            else f"{above / 2**20:+.0f} MiB"))
        return verdict("producer_killed", errors, fig, {"consumer": cr})
    return run_check("producer_killed", run)


@check
def check_dataloader_workers_epochs(opts: Options) -> CheckResult:
    """A GPU ring whose producer runs a DataLoader with non-persistent workers
    (num_workers=2) over 3 epochs: the workers are forked each epoch after the producer
    initialised CUDA; every batch arrives right."""
    skipped = no_gpu_ring("dataloader_workers_epochs", opts)
    if skipped:
        return skipped

    def run(procs: Procs) -> CheckResult:
        epochs, batches = 3, 8
        pr, cr = _pair(procs, {"device": f"cuda:{opts.device}", "batches": batches,
                               "epochs": epochs, "loader": "dataloader", "workers": 2},
                       {"mode": "check", "epochs": epochs, "values": "index",
                        "expect": f"cuda:{opts.device}"})
        errors = role_errors(pr, cr)
        want = [list(range(batches))] * epochs
        if cr.get("values") != want:
            errors.append(f"values {cr.get('values')}, expected {want}")
        if pr.get("stats", {}).get("batches") != epochs * batches:
            errors.append(f"the producer published {pr.get('stats', {}).get('batches')}")
        fig = f"{epochs} epochs x {batches} batches, {len(cr.get('errors', []))} wrong"
        return verdict("dataloader_workers_epochs", errors, fig,
                        {"producer": pr, "consumer": cr})
    return run_check("dataloader_workers_epochs", run)


@check
def check_memory_cycles(opts: Options) -> CheckResult:
    """opts.cycles producer + consumer cycles (a producer and a consumer made, run and
    closed each time, in two processes that live on): after each, device-wide free memory
    comes back to the level before the first; after both exit, memory in use is back to
    the machine's baseline."""
    skipped = no_gpu_ring("memory_cycles", opts)
    if skipped:
        return skipped

    def run(procs: Procs) -> CheckResult:
        baseline, how = device_memory_used(opts.device)
        dev = f"cuda:{opts.device}"
        p = procs.start("producer", {"name": procs.name, "device": dev, "batches": 6,
                                     "slots": 3, "cycles": opts.cycles, "measure": True,
                                     "shape": [64, 3, 224, 224]})
        c = procs.start("consumer", {"name": procs.name, "mode": "check", "cycles":
                                     opts.cycles, "expect": dev, "warm_shape":
                                     [64, 3, 224, 224]})
        procs.line(p, "cuda_ready")
        procs.line(c, "cuda_ready")
        procs.go(p)  # both contexts exist: the producer takes its reference now
        cr = procs.result(c)
        pr = procs.result(p)
        above, how = settle_memory(baseline, opts.device)
        errors = role_errors(pr, cr)
        deficits = pr.get("deficits", [])
        if len(deficits) != opts.cycles:
            errors.append(f"{len(deficits)} cycles measured, expected {opts.cycles}")
        for i, d in enumerate(deficits):
            if d > MEMORY_TOLERANCE:
                errors.append(f"after cycle {i}, device free memory {d >> 20} MiB below the "
                              "level before the first (a pool not freed?)")
        if above is not None and above > MEMORY_TOLERANCE:
            errors.append(f"device memory {above >> 20} MiB above the baseline after both "
                          f"exited ({how})")
        fig = ("deficit per cycle " + ", ".join(f"{d / 2**20:.0f}" for d in deficits)
               + " MiB; after exit " + ("n/a (" + how + ")" if above is None
                                        else f"{above / 2**20:+.0f} MiB"))
        return verdict("memory_cycles", errors, fig, {"producer": pr, "consumer": cr})
    return run_check("memory_cycles", run)


def _two_gpus(opts: Options) -> str | None:
    n = gpu_count()
    if n < 2:
        return f"needs 2 GPUs ({n} visible)"
    devices = import_tensorsocket().gpu_status()["devices"] or []
    if not all(d.get("ipc_events") for d in devices[:2]):
        return "GPU 0 or 1 has no CUDA IPC events (MIG?): no GPU ring to share"
    return None


@check
def check_peer_import(opts: Options) -> CheckResult:
    """A consumer on GPU 1 of a ring on GPU 0, with peer access (the default): zero-copy
    on cuda:1 where cuDeviceCanAccessPeer allows it, else host delivery with
    GPUFallbackWarning; the content right either way."""
    reason = _two_gpus(opts)
    if reason:
        return CheckResult("peer_import", None, skipped=reason)

    def run(procs: Procs) -> CheckResult:
        pr, cr = _pair(procs, {"device": "cuda:0", "batches": 8},
                       {"mode": "check", "device": "cuda:1", "expect": "cuda:1"})
        errors = role_errors(pr, cr)
        can = cr.get("can_access_peer")
        zero = cr.get("stats", {}).get("zero_copy_gpu")
        fell = any("GPUFallbackWarning" in w for w in cr.get("warnings", []))
        if can and not zero:
            errors.append(f"peer access possible but not zero-copy: {cr.get('warnings')}")
        if not can and (zero or not fell):
            errors.append(f"peer access impossible: expected the fallback warning, got "
                          f"zero_copy_gpu={zero}, warnings {cr.get('warnings')}")
        fig = f"can_access_peer {can}, zero_copy_gpu {zero}, fallback warning {fell}"
        return verdict("peer_import", errors, fig, {"producer": pr, "consumer": cr})
    return run_check("peer_import", run)


@check
def check_peer_access_false(opts: Options) -> CheckResult:
    """peer_access=False: a consumer on GPU 1 of a ring on GPU 0 gets its own copies on
    cuda:1 (not zero-copy), right, with no warning."""
    reason = _two_gpus(opts)
    if reason:
        return CheckResult("peer_access_false", None, skipped=reason)

    def run(procs: Procs) -> CheckResult:
        pr, cr = _pair(procs, {"device": "cuda:0", "batches": 8},
                       {"mode": "check", "device": "cuda:1", "expect": "cuda:1",
                        "peer_access": False})
        errors = role_errors(pr, cr)
        if cr.get("stats", {}).get("zero_copy_gpu") is not False:
            errors.append("peer_access=False still read the ring in place")
        if cr.get("warnings"):
            errors.append(f"warnings: {cr['warnings']}")
        fig = f"zero_copy_gpu {cr.get('stats', {}).get('zero_copy_gpu')}, " \
              f"device {cr.get('stats', {}).get('device')}"
        return verdict("peer_access_false", errors, fig, {"producer": pr, "consumer": cr})
    return run_check("peer_access_false", run)


@check
def check_visible_devices_reordered(opts: Options) -> CheckResult:
    """The producer sees GPUs as 0,1 and puts its ring on cuda:1; the consumer sees them
    as 1,0 (CUDA_VISIBLE_DEVICES): it must find the ring's GPU as its cuda:0 (matched by
    UUID) and read it in place there."""
    reason = _two_gpus(opts)
    if reason:
        return CheckResult("visible_devices_reordered", None, skipped=reason)

    def run(procs: Procs) -> CheckResult:
        pr, cr = _pair(procs, {"device": "cuda:1", "batches": 8},
                       {"mode": "check", "expect": "cuda:0"},
                       consumer_env={"CUDA_VISIBLE_DEVICES": "1,0"},
                       producer_env={"CUDA_VISIBLE_DEVICES": "0,1"})
        errors = role_errors(pr, cr)
        if cr.get("stats", {}).get("zero_copy_gpu") is not True:
            errors.append(f"not read in place: {cr.get('stats', {}).get('device_fallback_reason')}")
        if cr.get("devices") != ["cuda:0"]:
            errors.append(f"tensors on {cr.get('devices')}, expected cuda:0")
        fig = f"consumer devices {cr.get('devices')}, zero_copy_gpu " \
              f"{cr.get('stats', {}).get('zero_copy_gpu')}"
        return verdict("visible_devices_reordered", errors, fig,
                        {"producer": pr, "consumer": cr})
    return run_check("visible_devices_reordered", run)


@check
def check_mig(opts: Options) -> CheckResult:
    """On a MIG instance (CUDA_VISIBLE_DEVICES=MIG-...): the producer asked for cuda:0
    either reads the ring in place or falls back to the host ring with
    GPUFallbackWarning; the consumer's content is right either way."""
    migs = mig_devices()
    if not migs:
        return CheckResult("mig", None, skipped="no MIG instance (nvidia-smi -L lists none)")

    def run(procs: Procs) -> CheckResult:
        env = {"CUDA_VISIBLE_DEVICES": migs[0]}
        pr, cr = _pair(procs, {"device": "cuda:0", "batches": 8, "fallback": True},
                       {"mode": "check", "expect": "any"}, consumer_env=env,
                       producer_env=env)
        errors = role_errors(pr, cr)
        gpu_ring = pr.get("stats", {}).get("device") == "cuda:0"
        fell = any("GPUFallbackWarning" in w for w in pr.get("warnings", []))
        if not gpu_ring and not fell:
            errors.append("a host ring without the fallback warning")
        fig = f"ring on {pr.get('stats', {}).get('device')}, fallback warning {fell}"
        return verdict("mig", errors, fig, {"producer": pr, "consumer": cr})
    return run_check("mig", run)


def smoke_host_ring() -> CheckResult:
    """The checks' own machinery (role processes, handshakes, reports) on a host ring
    with a DataLoader of 2 non-persistent workers over 2 epochs: needs no GPU (run by
    ``gpu_check.py --smoke`` to try the harness before spending device time)."""
    def run(procs: Procs) -> CheckResult:
        pr, cr = _pair(procs, {"device": "host", "batches": 4, "epochs": 2,
                               "loader": "dataloader", "workers": 2},
                       {"mode": "check", "epochs": 2, "values": "index", "expect": "cpu"})
        errors = role_errors(pr, cr)
        if cr.get("values") != [[0, 1, 2, 3]] * 2:
            errors.append(f"values {cr.get('values')}")
        return verdict("smoke_host_ring", errors, f"values {cr.get('values')}",
                        {"producer": pr, "consumer": cr})
    return run_check("smoke_host_ring", run)


def run_checks(names: list[str] | None = None, opts: Any = None,
               progress: Callable[[CheckResult], None] | None = None,
               checks: dict[str, Callable] | None = None) -> list[CheckResult]:
    """Run the named checks of `checks` (default: this file's; all of them by default) in
    order, with `opts` (default Options()); their results."""
    checks = CHECKS if checks is None else checks
    opts = opts or Options()
    out = []
    for n in names or list(checks):
        res = checks[n](opts)
        out.append(res)
        if progress is not None:
            progress(res)
    return out


def format_table(results: list[CheckResult]) -> str:
    """check / result / seconds / figure, one row each."""
    rows = [f"{'check':<28} {'result':<7} {'s':>5}  figure", "-" * 100]
    for r in results:
        shown = "SKIP" if r.ok is None else ("OK" if r.ok else "FAIL")
        fig = r.skipped if r.ok is None else r.figure
        rows.append(f"{r.name:<28} {shown:<7} {r.seconds:5.1f}  {fig}")
    return "\n".join(rows)


def results_json(results: list[CheckResult]) -> list[dict]:
    return [asdict(r) for r in results]


# -- roles (run in child processes) ---------------------------------------------------------


def wait_stdin(word: str = "go", timeout: float = LINE_TIMEOUT) -> None:
    """Wait for `word` on stdin (the orchestrator's handshake)."""
    with selectors.DefaultSelector() as sel:
        sel.register(sys.stdin, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"no {word!r} from the orchestrator within {timeout} s")
        got = sys.stdin.readline().strip()
        if got != word:
            raise RuntimeError(f"expected {word!r} on stdin, got {got!r}")


class ValueLoader:
    """`batches` batches per epoch; batch b of epoch e is filled with e * 1000 + b."""

    def __init__(self, batches: int, shape: list[int]) -> None:
        self.batches = batches
        self.shape = tuple(shape)
        self.batch_size = shape[0]
        self.epoch = 0

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        import torch

        epoch, self.epoch = self.epoch, self.epoch + 1
        for b in range(self.batches):
            v = epoch * 1000 + b
            yield {"x": torch.full(self.shape, float(v)),
                   "y": torch.full((self.shape[0],), v, dtype=torch.int64)}


class IndexDataset:
    """Map-style dataset: item i is a whole batch filled with i (DataLoader(batch_size=None))."""

    def __init__(self, batches: int, shape: list[int]) -> None:
        self.batches = batches
        self.shape = tuple(shape)

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, i: int) -> dict:
        import torch

        if not 0 <= i < self.batches:
            raise IndexError(i)
        return {"x": torch.full(self.shape, float(i)),
                "y": torch.full((self.shape[0],), i, dtype=torch.int64)}


def _loader(a: dict):
    shape = a.get("shape", [64, 3, 32, 32])
    if a.get("loader") == "dataloader":
        import torch

        dataset: Any = IndexDataset(a["batches"], shape)  # map-style, duck-typed
        return torch.utils.data.DataLoader(dataset, batch_size=None,
                                           num_workers=a.get("workers", 2),
                                           persistent_workers=False)
    return ValueLoader(a["batches"], shape)


def role_producer(a: dict) -> dict:
    """Publish a["epochs"] epochs, a["cycles"] times (a fresh producer each, named
    <name>-<i> when cycles > 1). measure: device-wide free memory before the first
    producer (after the orchestrator's go) and, after each close, how far below it it
    stayed once settled. min_consumers (default 1): 0 publishes with nobody attached.
    The result says whether torch initialised CUDA in this process (torch_cuda)."""
    import warnings

    from tensorsocket import TensorProducer

    cycles = a.get("cycles", 1)
    measure = a.get("measure", False)
    kw: dict = {}
    if a["device"] != "host":
        kw = {"device": a["device"], "device_fallback": a.get("fallback", False)}
    if a.get("release_timeout") is not None:
        kw["release_timeout"] = a["release_timeout"]
    if a.get("slots"):
        kw["ring_slots"] = a["slots"]
    ref = None
    if measure:
        import torch

        torch.cuda.init()
        torch.cuda.mem_get_info(a["device"])
        report({"cuda_ready": True})
        wait_stdin()
        ref = torch.cuda.mem_get_info(a["device"])[0]
    deficits, stats, drained, close_s = [], None, None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for cycle in range(cycles):
            name = a["name"] if cycles == 1 else f"{a['name']}-{cycle}"
            producer = TensorProducer(_loader(a), name=name,
                                      min_consumers=a.get("min_consumers", 1),
                                      start_grace=0, start_timeout=START_TIMEOUT, **kw)
            try:
                report({"ready": cycle})
                for _ in range(a.get("epochs", 1)):
                    for _ in producer:
                        pass
                report({"published": cycle})
                stats = producer.stats()
                if a.get("join", True):
                    drained = producer.join(timeout=60)
            finally:
                t0 = time.monotonic()
                producer.close()
                close_s = time.monotonic() - t0
            if measure:
                deficits.append(_settled_deficit(a["device"], ref))
    torch_cuda = "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized()
    return {"role": "producer", "stats": stats, "drained": drained, "close_s": close_s,
            "deficits": deficits, "errors": [], "torch_cuda": torch_cuda,
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}


def _settled_deficit(device: str, ref: int | None) -> int:
    """Bytes the device's free memory stays below `ref`, polled until within
    MEMORY_TOLERANCE or MEMORY_SETTLE seconds (a pool is freed once its last importer
    closed, which may be just after the producer's close)."""
    import torch

    assert ref is not None
    deadline = time.monotonic() + MEMORY_SETTLE
    while True:
        free = torch.cuda.mem_get_info(device)[0]
        if ref - free <= MEMORY_TOLERANCE or time.monotonic() > deadline:
            return max(0, ref - free)
        time.sleep(0.1)


def role_consumer(a: dict) -> dict:
    """A TensorConsumer in mode check / streams / pinned / graph / idle (see the _mode_*
    functions); cycles > 1: one consumer per producer cycle."""
    import warnings

    import torch

    from tensorsocket import TensorConsumer

    kw: dict = {}
    for k in ("device", "pin_memory", "peer_access"):
        if k in a:
            kw[k] = a[k]
    if a.get("expect", "cpu") not in ("cpu", "any") or a.get("pin_memory"):
        torch.cuda.init()
    if a.get("warm_shape"):  # the allocator's blocks for the sums, before any reference
        dev = a["expect"]
        torch.full(a["warm_shape"], 1.0, device=dev).sum(dtype=torch.float64).item()
        torch.full((a["warm_shape"][0],), 1, device=dev).sum().item()
        report({"cuda_ready": True})
    if a.get("dlpack_minus1"):
        _patch_export_stream(-1)
    modes = {"check": _mode_check, "streams": _mode_streams, "pinned": _mode_pinned,
             "graph": _mode_graph, "idle": _mode_idle}
    cycles = a.get("cycles", 1)
    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for cycle in range(cycles):
            name = a["name"] if cycles == 1 else f"{a['name']}-{cycle}"
            consumer = TensorConsumer(name=name, timeout=ATTACH_TIMEOUT,
                                      batch_timeout=a.get("batch_timeout", BATCH_TIMEOUT),
                                      **kw)
            res: dict = {}
            try:
                res = modes[a["mode"]](consumer, a)
                res["stats"] = consumer.stats()
            finally:
                try:
                    consumer.close()
                except Exception as e:  # reported: close must not fail
                    res.setdefault("errors", []).append(
                        f"close() raised {type(e).__name__}: {e}")
            for k, v in res.items():
                if k == "errors":
                    out.setdefault("errors", []).extend(v)
                else:
                    out[k] = v
    out.setdefault("errors", [])
    out["role"] = "consumer"
    out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    if a.get("expect") not in ("cpu", "any") and torch.cuda.device_count() >= 2:
        out["can_access_peer"] = torch.cuda.can_device_access_peer(1, 0)
    return out


def _patch_export_stream(stream: int) -> None:
    """Make the consumer export GPU views with __dlpack__(stream=<stream>) (the hook
    tensorsocket.data.delivery calls for a batch of torch tensors)."""
    from tensorsocket.data import delivery

    if not hasattr(delivery, "_device_tensors") or not hasattr(delivery, "_from_capsule"):
        raise RuntimeError("tensorsocket.data.delivery has no _device_tensors/_from_capsule hook: "
                           "update the dlpack_stream_minus1 check")

    def export(slot: Any, device: Any) -> list:
        caps = slot.capsules(versioned=True, device=True, stream=stream)
        return [delivery._from_capsule(c) for c in caps]

    delivery._device_tensors = export  # type: ignore[attr-defined]


def batch_value(a: dict, e: int, b: int) -> int:
    """The value batch b of epoch e carries (ValueLoader or IndexDataset, a["values"])."""
    return b if a.get("values") == "index" else e * 1000 + b


def sums_ok(xs: Any, ys: Any, v: int, numel_x: int, n: int) -> bool:
    """Whether the sums of x (numel_x elements) and y (n) are those of a batch of v."""
    return float(xs.item()) == float(v) * numel_x and int(ys.item()) == v * n


def _mode_check(consumer: Any, a: dict) -> dict:
    """Every batch checked on its device (sums, synchronously); values per epoch."""
    import torch

    errors: list[str] = []
    values: list[list[int]] = []
    devices: set[str] = set()
    for e in range(a.get("epochs", 1)):
        seen = []
        for b, batch in enumerate(consumer):
            x, y = batch["x"], batch["y"]
            devices.update((str(x.device), str(y.device)))
            v = int(y[0].item())
            seen.append(v)
            if v != batch_value(a, e, b):
                errors.append(f"epoch {e} batch {b}: value {v}, expected {batch_value(a, e, b)}")
            if not sums_ok(x.sum(dtype=torch.float64), y.sum(), v, x.numel(), y.numel()):
                errors.append(f"epoch {e} batch {b}: content is not {v}")
            if a.get("expect") not in (None, "any") and str(x.device) != a["expect"]:
                errors.append(f"epoch {e} batch {b}: on {x.device}, expected {a['expect']}")
            del batch, x, y
        values.append(seen)
    return {"values": values, "errors": errors[:20], "devices": sorted(devices)}


def _mode_streams(consumer: Any, a: dict) -> dict:
    """Per batch: next() with the "current" stream current (default or a side stream);
    on the "read" stream(s) (current, side, or rotate over "streams" streams) sums read
    right after next() (early), a slow kernel, sums again (late); with "join", the read
    stream joined into the current one (current.wait_stream(read)); the batch dropped at
    once, the reads still queued. Checked after the end (the producer came round)."""
    import torch

    dev = torch.device(a["expect"])
    torch.cuda.set_device(dev)
    side = [torch.cuda.Stream(dev) for _ in range(a.get("streams", 1))]
    cur = torch.cuda.Stream(dev) if a["current"] == "side" else torch.cuda.default_stream(dev)
    reads, pending, next_ns = [], 0, []
    with torch.cuda.stream(cur):
        it = iter(consumer)
        b = 0
        while True:
            t0 = time.perf_counter_ns()
            try:
                batch = next(it)
            except StopIteration:
                break
            next_ns.append(time.perf_counter_ns() - t0)
            x, y = batch["x"], batch["y"]
            s = cur if a["read"] == "current" else side[b % len(side)]
            with torch.cuda.stream(s):
                early = (x.sum(dtype=torch.float64), y.sum())
                torch.cuda._sleep(a["sleep_cycles"])
                late = (x.sum(dtype=torch.float64), y.sum())
                done = torch.cuda.Event()
                done.record(s)
            if a.get("join") and s is not cur:
                cur.wait_stream(s)  # the release waits for the current stream
            numel, n = x.numel(), y.numel()
            del batch, x, y  # the slot goes back while the reads are queued
            pending += not done.query()
            reads.append((batch_value(a, 0, b), early, late, numel, n))
            b += 1
    torch.cuda.synchronize(dev)
    errors, bad_early, bad_late = [], 0, 0
    for v, early, late, numel, n in reads:
        if not sums_ok(*early, v, numel, n):
            bad_early += 1
            errors.append(f"batch {v}: read right after next() saw sums {early[0].item()}, "
                          f"{early[1].item()} (not the whole batch: read before its copy?)")
        if not sums_ok(*late, v, numel, n):
            bad_late += 1
            errors.append(f"batch {v}: read behind the slow kernel saw sums {late[0].item()}, "
                          f"{late[1].item()} (the slot was reused under it)")
    next_ns.sort()
    return {"checked": len(reads), "errors": errors[:20], "bad_early": bad_early,
            "bad_late": bad_late, "pending_at_drop": pending,
            "next_us_median": next_ns[len(next_ns) // 2] / 1e3 if next_ns else 0.0}


def _mode_pinned(consumer: Any, a: dict) -> dict:
    """Host ring, pin_memory=True: per batch, on the current stream (where torch queues
    x.cuda(non_blocking=True)), a slow kernel and then x.cuda(non_blocking=True), y
    likewise; the views dropped at once. The copies are checked at the end."""
    import torch

    dev = torch.device("cuda", a.get("gpu", 0))
    torch.cuda.set_device(dev)
    current = torch.cuda.current_stream(dev)
    copies, pending, pinned = [], 0, 0
    for b, batch in enumerate(consumer):
        x, y = batch["x"], batch["y"]
        pinned += bool(x.is_pinned())
        torch.cuda._sleep(a["sleep_cycles"])
        xg = x.cuda(dev, non_blocking=True)
        yg = y.cuda(dev, non_blocking=True)
        done = torch.cuda.Event()
        done.record(current)
        del batch, x, y  # the slot goes back while the copies are queued
        pending += not done.query()
        copies.append((batch_value(a, 0, b), xg, yg))
    torch.cuda.synchronize(dev)
    errors = []
    for v, xg, yg in copies:
        if not sums_ok(xg.sum(dtype=torch.float64), yg.sum(), v, xg.numel(), yg.numel()):
            errors.append(f"batch {v}: its copy holds sums {xg.sum(dtype=torch.float64).item()}"
                          f", {yg.sum().item()} (the slot was refilled under the copy)")
    return {"checked": len(copies), "errors": errors[:20], "bad": len(errors),
            "pending_at_drop": pending, "pinned_views": pinned}


def _mode_graph(consumer: Any, a: dict) -> dict:
    """A graph out = x * 2 + 1 on a static input; batches released during its capture
    (one by this thread, one by another thread); replayed on each following batch."""
    import torch

    dev = torch.device(a["expect"])
    torch.cuda.set_device(dev)
    it = iter(consumer)
    first = next(it)
    static_in = first["x"].clone()
    held = [next(it), next(it)]  # released during the capture
    torch.cuda.synchronize(dev)
    warm = torch.cuda.Stream(dev)  # warm-up on a side stream, as torch's docs ask
    warm.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(warm):
        for _ in range(3):
            static_in * 2.0 + 1.0
    torch.cuda.current_stream(dev).wait_stream(warm)
    del first

    other = held.pop()
    go, gone = threading.Event(), threading.Event()

    def drop_other() -> None:
        nonlocal other
        go.wait(LINE_TIMEOUT)
        other = None  # the last reference: released on this thread
        gone.set()

    t = threading.Thread(target=drop_other)
    t.start()
    graph = torch.cuda.CUDAGraph()
    capture_error = None
    released = 0
    try:
        with torch.cuda.graph(graph):
            static_out = static_in * 2.0 + 1.0
            held.clear()  # a release on the capturing thread
            released += 1
            go.set()
            if gone.wait(LINE_TIMEOUT):  # a release on another thread
                released += 1
    except Exception as e:  # the capture was invalidated
        capture_error = f"{type(e).__name__}: {e}"
    go.set()
    t.join(LINE_TIMEOUT)
    errors, replays, bad = [], 0, 0
    if capture_error is None:
        for batch in it:
            v = int(batch["y"][0].item())
            static_in.copy_(batch["x"])
            graph.replay()
            want = float(2 * v + 1) * static_out.numel()
            got = float(static_out.sum(dtype=torch.float64).item())
            replays += 1
            if got != want:
                bad += 1
                errors.append(f"replay on batch {v}: sum {got}, expected {want}")
            del batch
    else:
        for batch in it:  # drain the epoch
            del batch
    return {"capture_error": capture_error, "replays": replays, "bad_replays": bad,
            "released_in_capture": released, "errors": errors[:20]}


def _mode_idle(consumer: Any, a: dict) -> dict:
    """Read batches 0..hold_at (checked), keeping batch hold_at; say "holding" and wait
    for the orchestrator (the producer closes, or is killed, meanwhile); then ask for
    batches until the end of the epoch or an error (each one delivered is checked), and
    read the held batch again."""
    import torch

    from tensorsocket.errors import CudaError, TensorSocketError

    hold_at = a.get("hold_at", 5)
    errors: list[str] = []
    held = None
    it = iter(consumer)
    for b in range(hold_at + 1):
        batch = next(it)
        if b == hold_at:
            held = batch
        if not sums_ok(batch["x"].sum(dtype=torch.float64), batch["y"].sum(), b,
                        batch["x"].numel(), batch["y"].numel()):
            errors.append(f"batch {b}: content is not {b}")
        del batch
    torch.cuda.synchronize(a["expect"])
    report({"holding": True})
    wait_stdin(timeout=LINE_TIMEOUT)
    # What the next accesses give: batches (each must be right), then the end or an error.
    after_clear, after_batches, after = False, 0, "no end within 64 batches"
    for b in range(hold_at + 1, hold_at + 65):
        try:
            batch = next(it)
        except StopIteration:
            after = "StopIteration"
            break
        except CudaError as e:  # the driver's error: not a clear one
            after = f"CudaError: {e}"
            break
        except TensorSocketError as e:
            after, after_clear = f"{type(e).__name__}: {e}", True
            break
        except Exception as e:  # TimeoutError (batch_timeout): a hang
            after = f"{type(e).__name__}: {e}"
            break
        after_batches += 1
        try:
            ok = sums_ok(batch["x"].sum(dtype=torch.float64), batch["y"].sum(), b,
                          batch["x"].numel(), batch["y"].numel())
        except Exception as e:  # a batch delivered that cannot be read
            ok = False
            errors.append(f"batch {b}, delivered after the wait, cannot be read: "
                          f"{type(e).__name__}: {e}")
        if not ok:
            errors.append(f"batch {b}, delivered after the wait: content is not {b}")
        del batch
    held_ok, held_text = False, "no batch held"
    if held is not None:
        try:
            xs, ys = held["x"].sum(dtype=torch.float64), held["y"].sum()
            held_ok = sums_ok(xs, ys, hold_at, held["x"].numel(), held["y"].numel())
            held_text = f"sums {xs.item()}, {ys.item()}"
        except Exception as e:  # the driver's rule for memory of an exited exporter
            held_text = f"{type(e).__name__}: {e}"[:500]
    del held
    return {"held_ok": held_ok, "held": held_text, "after": after[:500],
            "after_clear": after_clear, "after_batches": after_batches, "errors": errors}


def role_main(argv: list[str], roles: dict[str, Callable[[dict], dict]] | None = None) -> int:
    """Entry point of a role process: ``_role <role> '<json args>'``, a role of `roles`
    (default: producer and consumer of this file)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    # The library's warnings (a pool freed under an importer, a fallback) go to stderr,
    # which the checks read: this is the application, so it may configure logging.
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s: %(message)s")
    role, args = argv[0], json.loads(argv[1])
    try:
        res = (roles or {"producer": role_producer, "consumer": role_consumer})[role](args)
    except BaseException as e:
        import traceback

        traceback.print_exc()
        report({"error": f"{role}: {type(e).__name__}: {e}"})
        return 1
    report({"result": res})
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_role":
        sys.exit(role_main(sys.argv[2:]))
    print("usage: python benchmarks/gpu_check.py --quick (this module holds its checks)",
          file=sys.stderr)
    sys.exit(2)
