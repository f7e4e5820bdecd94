"""A plain PyTorch training loop over a shared loader (the baseline of the framework tests).

    python plain_loop.py --name NAME --out PATH [--samples 64] [--no-share]

Epochs, in this order, as scripts iterate a DataLoader:
  0: ``for x, y in loader``
  (``iter(loader)`` is called and dropped without ``next()``, as code that peeks does)
  1: ``for x, y in loader``
  2: ``for x, y in itertools.islice(loader, len(loader))``: stops after exactly len()
     batches, never asking for the StopIteration (as Lightning's fetcher and
     Accelerate's ``skip_first_batches``-style loops do)
  3: ``for x, y in loader``
Each must hold every sample exactly once, in len(loader) batches.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from _common import IdDataset, dump, ids_of, make_loader  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--name", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--samples", type=int, default=64)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--no-share", action="store_true",
                    default=os.environ.get("TS_TEST_NO_SHARE") == "1")
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
loader, meta = make_loader(DataLoader(IdDataset(args.samples), batch_size=args.batch_size,
                                      shuffle=True), args.name, args.no_share)
record = {"rank": 0, "world": 1, "meta": meta, "train": {}}


def step(x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer.zero_grad()
    F.mse_loss(model(x).squeeze(1), y.float()).backward()
    optimizer.step()


def run_epoch(epoch: int, batches) -> None:
    got = record["train"].setdefault(str(epoch), [])
    for x, y in batches:
        assert torch.equal(x[:, 0].long(), y), "features do not match the ids"
        got.append(ids_of(y))
        step(x, y)
    dump(args.out, 0, record)


run_epoch(0, loader)
iter(loader)  # an iterator made and dropped without next()
run_epoch(1, loader)
run_epoch(2, itertools.islice(loader, len(loader)))
run_epoch(3, loader)
record["done"] = True
dump(args.out, 0, record)
print("plain_loop: done", flush=True)
