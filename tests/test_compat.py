"""Scripts written for the original TensorSocket run unchanged.

The scripts below have the form of the original's examples (simple_producer.py,
simple_consumer.py of TensorSocket 0.0.4/0.0.5): the consumer's ``__next__`` returns
the batch itself, and the producer's DummyLoader never raises StopIteration, its
epoch ending after ``len(loader)`` batches."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, popen


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port pair")


PRODUCER = """
import torch
from tensorsocket.producer import TensorProducer

class DummyLoader:
    def __init__(self, length=20):
        self.length = length
        self.id = 0
        self.batch_size = 8
    def __len__(self):
        return self.length
    def __iter__(self):
        self.id = 0
        return self
    def __next__(self):
        if self.id >= self.length and {stops}:
            raise StopIteration
        a, b = self.id * torch.ones((self.batch_size, 10)), self.id * torch.ones((self.batch_size,))
        self.id += 1
        return a, b

data_loader = DummyLoader()
producer = TensorProducer(data_loader, "{port}", "{ack}", rubber_band_pct=0.02)
for epoch in range(2):
    for i, _ in enumerate(producer):
        pass
producer.join()
print("finished")
"""

CONSUMER = """
from tensorsocket.consumer import TensorConsumer

consumer = TensorConsumer("{port}", "{ack}")
seen = []
for epoch in range(2):
    for i, batch in enumerate(consumer):
        (inputs, labels) = batch
        assert float(labels[0]) == i and inputs.shape == (8, 10), (i, labels)
        seen.append(i)
    assert consumer.epoch == epoch + 1
print(len(consumer), seen)
"""


CONSUMER_BATCH_16 = """
import torch
from tensorsocket.consumer import TensorConsumer

consumer = TensorConsumer("{port}", "{ack}", batch_size=16)
seen = []
for epoch in range(2):
    for i, batch in enumerate(consumer):
        inputs, labels = batch
        want = torch.tensor([2 * i] * 8 + [2 * i + 1] * 8, dtype=labels.dtype)
        assert inputs.shape == (16, 10) and torch.equal(labels, want), (i, labels)
        assert torch.equal(inputs[:, 0], want)
        seen.append(i)
print(len(consumer), seen)
"""


@pytest.mark.parametrize("consumer, expected", [
    (CONSUMER, f"20 {list(range(20)) * 2}"),
    # The consumer asks for 16 samples per batch over a loader of batches of 8.
    (CONSUMER_BATCH_16, f"10 {list(range(10)) * 2}"),
], ids=["loader-batches", "batch_size-16"])
@pytest.mark.parametrize("stops", [True, False], ids=["loader-stops", "loader-never-stops"])
def test_original_api_script_runs_unchanged(consumer, expected, stops):
    port = _free_port_pair()
    fill = dict(port=port, ack=port + 1, stops=stops)
    prod = popen([sys.executable, "-c", textwrap.dedent(PRODUCER).format(**fill)],
                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cons = popen([sys.executable, "-c", textwrap.dedent(consumer).format(**fill)],
                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        c_out, c_err = cons.communicate(timeout=90)
        p_out, p_err = prod.communicate(timeout=60)
    finally:
        for p in (prod, cons):
            if p.poll() is None:
                p.kill()
    assert cons.returncode == 0, c_err
    assert prod.returncode == 0, p_err
    assert c_out.strip() == expected
    assert p_out.strip() == "finished"
