"""Train a torchvision ResNet-18 on JPEG files, alone or sharing one DataLoader with others.

train_alone.py and train_shared.py differ in one line, the one that makes the loader
(``diff examples/train_alone.py examples/train_shared.py``):

    # one training with its own DataLoader (2 worker processes decoding JPEGs)
    python examples/train_alone.py

    # three trainings (three learning rates), ONE DataLoader: the first process that calls
    # tensorsocket.share() forks a producer process that runs the loader; every training
    # reads the batches from shared memory
    python examples/train_shared.py --lr 0.1 & python examples/train_shared.py --lr 0.05 &
    python examples/train_shared.py --lr 0.02; wait

What to look at: each training prints which vision library it uses, its loader (a
DataLoader, or a TensorConsumer and the pid of the producer it reads from: the same for all
three, started by one of them), then per epoch its batches, samples, mean loss, accuracy and
seconds. Shared, every epoch still has every sample once; a training that starts while the
others are mid-epoch joins as a late joiner, so its epochs start mid-way through the
producer's (see docs/usage.md, "What a consumer gets"). The loss goes down in both files: the
data are the same. The producer process is not a child of any training: it ends by itself
60 s after the last training left (share()'s idle_timeout, or $TENSORSOCKET_IDLE_TIMEOUT);
its log is named above.

The data: 10 classes x --images JPEGs of --image-size pixels, written once by _data.py into
a temporary directory (reused by later runs; --data DIR to choose it), decoded and augmented
by the loader (RandomResizedCrop, flip, ToTensor, Normalize). torchvision is used where it
imports; where it does not (not installed, or built for another torch), examples/_vision.py
supplies the same names with the same semantics. Defaults: 320 images, 64 px crops, batches
of 32, 2 epochs, one torch thread per training: about 10 s alone on 2 CPU cores, 20 s for
the three shared trainings.
"""

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from tensorsocket import share  # noqa: F401 (unused in train_alone.py: the files differ in 1 line)

try:  # torchvision where it imports, else the stand-in next to this file (same names)
    import torchvision
    from torchvision import datasets, models, transforms

    VISION = f"torchvision {torchvision.__version__}"
except Exception as e:  # not installed, or a build for another torch ("torchvision::nms ...")
    from _vision import datasets, models, transforms

    VISION = f"examples/_vision.py, as torchvision does not import here ({e!r:.100})"

from _data import image_folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--images", type=int, default=32, help="JPEGs per class (10 classes)")
    ap.add_argument("--image-size", type=int, default=256, help="JPEG width and height")
    ap.add_argument("--crop", type=int, default=64, help="RandomResizedCrop size")
    ap.add_argument("--data", help="directory for the JPEGs (default: a reused temp dir)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of this training")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    me = f"[pid {os.getpid()} lr {args.lr}]"
    print(f"{me} vision: {VISION}", flush=True)

    root = image_folder(args.images, args.image_size, args.data)
    augment = transforms.Compose([
        transforms.RandomResizedCrop(args.crop, scale=(0.25, 1.0)),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    ])
    images = datasets.ImageFolder(root, transform=augment)
    loader = share(DataLoader(images, batch_size=32, shuffle=True, num_workers=2), name="resnet18")
    print(f"{me} data: {len(images)} JPEGs in {root}; loader: {describe(loader)}", flush=True)

    model = models.resnet18(num_classes=len(images.classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        model.train()
        t0, batches, samples, loss_sum, correct = time.perf_counter(), 0, 0, 0.0, 0
        for x, y in loader:
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            batches += 1
            samples += len(y)
            loss_sum += loss.item() * len(y)
            correct += int((logits.argmax(1) == y).sum())
        print(f"{me} epoch {epoch}/{args.epochs}: {batches} batches, {samples} samples, "
              f"loss {loss_sum / samples:.3f}, accuracy {correct / samples:.0%}, "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    print(f"{me} done: {args.epochs} epochs in {time.perf_counter() - start:.1f} s", flush=True)


def describe(loader) -> str:
    """What the training iterates: its own DataLoader, or a shared producer's batches."""
    pid = getattr(loader, "producer_pid", None)  # a TensorConsumer knows its producer
    if pid is None:
        return f"{type(loader).__name__}, {len(loader)} batches per epoch, made by its workers"
    started = "started by this process" if loader.started_producer else "already running"
    return (f"TensorConsumer, {len(loader)} batches per epoch, from producer pid {pid} "
            f"({started}; its log: {loader.producer_log})")


if __name__ == "__main__":
    main()
