"""A torch DDP training script, run by torchrun (or alone, as one process).

    python -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 \\
        --master_port PORT ddp_torchrun.py --name NAME --out PATH [--samples 128]
    python ddp_torchrun.py --name NAME --out PATH      # one process, no process group

(--no-share, the baseline, gives the DataLoader a DistributedSampler under torchrun.)
Under torchrun (RANK / WORLD_SIZE set) it initialises a gloo process group and calls
``loader = tensorsocket.share(DataLoader(ds, batch_size=8, shuffle=True), name=NAME)``
on every rank: the library is to split the stream between the ranks of this job, as a
DistributedSampler would. Per epoch it calls ``loader.sampler.set_epoch(epoch)`` as DDP
scripts do, and every step all-reduces (DDP's gradient all-reduce and one more), so
ranks with unequal batch counts hang or fail in the collective. ``--gloo-timeout``
bounds that. Each rank writes <out>.rank<r>.json after every epoch.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from _common import STORE, IdDataset, dump, ids_of, make_loader  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--name", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--samples", type=int, default=128)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--gloo-timeout", type=float, default=30)
parser.add_argument("--node-shard", action="store_true",
                    help="several nodes: the loader reads this node's part of the data "
                         "(DistributedSampler over the nodes), shared by the node's ranks")
parser.add_argument("--no-share", action="store_true",
                    default=os.environ.get("TS_TEST_NO_SHARE") == "1")
args = parser.parse_args()

world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
distributed = world > 1
if distributed:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.gloo_timeout))
    assert dist.get_rank() == rank and dist.get_world_size() == world

torch.manual_seed(0)
if (args.no_share or STORE) and distributed:
    # The baseline: what the script does without tensorsocket, a DistributedSampler.
    from torch.utils.data.distributed import DistributedSampler

    ds = IdDataset(args.samples)
    plain = DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds, shuffle=True))
elif args.node_shard:
    from torch.utils.data.distributed import DistributedSampler

    nodes = world // int(os.environ["LOCAL_WORLD_SIZE"])
    ds = IdDataset(args.samples)
    plain = DataLoader(ds, batch_size=8, sampler=DistributedSampler(
        ds, num_replicas=nodes, rank=int(os.environ["GROUP_RANK"]), shuffle=True))
else:
    plain = DataLoader(IdDataset(args.samples), batch_size=8, shuffle=True)
loader, meta = make_loader(plain, args.name, args.no_share)
meta["env"] = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                              "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                              "TORCHELASTIC_RUN_ID", "GROUP_RANK")}
model = torch.nn.Linear(1, 1)
if distributed:
    model = DDP(model)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
record = {"rank": rank, "world": world, "meta": meta, "train": {}}
dump(args.out, rank, record)

for epoch in range(args.epochs):
    if distributed:
        try:
            loader.sampler.set_epoch(epoch)
        except Exception as e:
            record["set_epoch_error"] = f"{type(e).__name__}: {e}"
            record["set_epoch_traceback"] = traceback.format_exc()
            dump(args.out, rank, record)
            raise
    got = record["train"].setdefault(str(epoch), [])
    for x, y in loader:
        assert torch.equal(x[:, 0].long(), y), "features do not match the ids"
        got.append(ids_of(y))
        optimizer.zero_grad()
        F.mse_loss(model(x).squeeze(1), y.float()).backward()  # DDP all-reduces the grads
        optimizer.step()
        if distributed:
            step = torch.ones(1)
            dist.all_reduce(step)  # every rank takes this step, or this waits
            assert step.item() == world
        dump(args.out, rank, record)
    # How many batches did each rank take this epoch? (Equal, or the collectives above
    # would have hung; recorded so that the test can say so.)
    if distributed:
        counts = [None] * world
        dist.all_gather_object(counts, len(got))
        record.setdefault("batches_per_rank", {})[str(epoch)] = counts
    dump(args.out, rank, record)

if distributed:
    dist.barrier()
    dist.destroy_process_group()
record["done"] = True
dump(args.out, rank, record)
print(f"ddp_torchrun rank {rank}/{world}: done", flush=True)
