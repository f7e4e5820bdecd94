"""Hugging Face Accelerate's resume paths over a shared loader, under ``accelerate launch``.

    accelerate launch --multi_gpu --num_processes 2 accelerate_resume.py --name NAME
        --out PATH --mode skip|interrupt|resume|resume-skip [--samples 256] [--batch-size 32]
        [--skip 2] [--stop-after 2] [--state-dir DIR] [--shuffle] [--no-share]

Every rank does ``loader = tensorsocket.share(DataLoader(IdDataset(n), batch_size=B,
shuffle=S), name=NAME)`` (share() reads the rank and world size accelerate launch puts in
the environment), then ``accelerator.prepare(model, optimizer, loader)``, and one of:

- ``skip``: the resume idiom of accelerate's examples, ``accelerator.skip_first_batches(
  loader, k)``, iterated to its end (ids under ``skipped``): each rank must get the rest of
  its own part of the epoch, not of the whole dataset; before it, ``loader.batch_sampler``
  listed (under ``listed``), and after it one epoch of the loader itself (under ``train``,
  epoch 0): a shared loader's first epoch is the one it listed;
- ``interrupt``: ``accelerator.register_for_checkpointing(loader)``, train ``--stop-after``
  batches of epoch 0 (ids under ``train``), ``accelerator.save_state(DIR)``, exit;
- ``resume``: register the loader, ``accelerator.load_state(DIR)``, then the rest of epoch
  0 and epoch 1 (ids under ``train``): with the interrupted run's, every sample of epoch 0
  once, epoch 1 whole;
- ``resume-skip``: register the loader, ``accelerator.load_state(DIR)``, then
  ``skip_first_batches(loader, --stop-after)`` as accelerate's examples resume, iterated
  to its end (ids under ``train``, epoch 0): with the interrupted run's, every sample of
  epoch 0 once (the skipping loader is built from the restored consumer's
  ``batch_sampler``: the batches it delivered, then this rank's part of the rest).

The record of rank r goes to <out>.rank<r>.json (see _common.dump).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from _common import IdDataset, dump, ids_of, make_loader, own_loads  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--name", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--mode", choices=("skip", "interrupt", "resume", "resume-skip"),
                    required=True)
parser.add_argument("--samples", type=int, default=256)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--skip", type=int, default=2)
parser.add_argument("--stop-after", type=int, default=2)
parser.add_argument("--state-dir")
parser.add_argument("--shuffle", action="store_true")
parser.add_argument("--no-share", action="store_true",
                    default=os.environ.get("TS_TEST_NO_SHARE") == "1")
args = parser.parse_args()

accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
shared, meta = make_loader(
    DataLoader(IdDataset(args.samples), batch_size=args.batch_size, shuffle=args.shuffle),
    args.name, args.no_share)
model, optimizer, loader = accelerator.prepare(model, optimizer, shared)
meta["prepared_type"] = f"{type(loader).__module__}.{type(loader).__qualname__}"
meta["len"] = len(loader)
record: dict = {"rank": accelerator.process_index, "world": accelerator.num_processes,
                "mode": args.mode, "meta": meta, "train": {}}


def save() -> None:
    dump(args.out, record["rank"], record)


def step(x, y) -> list[int]:
    """One training step on a batch; its ids."""
    assert torch.equal(x[:, 0].long(), y), "features do not match the ids"
    optimizer.zero_grad()
    accelerator.backward(F.mse_loss(model(x).squeeze(1), y.float()))
    optimizer.step()
    return ids_of(y)


def skip() -> None:
    """accelerator.skip_first_batches(loader, k), iterated to its end."""
    record["own_loads_before_skip"] = own_loads()
    try:
        record["listed"] = [list(map(int, batch)) for batch in loader.batch_sampler]
        skipped = accelerator.skip_first_batches(loader, args.skip)
        record["skip_meta"] = {"type": f"{type(skipped).__module__}."
                                       f"{type(skipped).__qualname__}",
                               "len": len(skipped) if hasattr(skipped, "__len__") else None}
        record["skipped"] = [step(x, y) for x, y in skipped]
    except Exception as e:  # recorded for the test, which says what failed
        record["skip_error"] = "".join(traceback.format_exception_only(type(e), e)).strip()
        record["skip_traceback"] = traceback.format_exc()
    record["own_loads_after_skip"] = own_loads()
    record["train"]["0"] = [step(x, y) for x, y in loader]


def interrupt() -> None:
    """Train --stop-after batches of epoch 0, save_state, stop (a preempted job)."""
    accelerator.register_for_checkpointing(loader)
    got = record["train"].setdefault("0", [])
    for x, y in loader:
        got.append(step(x, y))
        if len(got) == args.stop_after:
            break
    accelerator.save_state(args.state_dir)
    record["saved_state"] = loader.state_dict() if hasattr(loader, "state_dict") else None


def resume() -> None:
    """load_state, then the rest of epoch 0 and epoch 1."""
    accelerator.register_for_checkpointing(loader)
    accelerator.load_state(args.state_dir)
    record["loaded_state"] = loader.state_dict() if hasattr(loader, "state_dict") else None
    for epoch in range(2):
        got = record["train"].setdefault(str(epoch), [])
        for x, y in loader:
            got.append(step(x, y))
        save()


def resume_skip() -> None:
    """load_state, then skip_first_batches(loader, --stop-after) to the end of epoch 0."""
    accelerator.register_for_checkpointing(loader)
    accelerator.load_state(args.state_dir)
    skipped = accelerator.skip_first_batches(loader, args.stop_after)
    record["train"]["0"] = [step(x, y) for x, y in skipped]


{"skip": skip, "interrupt": interrupt, "resume": resume, "resume-skip": resume_skip}[
    args.mode]()
accelerator.wait_for_everyone()
record["done"] = True
save()
print(f"accelerate_resume rank {record['rank']}: done", flush=True)
