"""A producer that fails says so: its consumers get ProducerFailed with the producer's
error, promptly, rather than a normal end (ProducerFinished) or, before the first batch,
a wait for their whole timeout ending in "start the producer" (ProducerNotFound). Real
producer processes; the consumer runs in the test process."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
import torch

from tensorsocket import (
    ProducerFailed,
    ProducerFinished,
    ProducerGone,
    TensorConsumer,
    TensorProducer,
)

# The producer script. Modes:
#   fail-first  the loader raises before its first batch, once a consumer said hello
#   empty       the loader yields nothing, once a consumer said hello
#   block       the loader never yields (the test kills the process)
#   fail-mid    the loader raises after 5 batches
#   stall       the loader never yields after 2 batches (the test kills the process)
#   loop-fail   the code that runs the producer raises after 5 batches, in a with block
#   stop-mid    the loader's generator lets a StopIteration out after 5 batches
# The process ends by its error, uncaught, as a script does.
PRODUCER = r"""
import sys, time, torch
from tensorsocket import TensorProducer

name, mode = sys.argv[1], sys.argv[2]
producer = None

def until(condition, what):
    deadline = time.monotonic() + 60
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)

def batches():
    if mode in ("fail-first", "empty"):
        until(lambda: producer._server._waiting, "no consumer said hello")
    if mode == "fail-first":
        print(f"raising at {time.monotonic()}", flush=True)  # CLOCK_MONOTONIC
        raise ValueError("no such file: /data/train.tar")
    if mode == "empty":
        return
    if mode == "block":
        until(lambda: False, "the test never killed the producer")
    for b in range(10):
        if mode == "stop-mid" and b == 5:
            next(iter([]))  # the user's line the error names
        if mode == "fail-mid" and b == 5:
            print(f"raising at {time.monotonic()}", flush=True)  # CLOCK_MONOTONIC
            raise RuntimeError("corrupt record in shard 5")
        if mode == "stall" and b == 2:
            until(lambda: False, "the test never killed the producer")
        yield torch.full((4,), b)

class Loader:
    def __iter__(self):
        return batches()

producer = TensorProducer(Loader(), name=name, min_consumers=1, start_timeout=60)
print("ready", flush=True)
if mode == "loop-fail":
    with producer:
        for i, _ in enumerate(producer):
            if i == 4:
                raise KeyError("label 7 has no class")
for _ in producer:
    pass
producer.join(timeout=60)
"""


def _start(procs, name: str, mode: str) -> subprocess.Popen:
    p = procs.script(PRODUCER, name, mode)
    line = p.stdout.readline()
    assert line == "ready\n", p.communicate(timeout=30)
    return p


def test_loader_error_before_the_first_batch_reaches_a_waiting_consumer(procs, name):
    """The loader raises before its first batch while a consumer waits for the ring: the
    consumer gets ProducerFailed with the error at once, not ProducerNotFound after its
    whole timeout."""
    prod = _start(procs, name, "fail-first")
    t0 = time.monotonic()
    with pytest.raises(ProducerFailed) as e:
        TensorConsumer(name=name, timeout=30)
    assert time.monotonic() - t0 < 20
    assert "failed before its first batch" in str(e.value)
    assert e.value.cause.startswith("ValueError: no such file: /data/train.tar (raised at ")
    assert "in batches)" in e.value.cause
    _, err = prod.communicate(timeout=60)
    assert prod.returncode == 1 and "ValueError: no such file" in err


def test_producer_closing_before_its_first_batch_ends_a_waiting_consumer(procs, name):
    """An empty loader: the producer closes without a batch; the consumer that waits is
    told so (ProducerFinished), not left to wait for its timeout."""
    prod = _start(procs, name, "empty")
    t0 = time.monotonic()
    with pytest.raises(ProducerFinished, match="closed before publishing its first batch"):
        TensorConsumer(name=name, timeout=30)
    assert time.monotonic() - t0 < 20
    prod.communicate(timeout=60)
    assert prod.returncode == 0


def test_producer_killed_before_its_first_batch(procs, name):
    """A producer that took its name and is killed before its first batch: the waiting
    consumer says so within a second or so, naming the pid, whether the kill came
    before or after the consumer started waiting."""
    prod = _start(procs, name, "block")
    raised: list[BaseException] = []

    def attach() -> None:
        try:
            TensorConsumer(name=name, timeout=60).close()
        except BaseException as e:
            raised.append(e)

    t0 = time.monotonic()
    waiter = threading.Thread(target=attach)
    waiter.start()
    prod.send_signal(signal.SIGKILL)
    prod.wait(30)
    waiter.join(30)
    assert not waiter.is_alive()
    assert time.monotonic() - t0 < 20  # its timeout is 60 s
    (e,) = raised
    assert isinstance(e, ProducerFailed), repr(e)
    assert f"(pid {prod.pid}) died before publishing its first batch" in str(e)
    assert e.cause is None


@pytest.mark.parametrize("mode, cause", [
    ("fail-mid", "RuntimeError: corrupt record in shard 5"),
    ("loop-fail", "KeyError: 'label 7 has no class'"),
    ("stop-mid", "RuntimeError: generator raised StopIteration"),
])
def test_failure_mid_run_is_no_normal_end(procs, name, mode, cause):
    """The loader, or the loop that runs the producer, raises after 5 batches: the
    consumer receives those 5, then ProducerFailed (a ProducerGone, not a
    ProducerFinished) with the producer's error. (When the producer's own loop raises,
    its epoch iterator is dropped first, which ends the epoch as a break does: the
    consumer's epoch ends after the 5 batches, and its next one raises.)"""
    prod = _start(procs, name, mode)
    epochs: list[list[int]] = []
    with TensorConsumer(name=name, timeout=30) as c:
        with pytest.raises(ProducerFailed) as e:
            while True:
                epochs.append([])
                for batch in c:
                    epochs[-1].append(int(batch[0]))
    assert epochs == ([[0, 1, 2, 3, 4]] if mode != "loop-fail" else [[0, 1, 2, 3, 4], []])
    assert not isinstance(e.value, ProducerFinished) and isinstance(e.value, ProducerGone)
    assert e.value.cause.startswith(cause + " (raised at ")
    assert f"failed: {cause}" in str(e.value) and "create a new TensorConsumer" in str(e.value)
    # Where the user's code raised it (the script's batches(), not our loop over it).
    assert e.value.cause.endswith(" in batches)" if mode != "loop-fail" else " in <module>)")
    assert "publisher.py" not in e.value.cause
    prod.communicate(timeout=60)
    assert prod.returncode == 1


