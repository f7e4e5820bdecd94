"""Orderings on the GPU path (issue 23 items 1, 2, 3 and 7; issue 34), on the CUDA driver
double.

Real producer and consumer processes over real shared memory; the consumer is a script
(CONSUMER below) that stands in for torch.cuda with the double itself (tests/fakecuda.py):
its device tensors are the DLPack capsules of the slot's GPU copy, exported with its
"current" stream (which it also reports as torch's current stream at each call), and its
training code queues work on a second stream of its own, joined into the current one
before the next call where the release must wait for it (docs/gpu.md: a release waits for
the streams the views were exported to and the stream current at the next call).

Where a test needs the producer to come round to a slot while the consumer's work on it
is still queued, that work waits behind a gate (fakecuda_launch_gate): the consumer opens
it once the producer has published the batch that goes into the same slot again (the slot
was handed back under the queued work: the bug), or after GATE_S seconds if that never
happens (the slot was held: the fix). Nothing depends on how long anything takes, except
the side-stream read of item 2a, which must come before the producer's slow copy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import fakecuda
from test_gpu import fake_lib  # noqa: F401  (fixture)

SLOTS = 4
TESTS = str(Path(__file__).resolve().parent)

CONSUMER = r'''
import logging, os, sys, time
sys.path.insert(0, sys.argv[1])
import fakecuda
import tensorsocket.data.delivery as delivery
from tensorsocket import TensorConsumer
from tools.harness import emit

tests, name, scenario, slots, gate_s = sys.argv[1:6]
SLOTS, GATE_S = int(slots), float(gate_s)
fc = fakecuda.FakeCuda(os.environ["TENSORSOCKET_LIBCUDA"])
fc.setup(0)
cur = fc.stream_create(1)   # the stream current at next()
side = fc.stream_create(1)  # another stream of the training code

fakecuda.deliver_device_tensors(delivery, cur)
records = []


class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())


logging.getLogger("tensorsocket").addHandler(Keep())


def flush(c, wait_ms=0):
    f = getattr(c.ring, "flush_releases", None)  # missing before issue 23
    if f is not None:
        f(wait_ms)


def join(into, stream):
    """into waits for the work queued on stream so far (torch: into.wait_stream(stream))."""
    ev = fc.event_create()
    fc.event_record(ev, stream)
    fc.stream_wait_event(into, ev)


out = {"scenario": scenario}
pin = scenario == "pinned"
c = TensorConsumer(name=name, timeout=60, batch_timeout=60, device="cpu" if pin else None,
                   pin_memory=pin)
it = iter(c)
if scenario == "pinned":
    # Item 1: a non_blocking copy out of a pinned host view, queued behind other work on
    # the current stream (where torch's x.cuda(non_blocking=True) queues it), then the view
    # dropped.
    b0 = next(it)
    x = b0[0]
    want = fakecuda.fnv1a(x.numpy().tobytes())
    out["original"] = want == fakecuda.tuple_leaf_sum(0)
    dst = fc.mem_alloc(x.numel() * 4)
    gate = fc.launch_gate(cur)
    fc.memcpy_htod_async(dst, x.data_ptr(), x.numel() * 4, cur)
    del b0, x
    kept = fakecuda.take_a_round(it, c.ring, gate, SLOTS, GATE_S)
    fc.stream_synchronize(cur)
    out["copy_ok"] = fakecuda.fnv1a(fc.read(dst, 128)) == want
    out["came_round"] = int(kept[-1][1][0]) == SLOTS
    fc.mem_free(dst)
    del kept
elif scenario == "side_read":
    # Item 2a: read on another stream than the one current at next(), at once.
    out["reads"] = []
    for v in range(2):
        b = next(it)
        res = fc.launch_read(side, b[0].ptr, b[0].nbytes)
        fc.stream_synchronize(side)
        out["reads"].append(res.value == fakecuda.tuple_leaf_sum(v))
        del b
elif scenario == "side_release":
    # Item 2b: a slow read queued on another stream and joined into the current one (as
    # timm's PrefetchLoader does before it hands the batch on) before the views are
    # dropped.
    b0 = next(it)
    gate = fc.launch_gate(side)
    res = fc.launch_read(side, b0[0].ptr, b0[0].nbytes)
    join(cur, side)
    del b0
    kept = fakecuda.take_a_round(it, c.ring, gate, SLOTS, GATE_S)
    fc.stream_synchronize(side)
    out["read_ok"] = res.value == fakecuda.tuple_leaf_sum(0)
    out["ctx_record_event"] = fc.counter("ctx_record_event")
    out["ctx_sync"] = fc.counter("ctx_sync")
    del kept
elif scenario == "fail_sync":
    # Item 3: the release thread's wait fails (FAKECUDA_FAIL_OP).
    me = c.ring.info()["consumer"]
    b0 = next(it)
    del b0
    flush(c, 30000)  # the release thread has tried by the time this returns
    out["errors"] = []
    for _ in range(3):
        try:
            next(it)
        except Exception as e:
            out["errors"].append(f"{type(e).__name__}: {e}")
            break
    # Still ours, and never refilled (a refill would set our bit again).
    out["held"] = bool(c.ring.slot_readers()[0] >> me & 1) and \
        c.ring.info()["published"] <= SLOTS
    c.close()
    emit(out)
    sys.exit(0)
elif scenario == "capture":
    # Item 3: views dropped while the training code captures a CUDA graph.
    me = c.ring.info()["consumer"]
    calls = ("event_record", "event_sync", "event_query", "stream_sync", "ctx_sync",
             "ctx_record_event", "free")
    b0 = next(it)
    fc.begin_capture(cur)
    before = sum(fc.counter(op) for op in calls)
    del b0
    out["deleter_calls"] = sum(fc.counter(op) for op in calls) - before
    b1 = next(it)  # the stream to wait for is being captured: nothing recorded yet
    out["held_during_capture"] = bool(c.ring.slot_readers()[0] >> me & 1) and \
        c.ring.info()["published"] <= SLOTS
    out["capture_valid"] = fc.end_capture(cur)
    del b1
    next(it)  # flushes now
    deadline = time.monotonic() + 60  # the producer refills the slot once it is back
    while c.ring.info()["published"] <= SLOTS and time.monotonic() < deadline:
        time.sleep(0.005)
    out["released_after"] = c.ring.info()["published"] > SLOTS
    out["invalidated"] = fc.counter("capture_invalidated")
    out["relaxed_sections"] = fc.counter("exchange_capture_mode")
elif scenario == "after_close":
    # Review 3: the last batch outlives close(); dropped then, nothing of ours flushes.
    b0 = next(it)
    c.close()
    closes = fc.counter("ipc_close_mem")
    del b0
    deadline = time.monotonic() + 60  # the release thread flushes and the ring goes
    while fc.counter("ipc_close_mem") < closes + SLOTS and time.monotonic() < deadline:
        time.sleep(0.005)
    out["unmapped"] = fc.counter("ipc_close_mem") - closes
    emit(out)
    sys.exit(0)
elif scenario == "exit":
    # Item 7: leave with batches held, a release queued behind slow work, and no close().
    b0 = next(it)
    fc.launch_read(cur, b0[0].ptr, b0[0].nbytes, 300000)
    del b0
    held = [next(it), next(it)]  # the first next() handed b0's release to the reaper
    emit({"scenario": scenario, "held": len(held)})
    sys.exit(0)  # the finalizer closes; the held views die with the interpreter
for _ in it:
    pass
out["log"] = records
c.close()
out["open_ok"] = True
emit(out)
'''


@pytest.fixture
def gpu_env(fake_lib, tmp_path):  # noqa: F811  (test_gpu's has an op delay; none here)
    """Environment of processes on the double, with a call log; checks no leftovers."""
    with fakecuda.checked_env(fake_lib, tmp_path / "cuda.log") as env:
        yield env


GATE_S = 3.0


def _run(procs, name, env, scenario, *, batches=2 * SLOTS + 2, gpu=True, penv=None,
         cenv=None):
    """A producer of `batches` tuple batches and the CONSUMER script running scenario."""
    p = procs.start("producer", "--name", name, "--kind", "tuple", "--batches", str(batches),
                    "--slots", str(SLOTS), *(("--device", "cuda:0") if gpu else ()),
                    env={**env, **(penv or {})})
    procs.wait_ready(p)
    c = procs.script(CONSUMER, TESTS, name, scenario, str(SLOTS), str(GATE_S),
                     env={**env, **(cenv or {})})
    return p, c


def test_pinned_view_not_reused_under_a_queued_copy(procs, name, gpu_env):
    """Item 1: a pin_memory=True consumer queues an asynchronous copy out of a pinned host
    view (behind other work on its current stream) and drops the view: the producer does
    not refill the slot before the copy ran, so the copy gets the batch it was given."""
    p, c = _run(procs, name, gpu_env, "pinned", gpu=False)
    r = procs.result(c)
    procs.result(p)
    assert r["original"] and r["came_round"]
    assert r["copy_ok"], "the slot was refilled while a copy out of it was still queued"


def test_batch_readable_on_any_stream_once_next_returns(procs, name, gpu_env):
    """Item 2a: the producer's copy is slow; the consumer reads the batch on a stream other
    than the one current at next(), at once, with nothing ordering that stream: it reads
    the whole batch, not what the slot held before the copy."""
    p, c = _run(procs, name, gpu_env, "side_read", batches=2,
                penv={"FAKECUDA_OP_DELAY_US": "300000"})
    r = procs.result(c)
    procs.result(p)
    assert r["reads"] == [True, True], "a side-stream read saw the batch before its copy"


@pytest.mark.parametrize("driver", ["12080", "12040"])
def test_slot_not_reused_under_work_joined_from_another_stream(procs, name, gpu_env, driver):
    """Item 2b: a read queued on another stream than the one the batch was exported to,
    joined into the current stream, then the views dropped: the slot is not refilled under
    the read. The same on a driver without cuCtxRecordEvent (12.4): no call concerns the
    whole context on either (issue 34)."""
    p, c = _run(procs, name, gpu_env, "side_release", cenv={"FAKECUDA_DRIVER_VERSION": driver})
    r = procs.result(c)
    procs.result(p)
    assert r["read_ok"], "the slot was refilled under a read joined into the current stream"
    assert r["ctx_record_event"] == 0 and r["ctx_sync"] == 0


def test_failed_release_wait_keeps_the_slot(procs, name, gpu_env):
    """Item 3: the release thread's cuEventSynchronize fails: the slot is never handed
    back, and the consumer's next call says what failed."""
    p, c = _run(procs, name, gpu_env, "fail_sync", cenv={"FAKECUDA_FAIL_OP": "event_sync"})
    r = procs.result(c)
    # It left with the slot held; a second consumer reads the rest, so the producer ends.
    rest = procs.start("consumer", "--name", name, "--kind", "tuple", "--gpu-double",
                       env=gpu_env)
    procs.result(rest)
    procs.result(p)
    assert r["held"], "the slot was released although the wait for the GPU work failed"
    assert len(r["errors"]) == 1, "next() went on as if the release had worked"
    assert r["errors"][0].startswith("CudaError: a GPU release of this consumer failed")
    assert "cuEventSynchronize" in r["errors"][0] and "stays held" in r["errors"][0]


