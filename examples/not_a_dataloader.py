"""A producer over loaders that are not DataLoaders: a generator, and a datasets-style iterable.

    python examples/not_a_dataloader.py        # ~6 s on 2 CPU cores

TensorProducer takes any iterable of batches, not only a torch DataLoader. This script runs
two producers, one after the other, and one consumer process (this file with --consume) that
reads both:

1. A plain Python generator function that yields dict batches (token ids, attention masks,
   labels, and a per-batch string). A generator object can be iterated once, so the producer
   gets a zero-argument callable that returns a fresh one for each epoch:
   ``TensorProducer(lambda: token_batches(...))`` (a callable with one parameter gets the
   epoch number). A generator object itself serves one epoch; asked for a second, the
   producer raises a TypeError that says what to pass instead: the script shows it.
2. A class shaped like a Hugging Face ``datasets.IterableDataset`` after ``.batch(32)
   .with_format("numpy")``: ``__iter__`` starts a new pass each time and yields dicts of
   numpy arrays and of lists (the texts); ``set_epoch()`` reshuffles, as in datasets. It is
   re-iterable, so ``TensorProducer(reviews)`` would do; the script passes
   ``lambda epoch: reviews.set_epoch(epoch) or reviews`` so that each epoch is reshuffled.

What to look at: the consumer prints, per epoch, its batches and samples and the structure
of a batch: keys, torch tensors from torch tensors, numpy arrays from numpy arrays, lists of
strings and plain values as they were. It reads part 2 with its own batch_size=16: the
arrays AND the list of texts are cut into batches of 16. Neither loader has a len(), so
len(consumer) is unknown (TypeError, as for a DataLoader over an IterableDataset) and the
epochs end where the loader's do.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path

import numpy as np
import torch

from tensorsocket import TensorConsumer, TensorProducer

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tools/: this checkout's, not installed
from tools import harness  # noqa: E402

EPOCHS = 2


# -- 1. a generator of dict batches ------------------------------------------------------


def token_batches(batches: int = 6, batch_size: int = 32, seq_len: int = 64, seed: int = 0):
    """Synthetic language-model batches, as a tokenizing pipeline might yield them."""
    g = torch.Generator().manual_seed(seed)
    for i in range(batches):
        lengths = torch.randint(seq_len // 4, seq_len + 1, (batch_size,), generator=g)
        mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
        ids = torch.randint(1, 30000, (batch_size, seq_len), generator=g) * mask
        yield {"input_ids": ids, "attention_mask": mask, "labels": ids.roll(-1, dims=1),
               "shard": f"shard-{i % 3}"}


# -- 2. a Hugging Face datasets-style iterable ---------------------------------------------


class ReviewsIterable:
    """Like ``datasets.IterableDataset.batch(batch_size).with_format("numpy")``.

    ``__iter__`` starts a new pass over the data (shuffled per epoch, after set_epoch), and
    yields dicts of numpy arrays, plus the texts as a list of str. No ``__len__``, like a
    streaming dataset.
    """

    WORDS = ["good", "bad", "fine", "great", "awful", "plot", "actors", "music", "long"]

    def __init__(self, rows: int = 160, batch_size: int = 32, seed: int = 0) -> None:
        self.rows, self.batch_size, self.seed, self.epoch = rows, batch_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(self.rows)
        for start in range(0, self.rows, self.batch_size):
            idx = order[start:start + self.batch_size]
            texts = [" ".join(rng.choice(self.WORDS, 5)) for _ in idx]
            yield {"text": texts,
                   "label": (idx % 2).astype(np.int64),
                   "embedding": rng.standard_normal((len(idx), 16)).astype(np.float32),
                   "row": idx.astype(np.int64)}


# -- the consumer process -------------------------------------------------------------------


def describe(batch: dict) -> str:
    parts = []
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            parts.append(f"{key}: torch {str(value.dtype)[6:]} {list(value.shape)}")
        elif isinstance(value, np.ndarray):
            parts.append(f"{key}: numpy {value.dtype} {list(value.shape)}")
        elif isinstance(value, list):
            parts.append(f"{key}: list of {len(value)} {type(value[0]).__name__}")
        else:
            parts.append(f"{key}: {type(value).__name__} {value!r}")
    return "{" + ", ".join(parts) + "}"


def consume(name: str, batch_size: int | None) -> None:
    loader = TensorConsumer(name=name, batch_size=batch_size, timeout=60)
    try:
        length = str(len(loader))
    except TypeError:
        length = "unknown (no len())"
    print(f"[consumer {name}] attached, batch_size={batch_size}; len(consumer): {length}",
          flush=True)
    for epoch in range(1, EPOCHS + 1):
        batches = samples = 0
        first = None
        for batch in loader:
            if first is None:
                first = describe(batch)
                if "row" in batch:
                    first += f", rows {batch['row'][:4].tolist()}..."
            key = "input_ids" if "input_ids" in batch else "label"
            batches += 1
            samples += len(batch[key])
        print(f"[consumer {name}] epoch {epoch}: {batches} batches, {samples} samples; "
              f"first batch {first}", flush=True)
    loader.close()


# -- the producers -----------------------------------------------------------------------------


def produce(loader, name: str, what: str) -> None:
    print(f"[producer] {what}: publishing {EPOCHS} epochs as {name!r}", flush=True)
    with TensorProducer(loader, name=name, start_timeout=60) as producer:
        for epoch in range(1, EPOCHS + 1):
            batches = sum(1 for _ in producer)
            print(f"[producer] {what}: epoch {epoch}: {batches} batches published", flush=True)


def used_up_generator() -> None:
    """A generator object serves one epoch; the second one raises a clear TypeError."""
    producer = TensorProducer(token_batches(batches=2), name=f"once-{uuid.uuid4().hex[:8]}",
                              min_consumers=0)  # no consumer here: publish to nobody
    try:
        for _ in producer:  # epoch 1: uses the generator up
            pass
        try:
            for _ in producer:  # epoch 2
                pass
        except TypeError as e:
            print(f"[producer] a generator object asked for a 2nd epoch: TypeError: {e}",
                  flush=True)
    finally:
        producer.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--consume", nargs=2, metavar=("NAME1", "NAME2"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.consume:
        consume(args.consume[0], None)  # the generator's batches as they are
        consume(args.consume[1], 16)  # the iterable's batches of 32, cut into 16s
        return

    tag = uuid.uuid4().hex[:8]
    names = (f"generator-{tag}", f"iterable-{tag}")
    # The consumer process: its output goes to ours (stdout=None, stderr=None).
    child = harness.spawn(harness.python_argv(os.path.abspath(__file__), "--consume", *names),
                          env=harness.child_env(), stdin=None, stdout=None, stderr=None,
                          label="consumer")
    try:
        produce(lambda: token_batches(), names[0], "1. generator")
        reviews = ReviewsIterable()
        # Re-iterable: TensorProducer(reviews) would do. This callable also reshuffles it per
        # epoch, as one calls set_epoch() on a datasets.IterableDataset before each epoch.
        produce(lambda epoch: reviews.set_epoch(epoch) or reviews, names[1],
                "2. datasets-style iterable")
        if child.wait(timeout=60) != 0:
            raise SystemExit(f"the consumer failed (exit {child.returncode})")
    finally:
        if child.poll() is None:
            child.kill_tree()
            child.wait()
    used_up_generator()


if __name__ == "__main__":
    main()
