"""Forked children and the batches they inherit (issue: silent corruption across fork).

A DataLoader's batches are private memory: a child forked while the parent holds one (a
multiprocessing.Process with the fork start method, os.fork) reads it as it was, whatever
the parent does next. Here the parent drops its views and reads on until the producer has
refilled every slot; the child must still read the batch it inherited. A consumer used in
the child itself says clearly that it cannot read there.
"""

from __future__ import annotations

import json
import sys

import pytest

from tensorsocket import TensorProducer
from conftest import run as run_python

FORKER = r"""
import json, multiprocessing as mp, os, sys
import torch
from tensorsocket import TensorConsumer, TensorSocketError

name, how = sys.argv[1], sys.argv[2]
c = TensorConsumer(name=name, timeout=60, batch_timeout=60)
it = iter(c)
batch = next(it)                      # batch 0, a view of ring slot 0
first = int(batch[0])

def child(batch, go, out):
    go.recv()                         # the parent has read on through every slot
    value = [int(x) for x in batch]
    try:
        next(iter(c))
        used = "no error"
    except TensorSocketError as e:
        used = str(e)
    out.send((value, used))

parent_go, child_go = mp.Pipe()
child_out, parent_out = mp.Pipe()
if how == "mp":
    p = mp.get_context("fork").Process(target=child, args=(batch, child_go, parent_out))
    p.start()
else:
    pid = os.fork()
    if pid == 0:
        try:
            child(batch, child_go, parent_out)
        finally:
            os._exit(0)
del batch                             # the parent's views go: slot 0 can be refilled
later = [int(b[0]) for b in it]       # read on: every slot is refilled at least once
parent_go.send("go")
value, used = child_out.recv()
if how == "mp":
    p.join()
else:
    os.waitpid(pid, 0)
print(json.dumps({"first": first, "later": later, "child": value, "used": used}), flush=True)
c.close()
"""


@pytest.mark.parametrize("how", ["mp", "os.fork"])
def test_a_forked_child_reads_its_batch_as_it_was(name, how, fault_table):
    import threading

    import torch

    loader = [torch.full((64,), float(i)) for i in range(12)]
    producer = TensorProducer(loader, name=name, ring_slots=4, min_consumers=1,
                              start_timeout=60)
    t = threading.Thread(target=lambda: [None for _ in producer], daemon=True)
    t.start()
    try:
        job = run_python([sys.executable, "-c", FORKER, name, how], capture_output=True,
                         text=True, timeout=120)
    finally:
        t.join(60)
        producer.close()
    assert job.returncode == 0, job.stderr[-3000:]
    out = json.loads(job.stdout)
    assert out["first"] == 0 and out["later"] == list(range(1, 12))
    assert out["child"] == [0] * 64, "the child's batch changed under it"
    assert "cannot read in process" in out["used"] and "fork" in out["used"]
    fault_table.add(f"a consumer process forks ({how}) while holding a batch, drops it and "
                    "reads on until every slot was refilled",
                    "- (the held slots are copied for the child at the fork)",
                    "the child reads its batch as it was; the consumer used in the child "
                    "raises TensorSocketError naming the fork", "nothing")
