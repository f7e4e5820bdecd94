"""The GPU path against what the real CUDA driver refuses (issue 34), on the faithful double.

Each test stands for one item of the issue and failed on the tree before it (7094346) with
the double made faithful (csrc/tests/fake_cuda.c; docs/gpu.md, "The driver double", cites
the driver documentation for each behaviour):

- exit: the driver tears itself down from an exit handler, so nothing of ours may call it
  once exit() has begun, however the batches die; a dlclose of the driver after cuInit is
  fatal (the double aborts at once);
- captures: cuCtxRecordEvent and cuCtxSynchronize during a capture on any thread of the
  context invalidate it; a capturing stream may not wait on an event from outside the
  capture;
- drivers before 12.5 (no cuCtxRecordEvent) and 11.x (no CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED);
- a view read only through its raw pointer; copy=True on a device view; liveness by pidfd.

The consumer is a script (CONSUMER) standing in for torch.cuda with the double itself, as
in tests/test_gpu_orderings.py: its device tensors are DLPack capsules of the slot's GPU
copy exported on its "current" stream `cur`, which is also what the consumer reports as
torch's current stream at each call (delivery.current_stream).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fakecuda
from test_gpu import fake_lib  # noqa: F401  (fixture)

SLOTS = 4
TESTS = str(Path(__file__).resolve().parent)
ROOT = Path(TESTS).parent
GATE_S = 5.0  # a gate that the bug would open early opens after this at the latest

CONSUMER = r'''
import os, sys, threading, time
sys.path.insert(0, sys.argv[1])
import fakecuda
import tensorsocket.data.delivery as delivery
from tensorsocket import TensorConsumer
from tools.harness import emit

tests, name, scenario, slots, gate_s = sys.argv[1:6]
SLOTS, GATE_S = int(slots), float(gate_s)
fc = fakecuda.FakeCuda(os.environ["TENSORSOCKET_LIBCUDA"])
ctx = fc.setup(0)
cur = fc.stream_create(fakecuda.CU_STREAM_NON_BLOCKING)  # torch's current stream here
fakecuda.deliver_device_tensors(delivery, cur)
out = {"scenario": scenario}
KEEP = []
KERNEL_US = 1000000  # still running when the interpreter exits


class RawView:
    """A device view handed out as it is: read through its raw pointer (data_ptr)."""

    def __init__(self, view):
        self.view, self.ptr, self.nbytes = view, view.data_ptr, view.nbytes
        self.shape = tuple(view.shape)
        self.ndim = len(self.shape)


def pidfds():
    """How many pidfds this process holds."""
    n = 0
    for f in os.listdir("/proc/self/fd"):
        try:
            n += "pidfd" in os.readlink(f"/proc/self/fd/{f}")
        except OSError:  # the fd of the listing itself, closed meanwhile
            pass
    return n


c = TensorConsumer(name=name, timeout=60, batch_timeout=60)
it = iter(c)
if scenario == "exit_kept":
    # A batch kept in a global, a 1 s kernel queued on it, no close(): the interpreter
    # collects the batch at shutdown, after the consumer's own finalizer.
    b = next(it)
    fc.launch_read(cur, b[0].ptr, b[0].nbytes, KERNEL_US)
    KEEP.append(b)
    del b
    held = [next(it), next(it)]
    emit(out)
    sys.exit(0)
elif scenario == "exit_after_close":
    # close() first; the batch kept dies at interpreter shutdown (the release thread's own
    # flush, after close), with a 1 s kernel queued on it.
    b = next(it)
    fc.launch_read(cur, b[0].ptr, b[0].nbytes, KERNEL_US)
    KEEP.append(b)
    del b
    c.close()
    emit(out)
    sys.exit(0)
elif scenario in ("capture_thread_global", "capture_thread_local"):
    # Thread A captures a CUDA graph on a stream of its own; this thread iterates and
    # drops its batches meanwhile (the releases of every next()).
    mode = (fakecuda.CU_STREAM_CAPTURE_MODE_GLOBAL if scenario.endswith("global")
            else fakecuda.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    began, done, result = threading.Event(), threading.Event(), {}

    def capture():
        fc.ctx_push(ctx)
        cap = fc.stream_create(fakecuda.CU_STREAM_NON_BLOCKING)
        fc.begin_capture(cap, mode)
        began.set()
        done.wait(60)
        result["valid"] = fc.end_capture(cap)

    a = threading.Thread(target=capture)
    a.start()
    began.wait()
    taken = 0
    while taken < 3 * SLOTS and fc.counter("capture_invalidated") == 0:
        b = next(it)
        fc.launch_read(cur, b[0].ptr, b[0].nbytes)
        del b
        taken += 1
    done.set()
    a.join()
    out["taken_during_capture"] = taken
    out["capture_valid"] = result["valid"]
    out["invalidated"] = fc.counter("capture_invalidated")
    out["context_wide"] = fc.counter("ctx_record_event") + fc.counter("ctx_sync")
elif scenario == "capture_here":
    # next() inside a capture of this thread's current stream (the stream it exports to).
    b0 = next(it)
    fc.begin_capture(cur, fakecuda.CU_STREAM_CAPTURE_MODE_GLOBAL)
    del b0
    b1 = next(it)  # exported to the capturing stream; b0's release waits for the capture
    out["capture_valid"] = fc.end_capture(cur)
    del b1
    out["invalidated"] = fc.counter("capture_invalidated")
elif scenario == "old_driver":
    # A driver without cuCtxRecordEvent: next() must not wait for the GPU work queued
    # before it (a gate held closed on the current stream).
    b0 = next(it)
    gate = fc.launch_gate(cur)
    fc.launch_read(cur, b0[0].ptr, b0[0].nbytes)
    del b0
    opener = threading.Timer(GATE_S, lambda: setattr(gate, "value", 1))
    opener.start()
    b1 = next(it)
    out["returned_before_the_gate"] = gate.value == 0
    gate.value = 1
    opener.cancel()
    del b1
    out["ctx_sync"] = fc.counter("ctx_sync")
    out["ctx_record_event"] = fc.counter("ctx_record_event")
elif scenario == "raw_pointer":
    # Views read only through data_ptr (as CuPy, Triton or a custom kernel would), by a
    # kernel on the legacy default stream, queued behind a gate; then dropped.
    delivery._device_tensors = lambda slot, device: [RawView(v) for v in
                                                     slot.views(device=True)]
    b0 = next(it)
    gate = fc.launch_gate(0)
    res = fc.launch_read(0, b0[0].ptr, b0[0].nbytes)
    del b0
    kept = fakecuda.take_a_round(it, c.ring, gate, SLOTS, GATE_S)
    fc.stream_synchronize(0)
    out["read_ok"] = res.value == fakecuda.tuple_leaf_sum(0)
    del kept
elif scenario == "copy_true":
    # __dlpack__(copy=True) of a device view: no raw cuMemAlloc copy (torch's allocator
    # cannot lend it memory it caches): BufferError naming the way.
    delivery._device_tensors = lambda slot, device: [RawView(v) for v in
                                                     slot.views(device=True)]
    b0 = next(it)
    allocs = fc.counter("alloc")
    try:
        b0[0].view.__dlpack__(stream=cur, copy=True)
        out["copy"] = "made"
    except BufferError as e:
        out["copy"] = f"BufferError: {e}"
    out["allocs"] = fc.counter("alloc") - allocs
    del b0
elif scenario == "pidfd":
    b0 = next(it)
    out["pidfds"] = pidfds()
    print("MARK-BEGIN", flush=True)
    del b0
    for _ in range(2 * SLOTS):
        b = next(it)
        del b
    print("MARK-END", flush=True)
for batch in it:
    del batch
c.close()
# The ring handle (and its pidfd) goes once the last batch's deferred release is done (the
# release thread flushes by itself after close).
deadline = time.monotonic() + 30
while pidfds() and time.monotonic() < deadline:
    time.sleep(0.01)
out["pidfds_after_close"] = pidfds()
emit(out)
'''


@pytest.fixture
def gpu_env(fake_lib, tmp_path):  # noqa: F811
    """Environment of processes on the double, with a call log; checks no leftovers."""
    with fakecuda.checked_env(fake_lib, tmp_path / "cuda.log") as env:
        yield env


def _run(procs, name, env, scenario, *, batches=3 * SLOTS + 2, penv=None, cenv=None,
         fork=True):
    """A GPU producer of `batches` tuple batches and the CONSUMER script running scenario.
    fork=False: both are new interpreters (the fork server's children end with os._exit,
    which runs no exit handler: the exit tests need the real exit())."""
    p = procs.start("producer", "--name", name, "--kind", "tuple", "--batches", str(batches),
                    "--slots", str(SLOTS), "--device", "cuda:0", env={**env, **(penv or {})},
                    fork=fork)
    procs.wait_ready(p)
    c = procs.script(CONSUMER, TESTS, name, scenario, str(SLOTS), str(GATE_S),
                     env={**env, **(cenv or {})}, fork=fork)
    return p, c


def _after_teardown(env: dict, pid: int) -> list[str]:
    """The driver calls process pid made once exit() had torn the driver down."""
    return [ln["op"] for ln in fakecuda.select(fakecuda.parse_log(env["FAKECUDA_LOG"]),
                                               "after_teardown", pid=pid)]


def _finish(procs, name, env, p) -> dict:
    """A second consumer reads what is left, so that the producer ends; its report."""
    rest = procs.start("consumer", "--name", name, "--kind", "tuple", "--gpu-double", env=env)
    procs.result(rest)
    return procs.result(p)


# ---- item 1: exit ------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["exit_kept", "exit_after_close"])
def test_exit_makes_no_driver_call_after_the_driver_tore_down(procs, name, gpu_env, scenario):
    """A consumer exits with a batch kept in a global and a 1 s kernel queued on it
    (without close(), or after it): exit status 0, no hang, and no driver call once exit()
    began (the release thread stopped and joined by then, the driver never unloaded)."""
    p, c = _run(procs, name, gpu_env, scenario, fork=False)
    out, err = c.communicate(timeout=120)
    assert c.returncode == 0, err
    assert "Traceback" not in err and "unloaded" not in err, err
    log = fakecuda.parse_log(gpu_env["FAKECUDA_LOG"])
    assert fakecuda.select(log, "teardown", pid=c.pid)  # it ended in exit()
    assert _after_teardown(gpu_env, c.pid) == [], err
    _finish(procs, name, gpu_env, p)
    assert _after_teardown(gpu_env, p.pid) == []


def test_a_producer_that_never_touched_torch_cuda_exits_cleanly(procs, name, gpu_env):
    """The producer process loads the driver only through tensorsocket: at its exit the
    driver is neither unloaded after cuInit (the double aborts if it is) nor called after
    its teardown."""
    for run in range(3):
        p, c = _run(procs, f"{name}-{run}", gpu_env, "drain", fork=False)
        procs.result(c)
        procs.result(p)
        assert p.returncode == 0
        log = fakecuda.parse_log(gpu_env["FAKECUDA_LOG"])
        assert fakecuda.select(log, "teardown", pid=p.pid)  # it ended in exit()
        assert not fakecuda.select(log, "unloaded_after_init", pid=p.pid)
        assert _after_teardown(gpu_env, p.pid) == []


# ---- item 2: captures --------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["capture_thread_global", "capture_thread_local"])
def test_a_capture_on_another_thread_survives_next_and_releases(procs, name, gpu_env,
                                                                 scenario):
    """Thread A captures a CUDA graph while this thread iterates and drops its batches:
    the capture stays valid, no context-wide call is made, and the releases go on during
    the capture (three rounds of the ring were taken)."""
    p, c = _run(procs, name, gpu_env, scenario)
    r = procs.result(c)
    procs.result(p)
    assert r["invalidated"] == 0 and r["capture_valid"], r
    assert r["context_wide"] == 0
    assert r["taken_during_capture"] == 3 * SLOTS


def test_next_inside_a_capture_on_its_own_thread(procs, name, gpu_env):
    """next() while the stream it exports to is being captured: no wait on an event from
    outside the capture (the double would refuse it: isolation), no flush that breaks it."""
    p, c = _run(procs, name, gpu_env, "capture_here")
    r = procs.result(c)
    procs.result(p)
    assert r["capture_valid"] and r["invalidated"] == 0, r


# ---- item 3: older drivers ---------------------------------------------------------------


def test_a_driver_before_12_5_keeps_the_overlap(procs, name, gpu_env):
    """Without cuCtxRecordEvent (CUDA 12.4), next() does not synchronize the context: it
    returns while GPU work queued before it still runs."""
    p, c = _run(procs, name, gpu_env, "old_driver", cenv={"FAKECUDA_DRIVER_VERSION": "12040"})
    r = procs.result(c)
    procs.result(p)
    assert r["returned_before_the_gate"], "next() waited for the GPU work queued before it"
    assert r["ctx_sync"] == 0 and r["ctx_record_event"] == 0


def test_an_11x_driver_gets_the_gpu_ring(procs, name, gpu_env):
    """A CUDA 11.8 driver refuses CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED (new in 12.0):
    the GPU ring still works there, zero-copy, with no fallback blaming MIG."""
    old = {"FAKECUDA_REJECT_ATTRIBUTES": "125", "FAKECUDA_DRIVER_VERSION": "11080"}
    p = procs.start("producer", "--name", name, "--kind", "tuple", "--batches", "6",
                    "--slots", str(SLOTS), "--device", "cuda:0", "--no-fallback",
                    env={**gpu_env, **old})
    procs.wait_ready(p)
    c = procs.start("consumer", "--name", name, "--kind", "tuple", "--gpu-double",
                    env={**gpu_env, **old})
    r = procs.result(c)
    procs.result(p)
    assert r["errors"] == [] and r["stats"]["zero_copy_gpu"] is True, r


# ---- item 4: raw pointers ----------------------------------------------------------------


def test_a_view_read_through_its_raw_pointer_is_released_after_the_kernel(procs, name,
                                                                           gpu_env):
    """A device view read only through data_ptr, by a kernel queued (behind other work) on
    the legacy default stream, then dropped: the slot is not refilled under the kernel."""
    p, c = _run(procs, name, gpu_env, "raw_pointer")
    r = procs.result(c)
    procs.result(p)
    assert r["read_ok"], "the slot was refilled under a kernel that read it by data_ptr"


# ---- item 6: copy=True -------------------------------------------------------------------


def test_a_device_copy_is_not_made_with_raw_cumemalloc(procs, name, gpu_env):
    """__dlpack__(copy=True) of a device view refuses (BufferError naming the framework's
    copy) instead of allocating outside the framework's caching allocator."""
    p, c = _run(procs, name, gpu_env, "copy_true")
    r = procs.result(c)
    procs.result(p)
    assert r["copy"].startswith("BufferError") and "clone()" in r["copy"], r
    assert r["allocs"] == 0


