"""PyTorch Lightning's own resume path over a shared loader: a run stopped mid-epoch with a
checkpoint, then ``trainer.fit(model, ckpt_path=...)`` in a new process.

    python lightning_resume.py --name NAME --out PATH --ckpt-dir DIR --stop-after K
                               [--run-on M]
    python lightning_resume.py --name NAME --out PATH --resume CKPT
        [--samples 256] [--batch-size 32] [--epochs 2] [--devices 1|2] [--no-share]

A linear model on IdDataset (sample i is x=[float(i)], y=i); ``train_dataloader()``
returns ``tensorsocket.share(DataLoader(ds, batch_size=B, shuffle=True), name=NAME)``.
``Trainer(max_epochs=E, accelerator="cpu", devices=D, strategy="ddp" if D == 2)``, no
logger, progress bar or sanity check.

- With --stop-after K: ``max_steps=K`` and ``ModelCheckpoint(dirpath=DIR,
  every_n_train_steps=K, filename="{step}")``: the run trains K batches of epoch 0,
  saves ``DIR/step=K.ckpt`` there (Lightning puts the loader's ``state_dict()`` in it)
  and stops, mid-epoch. With --run-on M (> K) it trains on to step M before it stops (a
  job that dies some time after its last checkpoint: the steps after it are lost).
- With --resume CKPT: ``trainer.fit(model, ckpt_path=CKPT)``, to the end of epoch E-1.

training_step records the ids of every batch per epoch under ``train`` ({epoch: [[ids of
a batch], ...]}); ``warnings`` holds every warning the run printed (category: message),
``checkpoint_loader_state`` the loader states the checkpoint holds (--resume). The
record of rank r goes to <out>.rank<r>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from _common import IdDataset, dump, ids_of, make_loader  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--name", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--stop-after", type=int)
parser.add_argument("--run-on", type=int)
parser.add_argument("--ckpt-dir")
parser.add_argument("--resume")
parser.add_argument("--samples", type=int, default=256)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--devices", type=int, default=1)
parser.add_argument("--no-share", action="store_true",
                    default=os.environ.get("TS_TEST_NO_SHARE") == "1")
args = parser.parse_args()
if (args.stop_after is None) == (args.resume is None) or \
        (args.stop_after is not None and not args.ckpt_dir):
    parser.error("give --stop-after K with --ckpt-dir DIR (the interrupted run), or "
                 "--resume CKPT (the resumed run)")

WARNINGS: list[str] = []
_show = warnings.showwarning


def _record_warning(message, category, filename, lineno, file=None, line=None):
    """Every warning shown goes into the record too (and is printed as usual)."""
    WARNINGS.append(f"{category.__name__}: {message}")
    _show(message, category, filename, lineno, file, line)


warnings.showwarning = _record_warning


class IdModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.record: dict = {"train": {}, "meta": {}, "warnings": WARNINGS,
                             "run": "resumed" if args.resume else "interrupted"}

    def train_dataloader(self):
        loader, meta = make_loader(
            DataLoader(IdDataset(args.samples), batch_size=args.batch_size, shuffle=True),
            args.name, args.no_share)
        self.record["meta"]["train"] = meta
        return loader

    def training_step(self, batch, batch_idx):
        x, y = batch
        assert torch.equal(x[:, 0].long(), y), "features do not match the ids"
        self.record["train"].setdefault(str(self.current_epoch), []).append(ids_of(y))
        return F.mse_loss(self.layer(x).squeeze(1), y.float())

    def on_train_epoch_start(self) -> None:
        meta = self.record["meta"].get("train")
        if meta is not None:  # len(loader) as the Trainer iterates it
            meta["len"] = len(self.trainer.train_dataloader)

    def on_train_epoch_end(self) -> None:
        self.save()

    def save(self) -> None:
        self.record["rank"] = self.global_rank
        self.record["world"] = self.trainer.world_size
        dump(args.out, self.global_rank, self.record)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-6)


def checkpoint_loader_state(path: str):
    """The loader states Lightning saved in the checkpoint (None: none saved)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    return ckpt["loops"]["fit_loop"]["state_dict"].get("combined_loader")


callbacks = []
if args.stop_after is not None:
    callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, filename="{step}",
                                     every_n_train_steps=args.stop_after, save_top_k=-1))
trainer = pl.Trainer(
    max_epochs=args.epochs,
    max_steps=(args.run_on or args.stop_after) if args.stop_after is not None else -1,
    accelerator="cpu",
    devices=args.devices,
    strategy="ddp" if args.devices > 1 else "auto",
    logger=False,
    enable_checkpointing=args.stop_after is not None,
    callbacks=callbacks,
    num_sanity_val_steps=0,
    enable_progress_bar=False,
    enable_model_summary=False,
)
model = IdModel()
if args.resume:
    model.record["checkpoint_loader_state"] = checkpoint_loader_state(args.resume)
trainer.fit(model, ckpt_path=args.resume)
model.record["done"] = True
model.save()
print(f"lightning_resume rank {trainer.global_rank}: done", flush=True)
