"""A consumer's GPU state on the CUDA driver double (issue 23 review findings 2 and 4).

Real producer and consumer processes over real shared memory, on the double
(csrc/tests/fake_cuda.c, see tests/test_gpu.py): which GPU a pinned host ring is
page-locked for, and a slot let go by one thread while another waits for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import fakecuda
from test_gpu import fake_lib, gpu_env  # noqa: F401  (fixtures)

TESTS = str(Path(__file__).resolve().parent)


def test_pinned_for_the_current_gpu(procs, name, gpu_env):  # noqa: F811
    """pin_memory=True without a CUDA device (device="cpu"; a DDP rank that called
    torch.cuda.set_device(1)) page-locks the host ring for torch's current GPU, as
    DataLoader(pin_memory=True) does, not for GPU 0: its releases are then ordered after
    the work of the GPU its copies go to."""
    env = {**gpu_env, "FAKECUDA_DEVICES": "2"}
    p = procs.start("producer", "--name", name, "--kind", "tuple", "--batches", "6",
                    "--slots", "2", env=env)
    procs.wait_ready(p)
    c = procs.start("consumer", "--name", name, "--kind", "tuple", "--pin-memory",
                    "--device", "cpu", "--current-device", "1", env=env)
    r = procs.result(c)
    procs.result(p)
    assert r["errors"] == [] and r["epochs"] == [list(range(6))]
    log = fakecuda.parse_log(gpu_env["FAKECUDA_LOG"])
    retained = {line["dev"] for line in fakecuda.select(log, "ctx_retain")}
    assert retained == {"1"}, f"pinned through GPU(s) {sorted(retained)}, not the current 1"
    assert len(fakecuda.select(log, "host_register")) == 1
    # Torch never used CUDA in this consumer (no current stream to name): the releases
    # wait for GPU 1's legacy default stream.
    assert fakecuda.select(log, "event_record", stream="default1"), \
        "no release was ordered on GPU 1"
    assert fakecuda.select(log, "ctx_record_event") == []


PREFETCH = r'''
import os, sys, threading
sys.path.insert(0, sys.argv[1])
import numpy as np
import fakecuda
import tensorsocket.data.delivery as delivery
from tensorsocket import TensorConsumer
from tools.harness import emit

tests, name, scenario, batch_timeout = sys.argv[1:5]
gpu = scenario == "gpu"
if gpu:
    fc = fakecuda.FakeCuda(os.environ["TENSORSOCKET_LIBCUDA"])
    fc.setup(0)
    cur = fc.stream_create(1)
    fakecuda.deliver_device_tensors(delivery, cur)


def value(batch):
    if gpu:
        x = batch[0]
        fc.stream_synchronize(cur)
        return int(np.frombuffer(fc.read(x.ptr, x.nbytes), np.float32)[0])
    return int(batch[0][0, 0])


c = TensorConsumer(name=name, timeout=60, batch_timeout=float(batch_timeout),
                   device=None if gpu else "cpu", pin_memory=not gpu)
it = iter(c)
a = next(it)  # slot 0, which batch 2 needs
b = next(it)  # slot 1
out = {"first": [value(a), value(b)]}
waiting = threading.Event()
acquire_slot = c._acquirer.acquire_slot


def acquire_slot_after_the_flushes():
    waiting.set()  # past the flushes before the wait (next_batch, acquire)
    return acquire_slot()


c._acquirer.acquire_slot = acquire_slot_after_the_flushes


got = []


def prefetch():
    try:
        got.append(next(it))  # read in the main thread (its CUDA context is current)
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"


t = threading.Thread(target=prefetch)
t.start()
out["waited"] = waiting.wait(60)
del a  # the training loop is done with batch 0: its release is queued, not flushed
t.join()
out["third"] = value(got[0]) if got else None
emit(out)
del b, got
c.close()
'''


@pytest.mark.parametrize("scenario", ["gpu", "pinned"])
def test_slot_dropped_while_another_thread_waits(procs, name, gpu_env, scenario):  # noqa: F811
    """A prefetch thread waits in next() for the slot that the training loop's batch holds
    (a 2-slot ring, both slots held), and the loop then drops that batch: its release,
    deferred on a GPU consumer (GPU import, or pinned host slots) until a flush, is
    flushed during the wait and the batch arrives, rather than a TimeoutError after
    batch_timeout (or a hang without one)."""
    p = procs.start("producer", "--name", name, "--kind", "tuple", "--batches", "4",
                    "--slots", "2", *(("--device", "cuda:0") if scenario == "gpu" else ()),
                    env=gpu_env)
    procs.wait_ready(p)
    c = procs.script(PREFETCH, TESTS, name, scenario, "20", env=gpu_env)
    r = procs.result(c)
    assert r["first"] == [0, 1] and r["waited"]
    assert r.get("error") is None, r["error"]
    assert r["third"] == 2
    procs.result(p)


class _HostRing:
    """What Delivery asks of a host ring: its kind, page-locking, flushing."""

    def __init__(self) -> None:
        self.pinned_on: list = []
        self.flushes: list = []  # (wait_ms, stream) of each flush

    def info(self) -> dict:
        """A host ring's info (Ring.info()'s keys, as RingInfo reads them)."""
        from dataclasses import fields

        from tensorsocket.ring import DeviceType, RingInfo

        return {**{f.name: 0 for f in fields(RingInfo)}, "name": "", "device_uuid": "",
                "device_type": DeviceType.CPU}

    def pin_host(self, device: int) -> None:
        self.pinned_on.append(device)

    def flush_releases(self, wait_ms: int = 0, stream: int | None = None) -> None:
        self.flushes.append((wait_ms, stream))


def test_releases_follow_the_current_stream_of_the_pinned_gpu(monkeypatch):
    """A flush names torch's current stream on the GPU the host ring was page-locked for
    (torch's current device here, device="cpu"): the releases wait for the copies queued
    there (x.cuda(non_blocking=True) queues on the current stream); nothing is asked of the
    whole context, so a capture on any thread is left alone (issue 34)."""
    import torch

    from tensorsocket.data import delivery as delivery_module
    from tensorsocket.data.delivery import Delivery

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(delivery_module, "_raw_stream", lambda index: 0x7000 + index)
    ring = _HostRing()
    delivery = Delivery("cpu", copy=False, pin_memory=True, peer_access=True)
    delivery.attach(ring)
    assert ring.pinned_on == [1] and delivery.device == "cpu"
    delivery.flush_releases(ring)
    assert ring.flushes == [(0, 0x7001)]
    monkeypatch.setattr(delivery_module, "_raw_stream", lambda index: 0)  # legacy stream
    delivery.flush_releases(ring, 30)
    assert ring.flushes[-1] == (30, 1)
