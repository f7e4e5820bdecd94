"""A Hugging Face ``datasets.Dataset`` (torch format) behind a shared DataLoader.

    python hf_datasets.py --name NAME --out PATH [--samples 64] [--no-share]

Batches are dicts {'id': int64[B], 'x': float32[B, 2]} made by default_collate; two
epochs, each must hold every id exactly once.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import datasets  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from _common import dump, ids_of, make_loader  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--name", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--samples", type=int, default=64)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--no-share", action="store_true",
                    default=os.environ.get("TS_TEST_NO_SHARE") == "1")
args = parser.parse_args()

n = args.samples
ds = datasets.Dataset.from_dict(
    {"id": list(range(n)), "x": [[float(i), float(-i)] for i in range(n)]}).with_format("torch")
torch.manual_seed(0)
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
loader, meta = make_loader(DataLoader(ds, batch_size=8, shuffle=True), args.name, args.no_share)
record = {"rank": 0, "world": 1, "meta": meta, "train": {}}
for epoch in range(args.epochs):
    got = record["train"].setdefault(str(epoch), [])
    for batch in loader:
        assert isinstance(batch, dict) and set(batch) == {"id", "x"}, type(batch)
        ids, x = batch["id"], batch["x"]
        assert torch.equal(x[:, 0].long(), ids), "features do not match the ids"
        got.append(ids_of(ids))
        optimizer.zero_grad()
        F.mse_loss(model(x).squeeze(1), ids.float()).backward()
        optimizer.step()
    dump(args.out, 0, record)
record["done"] = True
dump(args.out, 0, record)
print("hf_datasets: done", flush=True)