def test_release_during_capture_keeps_the_capture(procs, name, gpu_env):
    """Item 3: views dropped while a CUDA graph is captured on the consumer's stream: the
    deleter makes no driver call, nothing is recorded on the capturing stream until the
    capture ended, the capture stays valid, and the slot goes back after it."""
    p, c = _run(procs, name, gpu_env, "capture")
    r = procs.result(c)
    procs.result(p)
    assert r["deleter_calls"] == 0, "the deleter called the driver during a capture"
    assert r["held_during_capture"]
    assert r["capture_valid"] and r["invalidated"] == 0
    assert r["released_after"]
    assert r["relaxed_sections"] >= 2  # driver calls made in RELAXED capture mode


def test_exit_with_batches_held_and_a_release_pending(procs, name, gpu_env):
    """Item 7: a consumer exits (no close()) holding two batches, with the release of a
    third waiting for slow GPU work: no crash, nothing left in /dev/shm (gpu_env), the
    producer sees it leave and finishes, and the pending release was waited for before
    the exit (in the double's log: the read ran, then the release's wait returned)."""
    p, c = _run(procs, name, gpu_env, "exit")
    out, err = c.communicate(timeout=120)
    assert c.returncode == 0, err
    assert "Traceback" not in err and "Sanitizer" not in err, err
    rest = procs.start("consumer", "--name", name, "--kind", "tuple", "--gpu-double",
                       env=gpu_env)
    procs.result(rest)  # attached: the producer saw the first one leave, and goes on
    procs.result(p)
    log = fakecuda.parse_log(gpu_env["FAKECUDA_LOG"])
    mine = [line for line in log if line.pid == c.pid]
    ops = [line.op for line in mine]
    assert "exec_read" in ops
    read_at = ops.index("exec_read")
    assert "event_sync" in ops[read_at:], "the process ended before its release was waited for"


def test_view_dropped_after_close_is_released(procs, name, gpu_env):
    """Review 3: a batch that outlives consumer.close() (a validation consumer's last
    batch) is released when dropped, with no consumer call left to flush it: its release
    thread flushes by itself, the ring handle goes, and with it the mapping of every slot
    of the pool (so the producer's importer count drops and its keeper can free it)."""
    p, c = _run(procs, name, gpu_env, "after_close")
    r = procs.result(c)
    rest = procs.start("consumer", "--name", name, "--kind", "tuple", "--gpu-double",
                       env=gpu_env)
    procs.result(rest)
    procs.result(p)
    assert r["unmapped"] == SLOTS, "a view dropped after close() kept the pool mapped"
