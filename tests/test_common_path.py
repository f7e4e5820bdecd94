"""The consumer's common path (tensorsocket._core.Lane, consumer/iterator.py): one C call
per batch for a consumer in the common case, the Python path for the rest (an epoch's
first and last batch, its end, batches it cannot build), with the same batches, counts
and state_dict() either way. Real producer and consumer processes."""

from __future__ import annotations

import pytest

SAMPLES = 96
BATCH = 8
EPOCHS = 2

# A shuffling DataLoader of (x, ids) batches; with `mixed`, batches 0, 4 and 8 of each epoch
# are dicts with a numpy leaf (not the common path's to build), the others tuples of
# tensors.
PRODUCER = r"""
import sys, numpy as np, torch
from torch.utils.data import DataLoader, Dataset
from tensorsocket import TensorProducer

name, mixed = sys.argv[1], sys.argv[2] == "mixed"

class Ids(Dataset):
    def __len__(self):
        return 96
    def __getitem__(self, i):
        return torch.full((3,), float(i)), i

made = [0]

def collate(items):
    x = torch.stack([x for x, _ in items])
    ids = torch.tensor([i for _, i in items])
    made[0] += 1
    if mixed and made[0] % 4 == 1:
        return {"x": x, "ids": ids.numpy()}
    return x, ids

loader = DataLoader(Ids(), batch_size=8, shuffle=True, collate_fn=collate,
                    generator=torch.Generator().manual_seed(3))
p = TensorProducer(loader, name=name, min_consumers=1, start_timeout=60)
print('{"ready": true}', flush=True)
for _ in range(2):
    for _ in p:
        pass
p.join(timeout=60)
"""

# Counts the Python path's calls, reads 2 epochs (with_index pairs), takes a state after 5
# batches of the first: what it says was taken, against what came.
CONSUMER = r"""
import json, sys, torch
from tensorsocket import TensorConsumer
from tensorsocket.consumer.iterator import EpochIterator
from tensorsocket.data.sample_ids import IdMask

name = sys.argv[1]
slow = [0]
_next_slow = EpochIterator._next_slow
def counted(self):
    slow[0] += 1
    return _next_slow(self)
EpochIterator._next_slow = counted

c = TensorConsumer(name=name, timeout=60, with_index=True)
print(json.dumps({"ready": True}), flush=True)
epochs, slow_calls, indices, state_ok, states = [], [], [], [], []
for epoch in range(2):
    before, ids, order = slow[0], [], []
    for index, batch in c:
        order.append(index)
        batch_ids = batch[1] if isinstance(batch, tuple) else torch.as_tensor(batch["ids"])
        x = batch[0] if isinstance(batch, tuple) else batch["x"]
        assert torch.equal(x[:, 0], batch_ids.float()), "x and ids disagree"
        ids += batch_ids.tolist()
        if epoch == 0 and len(order) == 5:
            state = c.state_dict()
            taken = IdMask.from_text(state["taken"], state["dataset_len"]).bits
            state_ok.append(sorted(taken.nonzero()[0].tolist()) == sorted(ids))
            states.append(state["batches_in_epoch"])
    epochs.append(ids)
    slow_calls.append(slow[0] - before)
    indices.append(order)
stats = c.stats()
c.close()
print(json.dumps({"epochs": epochs, "slow": slow_calls, "indices": indices,
                  "state_ok": state_ok, "state_batches": states,
                  "batches": stats["batches"], "samples": stats["samples"],
                  "loader_batches": stats["loader_batches"]}), flush=True)
"""


