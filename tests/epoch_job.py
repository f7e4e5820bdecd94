"""A training job that iterates shared loaders the ways training code does, and prints
the sample ids it received per epoch as one JSON line.

python tests/epoch_job.py NAME MODE [--epochs E] [--samples N] [--batch-size B]
  MODE plain:      for epoch: for batch in loader
       iter-first: every epoch starts with an iter(loader) dropped without next()
       exact-len:  every epoch takes exactly len(loader) batches (islice), no StopIteration
       break:      epoch 0 breaks after 3 batches (its ids are not counted), then whole epochs
       alternate:  after each training epoch a whole epoch of a second loader, NAME-val
       group:      --rank R --world-size W: a rank of a data-parallel group
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import tensorsocket


def ids_of(batch) -> list[int]:
    """The sample ids of a (ids,) batch."""
    return [int(v) for v in batch[0]]


def take_three(loader) -> None:
    """Three batches, then break (the batches die with this frame: a batch kept alive
    across the break would hold its ring slot; see docs/usage.md)."""
    for i, _ in enumerate(loader):
        if i == 2:
            break


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("mode")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--step", type=float, default=0.0, help="seconds per training step")
    ap.add_argument("--val-pause", type=float, default=0.0,
                    help="seconds more after each validation epoch (a slower job)")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world-size", type=int)
    a = ap.parse_args()

    data = TensorDataset(torch.arange(a.samples))
    extra = {}
    if a.mode == "group":
        extra = {"rank": a.rank, "world_size": a.world_size}
    loader = tensorsocket.share(DataLoader(data, batch_size=a.batch_size, shuffle=True),
                                name=a.name, timeout=60, **extra)
    val = None
    if a.mode == "alternate":
        val_data = TensorDataset(torch.arange(a.samples // 2))
        val = tensorsocket.share(DataLoader(val_data, batch_size=a.batch_size),
                                 name=a.name + "-val", timeout=60)
    out: dict = {"train": [], "val": [], "len": len(loader)}
    for epoch in range(a.epochs):
        if a.mode == "iter-first":
            iter(loader)  # dropped at once, never advanced
        if a.mode == "break" and epoch == 0:
            take_three(loader)
        seen: list[int] = []
        if a.mode == "exact-len":
            batches = itertools.islice(iter(loader), len(loader))
        else:
            batches = loader
        for batch in batches:
            seen += ids_of(batch)
            if a.step:
                time.sleep(a.step)
        out["train"].append(seen)
        if val is not None:
            out["val"].append([i for b in val for i in ids_of(b)])
            time.sleep(a.val_pause)
    print(json.dumps(out), flush=True)
    loader.close()
    if val is not None:
        val.close()


if __name__ == "__main__":
    sys.exit(main())