# ---- item 7: liveness by pidfd -----------------------------------------------------------


def test_liveness_of_the_producer_is_a_pidfd(procs, name, gpu_env, tmp_path):
    """A GPU consumer holds a pidfd of the producer while attached (none after close), and
    its next() never opens /proc/<producer>/stat (seen with strace)."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("no strace")
    p = procs.start("producer", "--name", name, "--kind", "tuple", "--batches",
                    str(3 * SLOTS + 2), "--slots", str(SLOTS), "--device", "cuda:0",
                    env=gpu_env)
    ready = procs.wait_ready(p)
    trace = tmp_path / "trace"
    env = {**os.environ, **gpu_env, "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}"}
    proc = subprocess.run(
        [strace, "-f", "-qq", "-e", "trace=openat,open,write", "-o", str(trace), sys.executable,
         "-c", CONSUMER, TESTS, name, "pidfd", str(SLOTS), str(GATE_S)],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    procs.result(p)
    if proc.returncode != 0 and "ptrace" in proc.stderr:
        pytest.skip(f"strace cannot trace here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr
    r = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    report = __import__("json").loads(r[-1])
    assert report["pidfds"] == 1 and report["pidfds_after_close"] == 0, report
    text = trace.read_text()
    window = text[text.index("MARK-BEGIN"):text.index("MARK-END")]
    stat = re.findall(rf'open(?:at)?\(.*"/proc/{ready["pid"]}/stat"', window)
    assert stat == [], f"next() read /proc/{ready['pid']}/stat {len(stat)} times"