@pytest.mark.parametrize("batches", ["tensors", "mixed"])
def test_common_path_gives_what_the_python_path_gives(procs, name, batches):
    """Each epoch holds every sample once, in batches with their index; a state taken
    after 5 batches names exactly their samples; stats count every batch. With tuples of
    tensors the Python path runs 3 times an epoch (its first batch, its last, its end);
    with dicts holding a numpy leaf as batches 0, 4 and 8, also for batches 4 and 8."""
    prod = procs.script(PRODUCER, name, batches)
    prod.wait_ready()
    cons = procs.script(CONSUMER, name)
    cons.wait_ready()
    r = procs.result(cons, timeout=120)
    assert prod.wait(60) == 0
    per_epoch = SAMPLES // BATCH
    for ids in r["epochs"]:
        assert sorted(ids) == list(range(SAMPLES))
    assert r["epochs"][0] != r["epochs"][1], "the loader reshuffles each epoch"
    assert r["indices"] == [list(range(per_epoch))] * EPOCHS
    assert r["state_ok"] == [True] and r["state_batches"] == [5]
    assert (r["batches"], r["loader_batches"], r["samples"]) == \
        (EPOCHS * per_epoch, EPOCHS * per_epoch, EPOCHS * SAMPLES)
    if batches == "tensors":
        assert r["slow"] == [3, 3], "the common path took every other batch"
    else:
        assert r["slow"] == [5, 5], "batches 4 and 8 went the Python path too"


# Flat (x, ids) batches whose x is, by batch index: a plain tensor, a lazy negative view
# (conj().imag of a complex tensor), a conjugate view (complex), a tensor that requires
# grad, a transposed (non-contiguous) one, an empty one. The producer hands the later
# batches of a flat tuple to the ring as DLPack capsules; the lazy views must arrive with
# their values, not their memory. Each batch is published after a sleep, so the consumer
# waits for most of them (in the core first: stats counts that wait). Prints what it sent.
ODD_PRODUCER = r"""
import json, sys, time, torch
from tensorsocket import TensorProducer

name = sys.argv[1]

def x_of(k):
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * k
    kind = k % 6
    if kind == 1:
        return torch.complex(torch.zeros_like(base), -base).conj().imag  # neg bit
    if kind == 2:
        return torch.complex(base, base + 1).conj()
    if kind == 3:
        return base.clone().requires_grad_(True)
    if kind == 4:
        return base.t().contiguous().t()
    if kind == 5:
        return base[:0]
    return base

def described(t):
    t = t.detach().resolve_conj().resolve_neg()
    values = torch.view_as_real(t).tolist() if t.is_complex() else t.tolist()
    return [str(t.dtype), list(t.shape), values]

def batches():
    for k in range(18):
        time.sleep(0.02)
        yield x_of(k), torch.tensor([k])

class Loader:
    def __iter__(self):
        return batches()
    def __len__(self):
        return 18

p = TensorProducer(Loader(), name=name, min_consumers=1, start_timeout=60)
print('{"ready": true}', flush=True)
sent = []
for x, ids in p:
    assert x.is_neg() == (int(ids[0]) % 6 == 1) and x.is_conj() == (int(ids[0]) % 6 == 2)
    sent.append([described(x), described(ids)])
p.join(timeout=60)
print(json.dumps({"sent": sent}), flush=True)
"""

ODD_CONSUMER = r"""
import json, sys, torch
from tensorsocket import TensorConsumer

def described(t):
    values = torch.view_as_real(t).tolist() if t.is_complex() else t.tolist()
    return [str(t.dtype), list(t.shape), values]

c = TensorConsumer(name=sys.argv[1], timeout=60)
print(json.dumps({"ready": True}), flush=True)
got = [[described(x), described(ids)] for x, ids in c]
stats = c.stats()
c.close()
print(json.dumps({"got": got, "wait_seconds": stats["wait_seconds"]}), flush=True)
"""


def test_lazy_views_and_odd_tensors_of_flat_batches_arrive_as_their_values(procs, name):
    """Negative and conjugate views (whose memory is not their values), tensors that
    require grad, non-contiguous and empty ones, in the later batches of flat tuples: the
    consumer gets the values the producer's loader made, batch for batch; the time it
    waited for the slow loader's batches is in stats()."""
    prod = procs.script(ODD_PRODUCER, name)
    prod.wait_ready()
    cons = procs.script(ODD_CONSUMER, name)
    cons.wait_ready()
    r = procs.result(cons, timeout=120)
    sent = procs.result(prod, timeout=60)["sent"]
    assert len(sent) == 18 and r["got"] == sent
    # 17 waits of ~20 ms each for the loader (the first batch comes before the clock).
    assert r["wait_seconds"] >= 17 * 0.02 * 0.5, r["wait_seconds"]
