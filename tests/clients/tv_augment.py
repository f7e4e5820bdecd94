"""A training job with its own torchvision augmentation over a shared ImageFolder (issue 27).

    python tv_augment.py --root DIR --name NAME --out PATH --variant A|B|C|timm
        [--seed S] [--epochs E] [--min-consumers K] [--cache-bytes N]
        [--transform-workers K]
    python tv_augment.py --write-images DIR [--count N]

The split a user makes in one line: the job writes its whole torchvision pipeline, as for
its own DataLoader, and ``tensorsocket.split_transform()`` cuts it: the dataset does the
shared, deterministic part (decode, ``v2.Resize((72, 72))``, ``v2.PILToTensor()``: a uint8
CHW sample), run once by the shared producer; ``share(..., transform=)`` runs the job's
own random part on each sample in this process. The variants (after the shared part):

- A: RandomResizedCrop(64), RandomHorizontalFlip, ToDtype(float32, scale), Normalize
- B: RandomResizedCrop(56), ColorJitter(0.4, 0.4, 0.4), ToDtype(float32, scale)
- C: RandomResizedCrop(48), RandomGrayscale(p=1), ToDtype(float32, scale)
- timm: ``timm.data.create_transform(48, is_training=True)``, on PIL images
  (``transform_input="pil"``; a PIL pipeline: the dataset gets the shared part as is)
- wrong: RandomResizedCrop(48), Normalize: a transform that cannot run on the shared
  uint8 samples (Normalize wants floats: ToDtype is missing)

Writes ``<out>.rank0.json`` (after every epoch, see _common.dump): per epoch the ids of
each batch, the output shapes and dtypes, a checksum of each sample's output (by id) and
what the variants leave behind (value range, whether the channels are equal); the
transforms' names on each side of the split; the
producer's pid and log; how many samples this process loaded itself.

Every load of a sample appends ``<pid> <index>`` to ``$TS_TEST_LOADS``, <pid> being the
process that runs the DataLoader: a DataLoader worker writes its parent's pid (the
producer's, in a shared run).

``--write-images`` makes the tests' ImageFolder (write_jpeg_folder(): PIL and numpy only).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, get_worker_info  # noqa: E402

from _common import dump, ids_of, own_loads  # noqa: E402

SHARED_SIZE = 72  # the shared prefix's Resize
OUTPUT_SIZE = {"A": 64, "B": 56, "C": 48, "timm": 48, "wrong": 48}
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def write_jpeg_folder(root: Path, n: int = 96, classes: int = 3, seed: int = 0) -> list[tuple[int, int]]:
    """n JPEGs of varied sizes (80..140 px each side) in `classes` class folders under root,
    each a colour gradient with noise (the channels differ, so a grayscale output shows);
    their (width, height)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = []
    for i in range(n):
        w, h = (int(v) for v in rng.integers(80, 141, size=2))
        yy, xx = np.mgrid[0:h, 0:w]
        base = rng.uniform(0, 255, size=3)
        slope = rng.uniform(-1.5, 1.5, size=(3, 2))
        image = np.stack([base[c] + slope[c, 0] * xx + slope[c, 1] * yy for c in range(3)], -1)
        image += rng.normal(0, 12, size=image.shape)
        folder = root / f"class{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.clip(image, 0, 255).astype(np.uint8), "RGB").save(
            folder / f"img{i:04d}.jpg", quality=90)
        sizes.append((w, h))
    return sizes


def log_load(index: int) -> None:
    """Append "<pid> <index>" to $TS_TEST_LOADS (pid: the process running the DataLoader)."""
    path = os.environ.get("TS_TEST_LOADS")
    if not path:
        return
    owner = os.getppid() if get_worker_info() is not None else os.getpid()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"%d %d\n" % (owner, index))
    finally:
        os.close(fd)


def make_dataset(root: str, shared: Any) -> Any:
    """The ImageFolder with the shared part as its transform, yielding (img, target,
    index)."""
    from torchvision.datasets import ImageFolder

    class IndexedImageFolder(ImageFolder):
        """ImageFolder whose samples also carry their index; every load is logged."""

        def __getitem__(self, index: int) -> tuple[Any, int, int]:
            img, target = super().__getitem__(index)
            log_load(index)
            return img, target, index

    return IndexedImageFolder(root, transform=shared)


def make_transforms(variant: str) -> tuple[Any, Callable[[Any], torch.Tensor], str]:
    """The shared part (the dataset's transform), the job's own per-sample transform, and
    the transform_input that takes."""
    import tensorsocket
    from torchvision.transforms import v2

    shared = [v2.Resize((SHARED_SIZE, SHARED_SIZE)), v2.PILToTensor()]
    if variant == "timm":
        import timm.data

        own = timm.data.create_transform(OUTPUT_SIZE["timm"], is_training=True)
        return v2.Compose(shared), own, "pil"
    as_float = v2.ToDtype(torch.float32, scale=True)
    crop = v2.RandomResizedCrop(OUTPUT_SIZE[variant])
    augment = {
        "A": [crop, v2.RandomHorizontalFlip(), as_float, v2.Normalize(MEAN, STD)],
        "B": [crop, v2.ColorJitter(0.4, 0.4, 0.4), as_float],
        "C": [crop, v2.RandomGrayscale(p=1.0), as_float],
        "wrong": [crop, v2.Normalize(MEAN, STD)],
    }[variant]
    # The one line: the whole pipeline, as this job would give its own DataLoader, cut.
    dataset_part, own = tensorsocket.split_transform(v2.Compose(shared + augment))
    return dataset_part, own, "tensor"


