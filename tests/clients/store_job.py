"""A training job over a torchvision ImageFolder with its own sampler, subset, seed and
speed, sharing the decode through the store of decoded samples (issue 38).

    python store_job.py --root DIR --name NAME --subset all|half|quarter --seed S
        [--epochs E] [--batch-size B] [--workers W] [--step SECONDS] [--cache-bytes N]
        [--hold FILE] [--random-getitem]

The job first runs its own DataLoader (the baseline: built by make_loader(), the same
code the shared run uses, after ``torch.manual_seed(seed)``) for its epochs and records
each batch's sample ids; then the same make_loader() goes through the one-line swap
``share(make_loader(), name=..., store=True)``, and every batch is checked:

- its ids (the dataset yields (image, target, index)) equal the baseline's batch, index for
  index, epoch by epoch, and the targets are the folder's;
- each image is what the whole torchvision pipeline gives for that sample (decoded here,
  from the folder, privately) with the generators seeded as the store seeds the job's
  own part: sample_seed(job seed, epoch, sample): no stale, torn or foreign sample.

The subsets: ``all`` (shuffle with the global generator), ``half`` (a ``Subset`` of a fixed
random half, shuffled with a generator of its own), ``quarter`` (a
``SubsetRandomSampler`` over every fourth sample). Every decode of the folder appends
"<pid> <index>" to $TS_TEST_LOADS. ``--step`` sleeps that long per batch (a training step);
``--hold FILE``: after batch 2 of epoch 0, print {"event": "held"} and wait (at most 300
s) until FILE exists. ``--random-getitem`` adds noise drawn from torch's generator in
``__getitem__`` (a dataset whose samples are not deterministic): images are then not
checked. Prints a JSON line per batch ({"event": "batch", ...}) and a last one with the
record (with the longest next() of the shared run, for the fault table).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Subset, SubsetRandomSampler  # noqa: E402

from tools import harness  # noqa: E402
from tv_augment import log_load  # noqa: E402

HOLD_SECONDS = 300


def pipeline() -> Any:
    """The job's whole torchvision pipeline, as it would give it to its dataset."""
    from torchvision.transforms import v2

    return v2.Compose([v2.Resize((40, 40)), v2.PILToTensor(), v2.RandomResizedCrop(32),
                       v2.RandomHorizontalFlip()])


def make_dataset(root: str, random_getitem: bool) -> Any:
    """The ImageFolder with the whole pipeline, yielding (image, target, index); each
    decode logged."""
    from torchvision.datasets import ImageFolder

    class IndexedImageFolder(ImageFolder):
        def __getitem__(self, index: int) -> tuple[Any, int, int]:
            img, target = super().__getitem__(index)
            log_load(index)
            if random_getitem:
                img = img + torch.randint(0, 3, img.shape, dtype=torch.uint8)
            return img, target, index

    return IndexedImageFolder(root, transform=pipeline())


def make_loader(args: argparse.Namespace) -> DataLoader:
    """The job's DataLoader (its subset, sampler and seed), the same for both runs."""
    ds = make_dataset(args.root, args.random_getitem)
    n = len(ds)
    common = dict(batch_size=args.batch_size, num_workers=args.workers)
    if args.subset == "all":
        return DataLoader(ds, shuffle=True, **common)
    g = torch.Generator()
    g.manual_seed(args.seed + 1)
    if args.subset == "half":
        half = np.sort(np.random.default_rng(0).permutation(n)[: n // 2]).tolist()
        return DataLoader(Subset(ds, half), shuffle=True, generator=g, **common)
    return DataLoader(ds, sampler=SubsetRandomSampler(list(range(0, n, 4)), generator=g),
                      **common)


def baseline(args: argparse.Namespace) -> list[list[list[int]]]:
    """The ids of each batch of each epoch, by the job's own DataLoader."""
    torch.manual_seed(args.seed)
    own = make_loader(args)
    return [[batch[2].tolist() for batch in own] for _ in range(args.epochs)]


def wait_for(path: str) -> None:
    """Wait until `path` exists (at most HOLD_SECONDS)."""
    deadline = time.monotonic() + HOLD_SECONDS
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear within {HOLD_SECONDS} s")
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--subset", choices=["all", "half", "quarter"], default="all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--step", type=float, default=0.0)
    p.add_argument("--cache-bytes", type=int, default=0)
    p.add_argument("--hold", default=None)
    p.add_argument("--random-getitem", action="store_true")
    args = p.parse_args()
    records, warned = harness.keep_log_and_warnings()

    import tensorsocket as ts
    from tensorsocket.augment.seeding import callers_generators_kept, sample_seed, seed_everything
    from torchvision.datasets import ImageFolder

    expected_ids = baseline(args)
    plain = ImageFolder(args.root, transform=pipeline())  # the check's own decodes (not logged)
    torch.manual_seed(args.seed)
    loader = ts.share(make_loader(args), name=args.name, store=True,
                      **({"cache_bytes": args.cache_bytes} if args.cache_bytes else {}))
    seed = loader.job_seed
    got_ids, wrong_images, wrong_targets = [], 0, 0
    longest_next = 0.0  # s: the longest next() of the shared run, an epoch's first included
    started = time.monotonic()
    for epoch in range(args.epochs):
        ids_epoch = []
        batches = iter(loader)
        for k in range(len(loader)):
            asked = time.monotonic()
            images, targets, ids = next(batches)
            longest_next = max(longest_next, time.monotonic() - asked)
            ids_epoch.append(ids.tolist())
            for row, i in enumerate(ids.tolist()):
                if int(targets[row]) != plain.targets[i]:
                    wrong_targets += 1
                if args.random_getitem:
                    continue
                with callers_generators_kept():
                    seed_everything(sample_seed(seed, epoch, i))
                    want, _ = plain[i]
                if not torch.equal(images[row], want):
                    wrong_images += 1
            harness.emit({"event": "batch", "epoch": epoch, "k": k})
            if args.hold and epoch == 0 and k == 2:
                harness.emit({"event": "held"})
                wait_for(args.hold)
            if args.step:
                time.sleep(args.step)
        assert next(batches, None) is None, "the loader gave more than len(loader) batches"
        got_ids.append(ids_epoch)
    info = loader.store_info()
    harness.emit({"event": "done", "ids_equal": got_ids == expected_ids,
                  "ids": got_ids, "expected": expected_ids, "wrong_images": wrong_images,
                  "wrong_targets": wrong_targets, "info": info, "pid": os.getpid(),
                  "seconds": time.monotonic() - started, "longest_next": longest_next,
                  "warnings": warned,
                  "log": records, "len": len(loader), "key": loader.store_key})
    loader.close()


if __name__ == "__main__":
    main()
