"""Batches kept alive hold ring slots: a consumer stalled by its own kept batches says so.

The producer is a real process (tests/roles.py) over a ring of 4 slots; the consumer is
this process.
"""

from __future__ import annotations

import warnings

import pytest

from tensorsocket import TensorConsumer, TensorSocketWarning


def test_list_of_batches_stalls_and_says_why(procs, name):
    """list(consumer) keeps every batch: once the ring is full, the producer cannot go
    on; the consumer warns (naming the cause and the fixes) before batch_timeout ends."""
    p = procs.start("producer", "--name", name, "--kind", "tuple", "--batches", "12",
                    "--slots", "4")
    procs.wait_ready(p)
    c = TensorConsumer(name=name, timeout=30, batch_timeout=8)
    with pytest.warns(TensorSocketWarning, match=r"still keeps alive \(4 of the ring's 4 "
                                                 r"slots.*list\(consumer\).*copy=True"):
        with pytest.raises(TimeoutError, match="batch_timeout=8"):
            list(c)
    c.close()  # the kept batches went with list()'s frame: the producer goes on
    with TensorConsumer(name=name, timeout=30, align_epochs=False) as late, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", TensorSocketWarning)  # its epoch is cut short
        rest = [int(x[0, 0]) for x, _ in late]
    assert rest and rest[-1] == 11
    procs.result(p)


def test_kept_batches_with_copies_do_not_stall(procs, name):
    """copy=True batches hold no slot: list(consumer) works."""
    p = procs.start("producer", "--name", name, "--kind", "tuple", "--batches", "12",
                    "--slots", "4")
    procs.wait_ready(p)
    with TensorConsumer(name=name, timeout=30, batch_timeout=20, copy=True) as c:
        batches = list(c)
    assert [int(x[0, 0]) for x, _ in batches] == list(range(12))
    procs.result(p)


def test_slow_producer_is_no_stall_of_ours(procs, name):
    """Waiting for a slow loader, holding only the current batch, is not warned about."""
    p = procs.start("producer", "--name", name, "--kind", "tuple", "--batches", "2",
                    "--slots", "4", "--delay", "6.5")
    procs.wait_ready(p)
    with TensorConsumer(name=name, timeout=30, batch_timeout=30) as c:
        with warnings.catch_warnings():
            warnings.simplefilter("error", TensorSocketWarning)
            seen = [int(x[0, 0]) for x, _ in c]
    assert seen == [0, 1]
    procs.result(p)


KEEPER = r"""
import sys, time
from itertools import islice
from tensorsocket import TensorConsumer
c = TensorConsumer(name=sys.argv[1], timeout=30)
kept = list(islice(c, 4))   # every slot of the ring
print("kept", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_producer_logs_the_consumer_that_keeps_its_slots(name, procs, caplog, monkeypatch):
    """The producer names the consumer whose kept batches hold the slot it must reuse."""
    import logging
    import subprocess
    import sys
    import threading

    import torch

    from tensorsocket import TensorProducer, control

    monkeypatch.setattr(control, "HELD_WARN_AFTER", 1.0)
    caplog.set_level(logging.WARNING, logger="tensorsocket")
    loader = [torch.full((2,), float(i)) for i in range(8)]
    producer = TensorProducer(loader, name=name, ring_slots=4, rubber_band=0, start_timeout=3)
    keeper = subprocess.Popen([sys.executable, "-c", KEEPER, name, "4"],
                              stdout=subprocess.PIPE, text=True)
    procs.procs.append(keeper)
    ended: list[str] = []

    def run() -> None:
        try:
            for _ in producer:
                pass
        except TimeoutError as e:  # the keeper left and nobody else came
            ended.append(str(e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert keeper.stdout.readline().strip() == "kept"
    keeper.wait(timeout=30)  # it exits: its slots are released
    t.join(timeout=30)
    assert ended and "start_timeout=3" in ended[0]
    producer.close()
    held = [r.getMessage() for r in caplog.records if "still keep" in r.getMessage()]
    assert len(held) == 1, caplog.text
    assert f"(pid {keeper.pid}) read and still keeps alive" in held[0]
    assert "TensorConsumer(copy=True)" in held[0]
