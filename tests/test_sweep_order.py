"""examples/sweep.py's order of joins as the CI run that timed out saw it, with real
processes: a driver that stops the loader while no consumer is attached (min_consumers=0,
as sweep.py's driver does), a consumer of batch size 48 attached during the producer's
first epoch, then consumers of batch sizes 32 (four epochs here, three in sweep.py) and 64
(two) joining during its second. The consumer of batch size 32 reads its last epochs
alone, while the two that left still keep their last batches alive (a slow process exit on
a loaded machine: their ring slots stay held until they go). Every consumer gets every
sample of each epoch."""

from __future__ import annotations

import pytest

DRIVER = r"""
import sys, time
import torch
from tensorsocket import TensorProducer
from tools import harness

name = sys.argv[1]
data = torch.utils.data.TensorDataset(torch.zeros(80, 3), torch.arange(80))
torch.manual_seed(0)
loader = torch.utils.data.DataLoader(data, batch_size=64, shuffle=True)
came = [False]  # all three consumers attached once

def finished():
    return came[0] and producer.consumers_present() == 0

def wait_for(n):  # by the producer's count, as sweep.py's driver waits
    deadline = time.monotonic() + 60
    while producer.stats()["consumers"] < n:
        assert time.monotonic() < deadline, f"{n} consumers did not attach"
        time.sleep(0.01)

with TensorProducer(loader, name=name, min_consumers=0) as producer:
    harness.emit({"ready": True})
    epoch = 0
    while not finished():
        for index, _ in enumerate(producer):
            if (epoch, index) == (0, 0):
                harness.emit({"gate": 1})
                wait_for(1)
            elif (epoch, index) == (1, 0):
                harness.emit({"gate": 2})
                wait_for(3)
                came[0] = True
            if finished():
                break
            # sweep.py's driver: no loading while no consumer is attached.
            deadline = time.monotonic() + 60
            while producer.stats()["consumers"] == 0 and not finished():
                assert time.monotonic() < deadline, \
                    f"epoch {epoch}: no consumer attached, {producer.consumers_present()} present"
                time.sleep(0.01)
        epoch += 1
    harness.emit({"epochs": epoch})
"""

CONSUMER = r"""
import os, sys, time
from tensorsocket import TensorConsumer
from tools import harness

name, batch_size, epochs, release = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
consumer = TensorConsumer(name=name, batch_size=batch_size, timeout=60, batch_timeout=30)
seen = []
for _ in range(epochs):
    ids = []
    for x, y in consumer:  # x and y stay alive into the next next(), as in a training loop
        ids.extend(y.tolist())
    seen.append(sorted(ids))
consumer.close()
harness.emit({"epochs": seen})
# Its last batch (x, y) stays alive until the test says go: a process that exits slowly.
deadline = time.monotonic() + 120
while release != "-" and not os.path.exists(release) and time.monotonic() < deadline:
    time.sleep(0.01)
harness.emit({"released": release == "-" or os.path.exists(release)})
"""


@pytest.mark.slow  # four consumer processes and a driver: ~10 s; the late joiners also in test_flexible
def test_last_joiner_reads_its_last_epoch_alone(procs, name, tmp_path):
    release = str(tmp_path / "release")
    driver = procs.script(DRIVER, name)
    assert procs.wait_ready(driver) == {"ready": True}
    assert procs.wait_ready(driver) == {"gate": 1}  # epoch 0's first batch is published
    first = procs.script(CONSUMER, name, "48", "2", release)
    assert procs.wait_ready(driver) == {"gate": 2}  # epoch 1's first batch is published
    alone = procs.script(CONSUMER, name, "32", "4", "-")
    other = procs.script(CONSUMER, name, "64", "2", release)
    whole = list(range(80))
    assert first.wait_ready()["epochs"] == [whole] * 2
    assert other.wait_ready()["epochs"] == [whole] * 2
    # Its last epochs come while the two others have left, their last batches alive: one
    # epoch more than sweep.py's trial reads, so that the producer must pass the slot the
    # consumer of batch size 64 still holds (a hole) before that epoch can come.
    assert alone.wait_ready()["epochs"] == [whole] * 4
    with open(release, "w"):
        pass
    for p in (first, other, alone):
        assert procs.result(p) == {"released": True}
    assert procs.result(driver)["epochs"] >= 4
