"""The GPU ring, end to end, on the CUDA driver test double (no GPU needed).

Real producer and consumer processes load csrc/tests/fake_cuda.c instead of
libcuda (TENSORSOCKET_LIBCUDA). The double keeps "device" memory in shared
memory, runs streams on worker threads with a delay per operation so that
asynchrony shows, enforces the CUDA IPC rules (no opening a handle in the
exporting process, base allocations only, no waiting on an event nobody
recorded, a current context on every calling thread) and logs every call.
Consumers read device tensors back through the double (tests/roles.py FakeGpu).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

import fakecuda
from conftest import popen, run as run_python
from subprocess import PIPE

BATCHES, EPOCHS, SLOTS = 12, 2, 4


@pytest.fixture(scope="session")
def fake_lib(tmp_path_factory) -> Path:
    try:
        return fakecuda.build(tmp_path_factory.mktemp("fakecuda"))
    except fakecuda.NoCompiler as e:
        pytest.skip(f"no C compiler for the CUDA test double: {e}")


@pytest.fixture
def gpu_env(fake_lib, tmp_path):
    """Environment of processes on the double, with a call log; checks no leftovers."""
    with fakecuda.checked_env(fake_lib, tmp_path / "cuda.log",
                              FAKECUDA_OP_DELAY_US="200") as env:
        yield env


def _run(procs, name, env, *, producer=(), consumers=((),), epochs=EPOCHS, cenv=None):
    """Start a producer and consumers on the double; return (producer, [consumers])."""
    p = procs.start("producer", "--name", name, "--epochs", str(epochs), "--batches",
                    str(BATCHES), "--slots", str(SLOTS), "--min-consumers",
                    str(len(consumers)), *producer, env=env)
    procs.wait_ready(p)
    cs = [procs.start("consumer", "--name", name, "--epochs", str(epochs), *args,
                      env={**env, **(cenv or {})}) for args in consumers]
    results = [procs.result(c) for c in cs]
    return procs.result(p), results


def _expected(epochs=EPOCHS):
    return [[e * 1000 + b for b in range(BATCHES)] for e in range(epochs)]


def test_gpu_ring_protocol(procs, name, gpu_env):
    """One copy per batch for all consumers; memory handles exported and opened once per
    slot; each copy waited for before its slot is published (so a consumer waits on no
    event of the producer's); no slot reused under a consumer's kernel."""
    prod, (slow, fast) = _run(
        procs, name, gpu_env, producer=("--device", "cuda:0"),
        consumers=(("--gpu-double", "--kernel-delay-us", "3000"), ("--gpu-double",)))
    assert prod["stats"]["device"] == "cuda:0" and prod["warnings"] == []
    for r in (slow, fast):
        assert r["errors"] == [] and r["epochs"] == _expected()
        assert r["stats"]["device"] == "cuda:0" and r["stats"]["zero_copy_gpu"] is True
        assert r["ring_info"]["device_type"] == 2
    # The slow consumer's kernels read each slot well after it dropped the batch: a slot
    # handed back before they ran would have been overwritten under them.
    assert slow["kernel_reads"] == BATCHES * EPOCHS * 2  # mixed batches: 2 torch tensors
    assert slow["kernel_mismatches"] == 0

    log = fakecuda.parse_log(gpu_env["FAKECUDA_LOG"])
    ppid = int(prod_pid(log, "ipc_get_mem"))
    ops = Counter((line.pid == ppid, line.op) for line in log)
    # Exported once per slot, by the producer; no interprocess event at all.
    assert ops[(True, "ipc_get_mem")] == SLOTS and ops[(True, "ipc_get_event")] == 0
    # One host-to-device copy per batch, whatever the number of consumers.
    assert ops[(True, "htod")] == BATCHES * EPOCHS
    assert ops[(False, "htod")] == 0
    # Every consumer opens every handle exactly once (never cached re-opens).
    opens = [line for line in log if line.op == "ipc_open_mem"]
    per_consumer = Counter(line.pid for line in opens)
    assert sorted(per_consumer.values()) == [SLOTS, SLOTS]
    assert all(line["cached"] == "0" for line in opens)
    assert [line for line in log if line.op in ("ipc_open_event", "stream_wait_event")] == []
    # Publish order: every copy's event is waited for by the producer before the next
    # operation of its (a publish returns only once the batch is on the device).
    records = [line for line in log if line.op == "event_record" and line.pid == ppid]
    syncs = {(line["ev"], line["gen"]) for line in log
             if line.op == "event_sync" and line.pid == ppid}
    assert len(records) == (BATCHES + 1) * EPOCHS  # the batches and the ends of epochs
    assert all((line["ev"], line["gen"]) in syncs for line in records)
    # The consumers' releases: events recorded on their own stream, no context-wide call.
    assert [line for line in log if line.op in ("ctx_record_event", "ctx_sync")] == []
    assert [line for line in log if line.op == "fail"] == []


def test_all_tensor_batches_are_exported_in_one_call(procs, name, gpu_env):
    """A batch of torch tensors only is exported with one Slot.capsules call on the
    consumer's stream, which makes no driver call (no wait: the batch was whole before it
    was published), and still no slot is reused under a kernel."""
    prod, (c,) = _run(
        procs, name, gpu_env, producer=("--device", "cuda:0", "--kind", "tuple"),
        consumers=(("--gpu-double", "--kernel-delay-us", "3000", "--kind", "tuple"),))
    assert prod["stats"]["device"] == "cuda:0" and prod["warnings"] == []
    assert c["errors"] == [] and c["epochs"] == _expected()
    assert c["stats"]["zero_copy_gpu"] is True
    assert c["batch_exports"] == BATCHES * EPOCHS
    assert c["kernel_reads"] == BATCHES * EPOCHS * 2 and c["kernel_mismatches"] == 0
    log = fakecuda.parse_log(gpu_env["FAKECUDA_LOG"])
    assert [line for line in log if line.op == "stream_wait_event"] == []
    assert [line for line in log if line.op == "fail"] == []


def prod_pid(log, op):
    """The pid of the process that performed op (the producer's exports)."""
    pids = {line.pid for line in log if line.op == op}
    assert len(pids) == 1, pids
    return pids.pop()


@pytest.mark.parametrize("fault,expect", [
    ({"FAKECUDA_MIG": "1"}, "CUDA IPC is not supported on GPU 0"),
    ({"TENSORSOCKET_LIBCUDA": "/nonexistent/libcuda.so.1"}, "could not be loaded"),
    ({"FAKECUDA_FAIL_INIT": "1"}, "cuInit failed"),
    ({"FAKECUDA_COMPUTE_MODE": "3"}, "compute mode EXCLUSIVE_PROCESS"),
    ({"FAKECUDA_COMPUTE_MODE": "2"}, "compute mode PROHIBITED"),
    # any driver call that fails while the pool is set up
    ({"FAKECUDA_FAIL_OP": "stream_create"}, "cuStreamCreate: CUDA_ERROR_NOT_SUPPORTED"),
    ({"FAKECUDA_FAIL_OP": "ctx_retain"}, "cuDevicePrimaryCtxRetain: CUDA_ERROR_NOT_SUPPORTED"),
])
def test_producer_falls_back_to_host(procs, name, gpu_env, fault, expect):
    """Where CUDA IPC cannot work the producer warns why and serves a host ring."""
    env = {**gpu_env, **fault}
    prod, (c,) = _run(procs, name, env, producer=("--device", "cuda:0"), consumers=((),))
    assert prod["stats"]["device"] == "cpu"
    assert len(prod["warnings"]) == 1 and "GPUFallbackWarning" in prod["warnings"][0]
    assert expect in prod["warnings"][0]
    assert c["errors"] == [] and c["epochs"] == _expected() and c["zero_copy"] is True
    assert c["stats"]["device"] == "cpu" and c["warnings"] == []


def test_producer_without_fallback_raises(procs, name, gpu_env):
    """device_fallback=False: GPUUnavailable names the cause and the knob."""
    p = procs.start("producer", "--name", name, "--device", "cuda:0", "--no-fallback",
                    "--min-consumers", "1", env={**gpu_env, "FAKECUDA_MIG": "1"})
    procs.wait_ready(p)
    c = procs.start("consumer", "--name", name, env=gpu_env)
    out, err = p.communicate(timeout=60)
    assert p.returncode != 0
    assert "GPUUnavailable" in err and "MIG" in err and "device_fallback=True" in err
    c.kill()
    c.communicate(timeout=10)


@pytest.mark.parametrize("fault,expect", [
    ({"FAKECUDA_FAIL_INIT": "1"}, "cuInit failed"),
    # any driver call that fails while the consumer opens the ring
    ({"FAKECUDA_FAIL_OP": "ipc_open_mem", "FAKECUDA_FAIL_CODE": "999"},
     "cuIpcOpenMemHandle of a ring slot: CUDA_ERROR_UNKNOWN"),
    ({"FAKECUDA_FAIL_OP": "ctx_retain"}, "cuDevicePrimaryCtxRetain: CUDA_ERROR_NOT_SUPPORTED"),
])
def test_consumer_that_cannot_open_the_ring_falls_back(procs, name, gpu_env, fault, expect):
    """A consumer that cannot open the GPU ring warns why and reads the host copy; what
    it had opened is closed again (the gpu_env fixture checks nothing is left)."""
    prod, (c,) = _run(procs, name, gpu_env, producer=("--device", "cuda:0"),
                      consumers=((),), cenv=fault)
    assert prod["stats"]["device"] == "cuda:0"
    assert c["errors"] == [] and c["epochs"] == _expected() and c["zero_copy"] is True
    assert c["stats"]["device"] == "cpu" and c["stats"]["zero_copy_gpu"] is False
    assert expect in c["stats"]["device_fallback_reason"]
    assert any("GPUFallbackWarning" in w for w in c["warnings"])


def test_driver_initialised_before_fork(fake_lib):
    """A process forked after the driver was initialised cannot use it: GPU rings and
    gpu_status() in the child say so, and share() refuses to fork a producer."""
    import sys

    script = r"""
import json, os, sys
import torch
from tensorsocket import _core, gpu_status, share
before = _core.cuda_loaded()
assert gpu_status()["available"], gpu_status()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    out = {"loaded": _core.cuda_loaded(), "status": gpu_status()["reason"]}
    try:
        _core.Ring.create("/tensorsocket-forktest-%d" % os.getpid(), 2, 4096, 2, device=0)
        out["create"] = "created"
    except Exception as e:
        out["create"] = f"{type(e).__name__}: {e}"
    os.write(w, json.dumps(out).encode())
    os._exit(0)
os.close(w)
child = json.loads(os.read(r, 65536))
os.waitpid(pid, 0)
try:
    share([torch.zeros(1)], name="forktest")
    refused = ""
except RuntimeError as e:
    refused = str(e)
print(json.dumps({"before": before, "child": child, "refused": refused}))
"""
    env = {**os.environ, "TENSORSOCKET_LIBCUDA": str(fake_lib)}
    out = run_python([sys.executable, "-c", script], capture_output=True, text=True,
                     env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["before"] is False
    assert r["child"]["loaded"] is True
    assert "which forked this one" in r["child"]["status"]
    assert r["child"]["create"].startswith("GPUUnavailable: the CUDA driver was initialised")
    assert "CUDA is already initialised in this process by tensorsocket" in r["refused"]


def test_cpu_consumer_on_gpu_ring(procs, name, gpu_env):
    """device='cpu' reads the ring's host copy and never opens the device memory."""
    prod, (c,) = _run(procs, name, gpu_env, producer=("--device", "cuda:0"),
                      consumers=(("--device", "cpu"),))
    assert c["errors"] == [] and c["epochs"] == _expected() and c["zero_copy"] is True
    assert c["stats"]["device"] == "cpu"
    log = fakecuda.parse_log(gpu_env["FAKECUDA_LOG"])
    assert [line for line in log if line.op in ("ipc_open_mem", "ipc_open_event")] == []


def test_consumer_finds_the_pool_by_uuid(procs, name, gpu_env):
    """Device ordinals differ between processes (CUDA_VISIBLE_DEVICES): the consumer
    finds the producer's GPU by UUID and opens the pool without peer access."""
    env = {**gpu_env, "FAKECUDA_DEVICES": "2"}
    prod, (c,) = _run(procs, name, env, producer=("--device", "cuda:1"),
                      consumers=(("--gpu-double",),), cenv={"FAKECUDA_VISIBLE": "1,0"})
    assert prod["stats"]["device"] == "cuda:1"
    assert c["errors"] == [] and c["epochs"] == _expected()
    assert c["stats"]["device"] == "cuda:0"  # physical GPU 1 is ordinal 0 over there
    log = fakecuda.parse_log(env["FAKECUDA_LOG"])
    opens = [line for line in log if line.op == "ipc_open_mem"]
    assert len(opens) == SLOTS and all(line["peer"] == "0" for line in opens)


def test_consumer_on_another_gpu_uses_peer_access(procs, name, gpu_env):
    """device='cuda:N' on another GPU than the pool's opens it with lazy peer access."""
    env = {**gpu_env, "FAKECUDA_DEVICES": "2"}
    prod, (c,) = _run(procs, name, env, producer=("--device", "cuda:0"),
                      consumers=(("--gpu-double", "--device", "cuda:1"),))
    assert c["errors"] == [] and c["epochs"] == _expected()
    assert c["stats"]["device"] == "cuda:1" and c["stats"]["zero_copy_gpu"] is True
    log = fakecuda.parse_log(env["FAKECUDA_LOG"])
    opens = [line for line in log if line.op == "ipc_open_mem"]
    assert len(opens) == SLOTS and all(line["peer"] == "1" for line in opens)


def test_device_cuda_is_torchs_current_gpu(procs, name, gpu_env):
    """device='cuda' names torch's current GPU, as torch reads it (a DDP rank that called
    torch.cuda.set_device(1)), not GPU 0: a pool on GPU 1 is read in place there."""
    env = {**gpu_env, "FAKECUDA_DEVICES": "2"}
    prod, (c,) = _run(procs, name, env, producer=("--device", "cuda:1"),
                      consumers=(("--gpu-double", "--device", "cuda", "--current-device", "1"),))
    assert c["errors"] == [] and c["epochs"] == _expected()
    assert c["stats"]["device"] == "cuda:1" and c["stats"]["zero_copy_gpu"] is True
    log = fakecuda.parse_log(env["FAKECUDA_LOG"])
    opens = [line for line in log if line.op == "ipc_open_mem"]
    assert len(opens) == SLOTS and all(line["peer"] == "0" for line in opens), opens[:1]


def test_pin_memory_registers_the_host_mapping_read_only(procs, name, gpu_env):
    """pin_memory=True page-locks the consumer's read-only mapping of a host ring."""
    prod, (c,) = _run(procs, name, gpu_env, consumers=(("--pin-memory", "--device", "cpu"),))
    assert c["errors"] == [] and c["epochs"] == _expected()
    log = fakecuda.parse_log(gpu_env["FAKECUDA_LOG"])
    regs = [line for line in log if line.op == "host_register"]
    assert len(regs) == 1 and int(regs[0]["flags"], 0) & 0x8  # READ_ONLY
    assert len([line for line in log if line.op == "host_unregister"]) == 1


PINNED_IN_PLACE = r"""
import sys
from tensorsocket import TensorConsumer
c = TensorConsumer(name=sys.argv[1], timeout=30, pin_memory=True, device="cpu")
x, y = next(iter(c))
print("received", c.ring.info()["host_writable"], flush=True)
x.div_(255)
print("written", flush=True)
"""


@pytest.mark.filterwarnings("ignore:the producer finished in the middle")  # a late joiner
def test_in_place_write_on_a_pinned_host_ring_still_stops(procs, name, gpu_env):
    """pin_memory=True page-locks the consumer's host mapping for CUDA, and remapping a slot
    private would break the registration: there, an in-place op on a batch is still stopped
    with SIGSEGV, after a line naming the cause. The other consumers lose nothing."""
    import signal
    import sys

    from tensorsocket import TensorConsumer

    # Slow enough that the producer still runs when the second consumer comes.
    p = procs.start("producer", "--name", name, "--kind", "tuple", "--batches", "6",
                    "--delay", "0.5", env=gpu_env)
    procs.wait_ready(p)
    proc = popen([sys.executable, "-c", PINNED_IN_PLACE, name],
                 env={**os.environ, **gpu_env}, stdout=PIPE, stderr=PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    fakecuda.cleanup_shm(proc.pid)  # a crashed process cannot free its context
    assert out.split() == ["received", "0"], err  # host views are not writable here
    if os.environ.get("TENSORSOCKET_SANITIZE") != "1":  # ASan reports the fault its own way
        assert proc.returncode == -signal.SIGSEGV, (proc.returncode, err)
    else:
        assert proc.returncode != 0
    assert "tensorsocket: this process wrote into a batch tensor" in err, err
    assert "page-locked for CUDA (pin_memory=True)" in err
    log = fakecuda.parse_log(gpu_env["FAKECUDA_LOG"])
    assert len([line for line in log if line.op == "host_register"]) == 1
    with TensorConsumer(name=name, timeout=30, align_epochs=False) as c:
        values = [int(x[0, 0]) for x, _ in c]
    assert values[-1] == 5 and all(v == i + (6 - len(values)) for i, v in enumerate(values))
    procs.result(p)


def test_killed_gpu_consumer_does_not_block_the_other(procs, name, gpu_env):
    """A SIGKILLed consumer holding a GPU batch is evicted; the other one finishes."""
    p = procs.start("producer", "--name", name, "--epochs", "1", "--batches", "30",
                    "--slots", str(SLOTS), "--min-consumers", "2", "--device", "cuda:0",
                    env=gpu_env)
    procs.wait_ready(p)
    stuck = procs.start("consumer", "--name", name, "--gpu-double", "--stall-after", "2",
                        env=gpu_env)
    other = procs.start("consumer", "--name", name, "--gpu-double", env=gpu_env)
    line = stuck.stdout.readline()
    assert '"stalled"' in line, line + stuck.stderr.read()
    stuck.kill()
    stuck.communicate(timeout=10)
    r = procs.result(other, timeout=60)
    assert r["errors"] == [] and r["epochs"] == [list(range(30))]
    assert procs.result(p, timeout=60)["drained"] is True
    fakecuda.cleanup_shm(stuck.pid)  # a killed process cannot free its events


def test_producer_frees_the_pool_after_consumers_unmap_it(procs, name, gpu_env):
    """The producer frees device memory only once every consumer closed its mapping."""
    prod, (c,) = _run(procs, name, gpu_env, producer=("--device", "cuda:0"),
                      consumers=(("--gpu-double", "--linger", "1.5"),), epochs=1)
    assert c["errors"] == [] and c["epochs"] == _expected(1)
    log = fakecuda.parse_log(gpu_env["FAKECUDA_LOG"])
    ppid = prod_pid(log, "ipc_get_mem")
    order = [(line.pid == ppid, line.op) for line in log]
    frees = [i for i, (mine, op) in enumerate(order) if mine and op == "free"]
    closes = [i for i, (mine, op) in enumerate(order) if not mine and op == "ipc_close_mem"]
    assert len(frees) == SLOTS and len(closes) == SLOTS
    assert max(closes) < min(frees)
