"""PyTorch Lightning ``Trainer.fit`` over shared loaders.

    python lightning_fit.py --name NAME --out PATH [--val-name VNAME] [--devices 1|2]
                            [--samples 64] [--val-samples 48] [--no-share]
                            [--step-sleep SECONDS]

A linear model on IdDataset (sample i is x=[float(i)], y=i). ``train_dataloader()``
returns ``tensorsocket.share(DataLoader(ds, batch_size=8, shuffle=True), name=NAME)``;
with --val-name, ``val_dataloader()`` returns a shared DataLoader(shuffle=False) of
another IdDataset (ids 10000..) under that name. ``Trainer(max_epochs=2,
accelerator="cpu", devices=D, strategy="ddp" if D == 2)`` (gloo on the CPU; Lightning
starts rank 1 itself, running this script again), no logger, checkpointing or progress
bar, and the default sanity check (2 validation batches before training).

training_step / validation_step record the ids of every batch per (rank, epoch): the
record of rank r goes to <out>.rank<r>.json, with ``train`` and ``val`` as {epoch:
[[ids of a batch], ...]} and ``sanity`` the batches of the sanity check.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning.pytorch as pl  # noqa: E402

from _common import IdDataset, dump, ids_of, make_loader  # noqa: E402

VAL_OFFSET = 10000

parser = argparse.ArgumentParser()
parser.add_argument("--name", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--val-name")
parser.add_argument("--devices", type=int, default=1)
parser.add_argument("--samples", type=int, default=64)
parser.add_argument("--val-samples", type=int, default=48)
parser.add_argument("--epochs", type=int, default=2)
# Seconds each training step sleeps (a model that takes time): a job's epochs last longer,
# so that jobs started together overlap even where one of them starts much later.
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--no-share", action="store_true",
                    default=os.environ.get("TS_TEST_NO_SHARE") == "1")
args = parser.parse_args()


class IdModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.record: dict = {"train": {}, "val": {}, "sanity": [], "meta": {}}

    # -- data --------------------------------------------------------------------------

    def train_dataloader(self):
        loader, meta = make_loader(
            DataLoader(IdDataset(args.samples), batch_size=8, shuffle=True), args.name,
            args.no_share)
        self.record["meta"]["train"] = meta
        return loader

    def _val_dataloader(self):
        loader, meta = make_loader(
            DataLoader(IdDataset(args.val_samples, offset=VAL_OFFSET), batch_size=8,
                       shuffle=False), args.val_name, args.no_share)
        self.record["meta"]["val"] = meta
        return loader

    # -- steps -------------------------------------------------------------------------

    def _save(self) -> None:
        self.record["rank"] = self.global_rank
        self.record["world"] = self.trainer.world_size
        dump(args.out, self.global_rank, self.record)

    def training_step(self, batch, batch_idx):
        x, y = batch
        assert torch.equal(x[:, 0].long(), y), "features do not match the ids"
        self.record["train"].setdefault(str(self.current_epoch), []).append(ids_of(y))
        if args.step_sleep:
            time.sleep(args.step_sleep)
        return F.mse_loss(self.layer(x).squeeze(1), y.float())

    def validation_step(self, batch, batch_idx):
        x, y = batch
        assert torch.equal(x[:, 0].long(), y), "features do not match the ids"
        if self.trainer.sanity_checking:
            self.record["sanity"].append(ids_of(y))
        else:
            self.record["val"].setdefault(str(self.current_epoch), []).append(ids_of(y))
        return F.mse_loss(self.layer(x).squeeze(1), y.float())

    # len(loader) as the Trainer iterates it (without tensorsocket, Lightning's DDP swaps
    # in a DistributedSampler after train_dataloader(), so it differs from the len() at
    # share time, kept as len_at_share).
    def on_train_epoch_start(self) -> None:
        self._note_len("train", self.trainer.train_dataloader)

    def on_validation_epoch_start(self) -> None:
        if not self.trainer.sanity_checking:
            self._note_len("val", self.trainer.val_dataloaders)

    def _note_len(self, key: str, loader) -> None:
        meta = self.record["meta"].get(key)
        if meta is not None:
            meta.setdefault("len_at_share", meta["len"])
            try:
                meta["len"] = len(loader)
            except TypeError as e:
                meta["len"] = f"TypeError: {e}"
            meta["trainer_loader_type"] = f"{type(loader).__module__}.{type(loader).__qualname__}"

    def on_train_epoch_end(self) -> None:
        self._save()

    def on_validation_epoch_end(self) -> None:
        self._save()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-6)


if args.val_name:
    IdModel.val_dataloader = IdModel._val_dataloader

trainer = pl.Trainer(
    max_epochs=args.epochs,
    accelerator="cpu",
    devices=args.devices,
    strategy="ddp" if args.devices > 1 else "auto",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
model = IdModel()
trainer.fit(model)
model.record["done"] = True
model._save()
print(f"lightning_fit rank {trainer.global_rank}: done", flush=True)