def test_producer_killed_mid_run_is_a_failure_without_cause(procs, name):
    """A producer process killed mid-run: the consumer keeps the batches it has, then
    ProducerFailed (a ProducerGone; the cause is unknown) says to create a new one."""
    prod = _start(procs, name, "stall")
    with TensorConsumer(name=name, timeout=30) as c:
        it = iter(c)
        first, second = next(it), next(it)
        prod.kill()
        prod.wait(30)
        with pytest.raises(ProducerFailed) as e:
            next(it)
        assert int(first[0]) == 0 and int(second[0]) == 1  # still valid
    assert e.value.cause is None
    assert f"(pid {prod.pid}) is gone without finishing" in str(e.value)
    assert "create a new TensorConsumer" in str(e.value)


def test_a_producer_in_process_failing_reports_its_error(name):
    """In one process: the loader raises in the producer's thread; the consumer in the
    main thread gets the batches before, then ProducerFailed with the error."""
    def loader():
        yield torch.zeros(3)
        yield torch.ones(3)
        raise OSError("disk went away")

    p = TensorProducer(lambda: loader(), name=name, min_consumers=1, start_timeout=30)
    outcome: list = []

    def run() -> None:
        try:
            with p:
                for _ in p:
                    pass
        except OSError as e:
            outcome.append(e)

    t = threading.Thread(target=run)
    t.start()
    got = []
    with TensorConsumer(name=name, timeout=30) as c:
        with pytest.raises(ProducerFailed, match="OSError: disk went away") as e:
            for batch in c:
                got.append(float(batch[0]))
    t.join(30)
    assert got == [0.0, 1.0] and len(outcome) == 1
    assert e.value.cause.startswith("OSError: disk went away")


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_lock_file_of_an_earlier_run_is_waited_past(name):
    """A dead producer's lock file older than this process (a leftover of an earlier
    run) does not end the wait: a new producer may be on its way. The timeout's
    ProducerNotFound mentions it."""
    from tensorsocket import ProducerNotFound
    from tensorsocket.control.endpoints import resolve

    lock = resolve(name).lock_path
    pid = _dead_pid()
    lock.write_text(str(pid))
    long_ago = time.time() - 10 * 24 * 3600
    os.utime(lock, (long_ago, long_ago))
    t0 = time.monotonic()
    with pytest.raises(ProducerNotFound) as e:
        TensorConsumer(name=name, timeout=1.5)
    assert time.monotonic() - t0 >= 1.5
    assert f"(pid {pid}) took it" in str(e.value) and "no longer running" in str(e.value)


def test_lock_file_of_a_producer_that_just_died_ends_the_wait(name):
    """A dead producer's lock file written since this process started, within the
    timeout: that producer was started for this consumer and died."""
    from tensorsocket.control.endpoints import resolve

    lock = resolve(name).lock_path
    pid = _dead_pid()
    lock.write_text(str(pid))
    t0 = time.monotonic()
    with pytest.raises(ProducerFailed, match=f"pid {pid}"):
        TensorConsumer(name=name, timeout=30)
    assert time.monotonic() - t0 < 10
