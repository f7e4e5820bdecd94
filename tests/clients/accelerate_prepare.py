"""Hugging Face Accelerate over a shared loader.

    python accelerate_prepare.py --name NAME --out PATH [--samples 64] [--skip 3] [--no-share]

``model, optimizer, loader = accelerator.prepare(model, optimizer, share(DataLoader(...)))``
on the CPU, two epochs (each must hold every sample exactly once); then the resume idiom
``accelerator.skip_first_batches(loader, k)`` for one more epoch, whose ids are recorded
under ``skipped`` (it must yield len(loader) - k batches of distinct samples).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from _common import IdDataset, dump, ids_of, make_loader, own_loads  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--name", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--samples", type=int, default=64)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--skip", type=int, default=3)
parser.add_argument("--no-share", action="store_true",
                    default=os.environ.get("TS_TEST_NO_SHARE") == "1")
args = parser.parse_args()

accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Linear(1, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
shared, meta = make_loader(DataLoader(IdDataset(args.samples), batch_size=8, shuffle=True),
                           args.name, args.no_share)
model, optimizer, loader = accelerator.prepare(model, optimizer, shared)
meta["prepared_type"] = f"{type(loader).__module__}.{type(loader).__qualname__}"
meta["prepared_is_same_object"] = loader is shared
record = {"rank": accelerator.process_index, "world": accelerator.num_processes, "meta": meta,
          "train": {}}


def run(batches, got: list) -> None:
    for x, y in batches:
        assert torch.equal(x[:, 0].long(), y), "features do not match the ids"
        got.append(ids_of(y))
        optimizer.zero_grad()
        accelerator.backward(F.mse_loss(model(x).squeeze(1), y.float()))
        optimizer.step()


for epoch in range(args.epochs):
    run(loader, record["train"].setdefault(str(epoch), []))
    dump(args.out, record["rank"], record)

# Resume: the first `skip` batches of this epoch were trained before a restart.
record["own_loads_before_skip"] = own_loads()
try:
    skipped = accelerator.skip_first_batches(loader, args.skip)
except Exception as e:  # recorded for the test, which says what failed
    import traceback

    record["skip_error"] = "".join(traceback.format_exception_only(type(e), e)).strip()
    record["skip_traceback"] = traceback.format_exc()
else:
    record["skip_meta"] = {
        "type": f"{type(skipped).__module__}.{type(skipped).__qualname__}",
        "is_same_object": skipped is loader,
        "len": len(skipped) if hasattr(skipped, "__len__") else None,
        "pid": os.getpid(),
    }
    for key in ("dataset", "batch_sampler", "sampler", "num_workers", "timeout", "collate_fn",
                "pin_memory", "drop_last", "batch_size"):
        record["skip_meta"][key] = repr(getattr(skipped, key, "<none>"))[:200]
    record["skipped"] = []
    dump(args.out, record["rank"], record)
    try:
        run(skipped, record["skipped"])
    except Exception as e:
        import traceback

        record["skip_error"] = "iterating it: " + "".join(
            traceback.format_exception_only(type(e), e)).strip()
        record["skip_traceback"] = traceback.format_exc()
record["own_loads_after_skip"] = own_loads()
record["done"] = True
dump(args.out, record["rank"], record)
print("accelerate_prepare: done", flush=True)
