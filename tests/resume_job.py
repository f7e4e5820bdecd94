"""A training job that is interrupted and resumed, as a user writes one: it takes some
batches, saves ``loader.state_dict()`` and exits; a later run loads the state and goes
on. Prints one JSON line: the sample ids of each batch per epoch, and the states saved.

python tests/resume_job.py NAME [--state-in F] [--take K] [--state-out F] [--epochs E]
                           [--samples N] [--batch-size B] [--own-batch-size B2]
                           [--no-shuffle] [--rank R --world-size W] [--iterable]
                           [--producer-name P]

--state-in F: load_state_dict(json of F) before iterating; the state right after it is
  printed as ``state_after_load``.
--bad-state F (repeatable): then load_state_dict(json of F) too, each expected to be
  refused; printed as ``bad_states``, each {"refused": "<error type>: <message>"} or
  {"accepted": state_dict() after it}.
--take K: take K batches of the first epoch, break, save state_dict() to --state-out
  (the state after the break; with --save-inside, the state taken in the loop after the
  K-th batch), exit. Without it: iterate --epochs whole epochs.
--iterable: the loader is a plain list of batches (no sampler: resume by count).
--generator-iter: a DataLoader subclass whose __iter__ is a generator.
--workers W: the DataLoader runs W persistent workers.
--warm-epochs N: N whole epochs are read first (their ids are printed as epochs too).
--interrupt-deal N: a KeyboardInterrupt lands in next() at the N-th call of the resumed
  group epoch's deal; the loop catches it and goes on (interrupts are counted).
--producer-name P: attach with TensorConsumer(name=P) to a producer started elsewhere
  (tests/resume_producer.py) instead of share().
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

import tensorsocket
from tensorsocket import TensorConsumer
from tensorsocket.data import resume


def _interrupt_at(owner: type, method: str, call: int) -> None:
    """The `call`-th call of owner.method raises KeyboardInterrupt before it runs, as a
    SIGINT landing at that call would."""
    real, calls = getattr(owner, method), [0]

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    setattr(owner, method, interrupted)


class GeneratorLoader(DataLoader):
    """A DataLoader subclass whose __iter__ is a generator (as accelerate's
    DataLoaderShard): it draws its first indices at the first next(), not at iter()."""

    def __iter__(self):
        yield from super().__iter__()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--state-in")
    ap.add_argument("--bad-state", action="append", default=[])
    ap.add_argument("--state-out")
    ap.add_argument("--take", type=int)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--own-batch-size", type=int)
    ap.add_argument("--no-shuffle", action="store_true")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world-size", type=int)
    ap.add_argument("--iterable", action="store_true")
    ap.add_argument("--producer-name")
    ap.add_argument("--workers", type=int, default=0,
                    help="loader workers (persistent_workers=True)")
    ap.add_argument("--warm-epochs", type=int, default=0,
                    help="whole epochs read before the --take epoch")
    ap.add_argument("--interrupt-deal", type=int, default=0,
                    help="a KeyboardInterrupt at this call of the resumed deal")
    ap.add_argument("--generator-iter", action="store_true",
                    help="a DataLoader subclass whose __iter__ is a generator")
    ap.add_argument("--save-inside", action="store_true",
                    help="save the state inside the loop, after the --take-th batch")
    a = ap.parse_args()

    extra: dict = {}
    if a.world_size is not None:
        extra.update(rank=a.rank, world_size=a.world_size, group=f"{a.name}-group")
    if a.own_batch_size is not None:
        extra["batch_size"] = a.own_batch_size
    if a.producer_name is not None:
        loader = TensorConsumer(name=a.producer_name, timeout=60, **extra)
    else:
        data = TensorDataset(torch.arange(a.samples))
        if a.iterable:
            source = [(torch.arange(i, min(i + a.batch_size, a.samples)),)
                      for i in range(0, a.samples, a.batch_size)]
        else:
            kind = GeneratorLoader if a.generator_iter else DataLoader
            workers = {"num_workers": a.workers, "persistent_workers": True} \
                if a.workers else {}
            source = kind(data, batch_size=a.batch_size, shuffle=not a.no_shuffle, **workers)
        loader = tensorsocket.share(source, name=a.name, timeout=60, **extra)

    if a.interrupt_deal:
        _interrupt_at(resume.EpochTaken, "deal", a.interrupt_deal)
    out: dict = {"epochs": [], "warnings": [], "interrupts": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if a.state_in:
            with open(a.state_in) as f:
                loader.load_state_dict(json.load(f))
        out["bad_states"] = []
        for path in a.bad_state:
            with open(path) as f:
                bad = json.load(f)
            try:
                loader.load_state_dict(bad)
            except Exception as e:  # (what the test checks: its type and message)
                out["bad_states"].append({"refused": f"{type(e).__name__}: {e}"})
            else:
                out["bad_states"].append({"accepted": loader.state_dict()})
        if a.state_in or a.bad_state:
            out["state_after_load"] = loader.state_dict()
        for _ in range(a.warm_epochs):  # whole epochs before the one interrupted
            out["epochs"].append([[int(v) for v in batch[0]] for batch in loader])
        for _ in range(1 if a.take is not None else a.epochs):
            epoch = []
            it = iter(loader)
            while True:
                try:
                    batch = next(it)
                except StopIteration:
                    break
                except KeyboardInterrupt:  # a Ctrl-C the loop catches, going on
                    out["interrupts"] += 1
                    continue
                epoch.append([int(v) for v in batch[0]])
                del batch
                if a.take is not None and len(epoch) == a.take:
                    if a.save_inside:  # as a checkpoint callback at a step's end does
                        out["state"] = loader.state_dict()
                    break
            out["epochs"].append(epoch)
        if a.take is not None:
            state = out["state"] if a.save_inside else loader.state_dict()
            json.dumps(state)  # JSON-serialisable, as a checkpoint needs
            with open(a.state_out, "w") as f:
                json.dump(state, f)
            out["state"] = state
    out["warnings"] = [str(w.message) for w in caught
                       if issubclass(w.category, tensorsocket.TensorSocketWarning)]
    out["len"] = len(loader)
    out["producer_pid"] = loader.producer_pid
    loader.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
