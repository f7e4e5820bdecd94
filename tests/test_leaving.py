"""A consumer that leaves while it still holds a batch, then exits without freeing it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import torch

from conftest import ROOT
from tensorsocket import TensorConsumer, TensorProducer

HOLD_AND_EXIT = textwrap.dedent("""
    import os, sys
    from tensorsocket import TensorConsumer
    c = TensorConsumer(name=sys.argv[1], timeout=30)
    kept = [next(iter(c))]   # holds its slot
    c.close()                # says bye: no longer a peer of the control server
    os._exit(0)              # exits without the views ever being freed
""")


def test_consumer_exiting_after_bye_with_a_held_batch_does_not_stall_the_ring(name):
    """The held slot is released once its process is gone, so the producer and the other
    consumer go on (before the fix, the producer waited for that slot forever)."""
    loader = [torch.full((4,), float(i)) for i in range(40)]
    producer = TensorProducer(loader, name=name, min_consumers=2, ring_slots=4,
                              start_timeout=30, publish_timeout=30)
    errors: list = []

    def produce() -> None:
        try:
            for _ in producer:
                pass
            producer.join(timeout=30)
        except Exception as e:  # reported by the assertion below
            errors.append(e)

    thread = threading.Thread(target=produce)
    thread.start()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_AND_EXIT, name], cwd=ROOT)
    reader = TensorConsumer(name=name, timeout=30, batch_timeout=15)
    try:
        values = [int(x[0]) for x in reader]
        assert holder.wait(timeout=30) == 0
        assert values == list(range(40))
    finally:
        reader.close()
        thread.join(60)
        producer.close()
    assert not thread.is_alive() and errors == []
