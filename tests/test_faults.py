"""Faults in real processes: SIGKILL and SIGSTOP of either role, /dev/shm too small,
random kills. Each test adds a row to the fault table (what was done, how long detection
took, what the survivors saw, what was left behind); `python -m pytest tests/test_faults.py
--fault-table docs/faults.md` writes it."""

from __future__ import annotations

import os
import random
import signal
import socket
import time

import pytest
import torch
import zmq

from conftest import shm_segments
from tensorsocket import SharedMemoryTooSmall, TensorProducer
from tensorsocket import _core, protocol
from tensorsocket.endpoints import resolve, runtime_dir


def _batches(epoch: int, start: int, stop: int) -> list[int]:
    return [epoch * 1000 + b for b in range(start, stop)]


def _ring_of(name: str, producer_pid: int, timeout: float = 60):
    """A watcher's handle on a producer's ring (never bound to a consumer entry); the
    producer creates the ring with its first batch, so wait for it."""
    segment = resolve(name, None, None).segment_name(producer_pid)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _core.Ring.open(segment)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until(predicate, timeout: float, step: float = 0.01) -> float:
    """Seconds until predicate() held; fails after timeout."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(step)
    return time.monotonic() - t0


def _wait_for_delivery(name: str, producer_pid: int, consumer_pid: int) -> None:
    """Until the consumer process took its first batch (it attached and reads)."""
    ring = _ring_of(name, producer_pid)
    try:
        _wait_until(lambda: any(c["pid"] == consumer_pid and c["delivered"] >= 1
                                for c in ring.consumers()), 60)
    finally:
        ring.close()


def _left_behind(name: str) -> str:
    """What of producer `name` is left in /dev/shm and the runtime directory."""
    files = sorted(p.name for p in runtime_dir().glob(name + ".*"))
    left = shm_segments(name) + files
    return ", ".join(left) if left else "nothing"


def test_consumer_sigkilled_holding_a_batch(procs, name, fault_table):
    prod = procs.start("producer", "--name", name, "--batches", "60", "--kind", "tuple",
                       "--min-consumers", "2")
    pid = procs.wait_ready(prod)["pid"]
    victim = procs.start("consumer", "--name", name, "--kind", "tuple", "--stall-after", "3")
    survivor = procs.start("consumer", "--name", name, "--kind", "tuple", "--delay", "0.01")
    procs.wait_ready(victim)  # it holds batch 2 and hangs
    ring = _ring_of(name, pid)
    try:
        assert any(c["pid"] == victim.pid for c in ring.consumers())
        victim.kill()
        took = _wait_until(lambda: all(c["pid"] != victim.pid for c in ring.consumers()), 3.0)
    finally:
        ring.close()
    r = procs.result(survivor)
    assert r["errors"] == [] and r["epochs"] == [_batches(0, 0, 60)]
    assert procs.result(prod)["drained"] is True
    left = _left_behind(name)
    assert left == "nothing"
    fault_table.add("consumer SIGKILLed while holding a batch",
                    f"{took:.2f} s (entry evicted, its slots released)",
                    "every batch once, in order", left)


def test_consumer_sigstopped_is_detached_by_the_lag_policy(procs, name, fault_table):
    prod = procs.start("producer", "--name", name, "--batches", "80", "--kind", "tuple",
                       "--min-consumers", "2", "--max-lag", "4", "--window", "0")
    pid = procs.wait_ready(prod)["pid"]
    stopped = procs.start("consumer", "--name", name, "--kind", "tuple", "--delay", "0.01")
    survivor = procs.start("consumer", "--name", name, "--kind", "tuple", "--delay", "0.01")
    ring = _ring_of(name, pid)
    try:
        _wait_until(lambda: any(c["pid"] == stopped.pid and c["delivered"] >= 3
                                for c in ring.consumers()), 30)
        os.kill(stopped.pid, signal.SIGSTOP)
        took = _wait_until(lambda: any(c["pid"] == stopped.pid and
                                       c["state"] == _core.CONSUMER_DETACHED
                                       for c in ring.consumers()), 5.0)
    finally:
        ring.close()
        os.kill(stopped.pid, signal.SIGCONT)
    r = procs.result(survivor)
    assert r["errors"] == [] and r["epochs"] == [_batches(0, 0, 80)]
    s = procs.result(stopped)
    assert s["outcome"].startswith("ConsumerDetached") and "max_lag=4" in s["outcome"]
    procs.result(prod)
    left = _left_behind(name)
    assert left == "nothing"
    fault_table.add("consumer SIGSTOPped (max_lag=4)",
                    f"{took:.2f} s (detached once 4 batches behind the other)",
                    "every batch once, in order; the stopped one gets ConsumerDetached "
                    "on SIGCONT", left)


def test_consumer_sigstopped_without_max_lag_is_evicted(procs, name, fault_table):
    """Lossless (no max_lag): a stopped consumer's heartbeats stop, and after
    heartbeat_timeout it is evicted, so the others stop waiting for it."""
    env = {"TENSORSOCKET_HEARTBEAT_TIMEOUT": "3"}
    prod = procs.start("producer", "--name", name, "--batches", "80", "--kind", "tuple",
                       "--min-consumers", "2", env=env)
    pid = procs.wait_ready(prod)["pid"]
    stopped = procs.start("consumer", "--name", name, "--kind", "tuple", "--delay", "0.01")
    survivor = procs.start("consumer", "--name", name, "--kind", "tuple", "--delay", "0.01")
    ring = _ring_of(name, pid)
    try:
        _wait_until(lambda: any(c["pid"] == stopped.pid and c["delivered"] >= 3
                                for c in ring.consumers()), 30)
        os.kill(stopped.pid, signal.SIGSTOP)
        took = _wait_until(lambda: all(c["pid"] != stopped.pid for c in ring.consumers()),
                           30)
    finally:
        ring.close()
        os.kill(stopped.pid, signal.SIGCONT)
    r = procs.result(survivor)
    assert r["errors"] == [] and r["epochs"] == [_batches(0, 0, 80)]
    s = procs.result(stopped)
    assert s["outcome"].startswith("ConsumerDetached") and \
        "heartbeat_timeout" in s["outcome"], s["outcome"]
    procs.result(prod)
    left = _left_behind(name)
    assert left == "nothing"
    fault_table.add("consumer SIGSTOPped (no max_lag, heartbeat_timeout=3)",
                    f"{took:.2f} s (evicted: no heartbeat for heartbeat_timeout; its slots "
                    "released)",
                    "every batch once, in order, after a pause; the stopped one gets "
                    "ConsumerDetached naming heartbeat_timeout on SIGCONT", left)


def test_producer_sigstopped_longer_than_heartbeat_timeout(procs, name, fault_table):
    """The producer's own pause is no silence of its consumers: their heartbeats wait in
    the socket while it is stopped, and none is evicted when it runs again."""
    env = {"TENSORSOCKET_HEARTBEAT_TIMEOUT": "3"}
    prod = procs.start("producer", "--name", name, "--batches", "60", "--kind", "tuple",
                       "--min-consumers", "2", env=env)
    pid = procs.wait_ready(prod)["pid"]
    cons = [procs.start("consumer", "--name", name, "--kind", "tuple", "--delay", "0.01")
            for _ in range(2)]
    ring = _ring_of(name, pid)
    try:
        _wait_until(lambda: sum(c["delivered"] >= 3 for c in ring.consumers()) == 2, 30)
        os.kill(pid, signal.SIGSTOP)
        stop_end = time.monotonic() + 5  # longer than heartbeat_timeout
        try:
            while time.monotonic() < stop_end:
                time.sleep(0.1)
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        ring.close()
    for c in cons:
        r = procs.result(c)
        assert r["outcome"] == "done" and r["errors"] == [], r["outcome"]
        assert r["epochs"] == [_batches(0, 0, 60)]
    procs.result(prod)
    left = _left_behind(name)
    assert left == "nothing"
    fault_table.add("producer SIGSTOPped for 5 s (heartbeat_timeout=3)",
                    "- (no consumer is evicted: the producer's own pause is no silence of "
                    "theirs)", "every batch once, in order, after the pause", left)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_forged_hello_is_refused(procs, name, fault_table, transport):
    """A hello as pid 1 (alive for ever, so never evicted as dead), then ready: over TCP
    another local user can connect, but has no secret; over ipc:// only this user can,
    and the kernel says which process it is. Refused, it learns nothing, and the real
    consumer reads every batch from the first (it used to join late behind a consumer
    that never reads, and everything hung for good)."""
    if transport == "tcp":
        port = _free_port()
        where, address = ["--port", str(port)], f"tcp://127.0.0.1:{port}"
        owner = f"port{port}"
    else:
        where, address, owner = ["--name", name], resolve(name, None, None).address, name
    prod = procs.start("producer", *where, "--batches", "20", "--kind", "tuple")
    procs.wait_ready(prod)
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 30000)
    s.connect(address)
    try:
        hello = dict(protocol=protocol.PROTOCOL_VERSION, pid=1,
                     start_time=_core.process_start_time(1), batch_size=None, group=None,
                     rank=0, world_size=1)
        for field in protocol.SCHEMAS["hello"]:  # the secret: another user has none
            hello.setdefault(field, None)
        t0 = time.monotonic()
        s.send(protocol.encode("hello", **hello))
        reply = protocol.decode(s.recv())
        took = time.monotonic() - t0
        if reply["type"] == "welcome":  # hijacked: the forger is consumer 0, and ready
            s.send(protocol.encode("ready", consumer=reply["consumer"], token=reply["token"],
                                   align=False))
            assert protocol.decode(s.recv())["type"] == "started"
        cons = procs.start("consumer", *where, "--kind", "tuple")
        r = procs.result(cons, timeout=60)
    finally:
        s.close(0)
    assert r["errors"] == [] and r["epochs"] == [_batches(0, 0, 20)], r
    assert reply["type"] == "error" and reply["code"] == "auth", reply
    assert "tensorsocket-" not in reply["message"]
    assert ("secret" if transport == "tcp" else "pid 1") in reply["message"], reply
    assert procs.result(prod)["stats"]["rejected_messages"] == 1
    left = _left_behind(owner)
    assert left == "nothing"
    if transport == "tcp":
        fault, why = "another local user's hello as pid 1 on a TCP port (then ready)", \
            "no secret"
    else:
        fault, why = "a hello as pid 1 over ipc:// (then ready)", \
            "the kernel's peer credentials name another pid"
    fault_table.add(fault, f"{took:.2f} s (refused at hello: {why}; nothing of the producer "
                    "revealed)", "every batch once, in order, from batch 0", left)


def _kill_producer_after_first_delivery(procs, name: str, *consumer_args: str,
                                       settle: float) -> tuple[dict, float]:
    """SIGKILL a producer (which sleeps after its first batch) `settle` s after a consumer
    took that batch: (the consumer's result, seconds from the kill to its exception)."""
    prod = procs.start("producer", "--name", name, "--batches", "5", "--kind", "tuple",
                       "--delay", "3600")
    pid = procs.wait_ready(prod)["pid"]
    c = procs.start("consumer", "--name", name, "--kind", "tuple", *consumer_args)
    _wait_for_delivery(name, pid, c.pid)
    time.sleep(settle)
    t0 = time.monotonic()
    prod.kill()
    r = procs.result(c)
    return r, r["ended_at"] - t0


def test_producer_sigkilled_while_a_consumer_waits(procs, name, fault_table):
    # The producer publishes batch 0, then sleeps; the consumer waits for batch 1.
    r, took = _kill_producer_after_first_delivery(procs, name, settle=0.2)
    assert r["outcome"].startswith("ProducerGone") and took < 5.0
    assert r["epochs"] == [] or r["epochs"][0][:1] == [0]
    # A new producer of the same name starts at once.
    t1 = time.monotonic()
    again = procs.start("producer", "--name", name, "--batches", "1", "--min-consumers", "0")
    procs.wait_ready(again)
    restart = time.monotonic() - t1
    procs.result(again)
    left = _left_behind(name)
    assert left == "nothing"
    fault_table.add("producer SIGKILLed while a consumer waits for a batch",
                    f"{took:.2f} s (ProducerGone raised)",
                    f"ProducerGone; a new producer of the name was ready {restart:.2f} s "
                    "after being started", left)


def test_producer_sigkilled_while_a_consumer_holds_a_batch(procs, name, fault_table):
    # The consumer holds each batch for 2 s ("training"), then asks for the next.
    r, took = _kill_producer_after_first_delivery(procs, name, "--hold", "--delay", "2",
                                                  settle=0.5)
    assert r["outcome"].startswith("ProducerGone") and took < 5.0
    assert r["errors"] == []  # the batch it held stayed valid while the producer died
    left = _left_behind(name)
    # The consumer, last party out, removed the segment; the dead producer's socket and
    # lock files wait for the next producer of the name, which reuses them.
    assert shm_segments(name) == []
    fault_table.add("producer SIGKILLed while a consumer holds a batch",
                    f"{took:.2f} s (at its next batch request, after its 2 s step)",
                    "the held batch stays valid; ProducerGone at the next request", left)


def test_shm_too_small_fails_at_start_naming_the_knob(name, fault_table):
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    loader = [torch.zeros(4)]
    p = TensorProducer(loader, name=name, min_consumers=0, slot_bytes=free // 2 + (1 << 30))
    t0 = time.monotonic()
    with pytest.raises(SharedMemoryTooSmall) as e:
        for _ in p:
            pass
    took = time.monotonic() - t0
    msg = str(e.value)
    assert "slot_bytes=" in msg and "ring_slots=" in msg and "--shm-size" in msg
    assert "needs" in msg or "bytes" in msg
    assert shm_segments(name) == []
    p.close()
    left = _left_behind(name)
    assert left == "nothing"
    fault_table.add("/dev/shm smaller than the ring",
                    f"{took:.2f} s (SharedMemoryTooSmall before the first batch)",
                    "an error naming the size and slot_bytes= / ring_slots= / --shm-size",
                    left)


@pytest.mark.parametrize("seed", range(4))
def test_random_kills_leave_nothing_behind(procs, name, fault_table, seed):
    """Kill a random role at a random point; then the next producer of the name starts,
    and once everyone is gone nothing of the name is left."""
    rng = random.Random(seed)
    prod = procs.start("producer", "--name", name, "--batches", "200", "--kind", "tuple",
                       "--epochs", "2", "--min-consumers", "1", "--delay", "0.002")
    procs.wait_ready(prod)
    # A consumer still starting when the producer dies gives up after --timeout.
    cons = [procs.start("consumer", "--name", name, "--kind", "tuple", "--epochs", "2",
                        "--timeout", "3") for _ in range(2)]
    time.sleep(rng.uniform(0.2, 1.0))
    victim = rng.choice([prod, *cons])
    victim.kill()
    victim.wait()
    survivors = [p for p in [prod, *cons] if p is not victim]
    for p in survivors:
        try:
            p.communicate(timeout=60)
        except Exception:
            p.kill()
            raise
    # The next producer of the name sweeps whatever a dead producer left.
    again = procs.start("producer", "--name", name, "--batches", "1", "--min-consumers", "0")
    procs.wait_ready(again)
    procs.result(again)
    left = _left_behind(name)
    assert left == "nothing", left
    role = "producer" if victim is prod else "consumer"
    fault_table.add(f"random SIGKILL (seed {seed}): the {role}", "-",
                    "the others end (finish, or ProducerGone)", left)


def test_consumer_process_fds_return_to_baseline_after_producer_crash(procs, name):
    """A consumer that outlives a SIGKILLed producer gives back every fd on close(), and
    it removes the dead producer's segment (last party out)."""
    from tensorsocket import ProducerGone, TensorConsumer

    fd_dir = "/proc/self/fd"
    prod = procs.start("producer", "--name", name, "--batches", "5", "--kind", "tuple",
                       "--delay", "3600")
    procs.wait_ready(prod)
    before = len(os.listdir(fd_dir))
    c = TensorConsumer(name=name, timeout=30)
    it = iter(c)
    next(it)
    prod.kill()
    prod.wait()
    with pytest.raises(ProducerGone):
        next(it)
    del it
    c.close()
    time.sleep(0.2)  # zmq's I/O thread closes its sockets asynchronously
    assert len(os.listdir(fd_dir)) <= before
    assert shm_segments(name) == []