def step_names(pipeline: Any) -> list[str]:
    """The class names of a Compose's transforms."""
    return [type(t).__name__ for t in getattr(pipeline, "transforms", [pipeline])]


def checksum(sample: torch.Tensor) -> str:
    """A digest of one output sample's bytes."""
    return hashlib.sha1(sample.contiguous().numpy().tobytes()).hexdigest()[:16]


class EpochRecord:
    """What one epoch delivered: batch ids, shapes, per-id checksums, value statistics."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.shapes: set[tuple] = set()
        self.dtypes: set[str] = set()
        self.checksums: dict[str, str] = {}
        self.low, self.high = float("inf"), float("-inf")
        self.equal_channels = 0
        self.wrong_targets = 0

    def add(self, x: torch.Tensor, target: torch.Tensor, index: torch.Tensor,
            targets: list[int]) -> None:
        ids = ids_of(index)
        self.batches.append(ids)
        self.shapes.add(tuple(x.shape[1:]))
        self.dtypes.add(str(x.dtype))
        for row, i in enumerate(ids):
            self.checksums[str(i)] = checksum(x[row])
            self.equal_channels += int(torch.equal(x[row, 0], x[row, 1])
                                       and torch.equal(x[row, 1], x[row, 2]))
            self.wrong_targets += int(int(target[row]) != targets[i])
        self.low, self.high = min(self.low, float(x.min())), max(self.high, float(x.max()))

    def as_dict(self) -> dict:
        return {"batches": self.batches, "shapes": sorted(self.shapes),
                "dtypes": sorted(self.dtypes), "checksums": self.checksums,
                "min": self.low, "max": self.high, "equal_channels": self.equal_channels,
                "wrong_targets": self.wrong_targets}


def read_producer_log(path: str) -> str | None:
    """The producer's log as it is now (a producer that ends cleanly removes it: the job
    reads it after its first epoch, while the producer still serves the next)."""
    try:
        return Path(path).read_text()
    except OSError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--write-images", metavar="DIR", type=Path,
                        help="write the ImageFolder of --count JPEGs to DIR, and exit")
    parser.add_argument("--count", type=int, default=96)
    parser.add_argument("--root")
    parser.add_argument("--name")
    parser.add_argument("--out")
    parser.add_argument("--variant", choices=sorted(OUTPUT_SIZE))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--min-consumers", type=int, default=1)
    parser.add_argument("--cache-bytes", type=int, default=None)
    parser.add_argument("--transform-workers", type=int, default=0)
    args = parser.parse_args()
    if args.write_images is not None:
        write_jpeg_folder(args.write_images, n=args.count)
        return
    if None in (args.root, args.name, args.out, args.variant):
        parser.error("--root, --name, --out and --variant are required")

    import tensorsocket

    shared, transform, transform_input = make_transforms(args.variant)
    dataset = make_dataset(args.root, shared)
    options: dict[str, Any] = dict(name=args.name, transform=transform, seed=args.seed,
                                   transform_input=transform_input, epochs=args.epochs,
                                   min_consumers=args.min_consumers,
                                   transform_workers=args.transform_workers)
    if args.cache_bytes is not None:  # the producer's decoded-sample cache
        options["cache_bytes"] = args.cache_bytes
    loader = tensorsocket.share(DataLoader(dataset, batch_size=8, shuffle=True,
                                           num_workers=1), **options)
    record: dict[str, Any] = {
        "pid": os.getpid(), "variant": args.variant, "seed": args.seed,
        "producer_pid": getattr(loader, "producer_pid", None),
        "producer_log": str(getattr(loader, "producer_log", None)),
        "started_producer": getattr(loader, "started_producer", None),
        "dataset_len": len(dataset), "len": len(loader),
        "split": [step_names(shared), step_names(transform)], "epochs": {}}
    dump(args.out, 0, record)  # the producer's pid, for a test whose job fails
    for epoch in range(args.epochs):
        got = EpochRecord()
        for x, target, index in loader:
            got.add(x, target, index, dataset.targets)
        record["epochs"][str(epoch)] = got.as_dict()
        if epoch == 0:
            record["producer_log_text"] = read_producer_log(record["producer_log"])
        dump(args.out, 0, record)
    record["own_loads"] = own_loads()
    record["done"] = True
    dump(args.out, 0, record)
    print(json.dumps({"done": True, "pid": os.getpid()}), flush=True)


if __name__ == "__main__":
    main()
