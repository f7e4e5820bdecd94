#!/usr/bin/env python3
"""One training job with timm's train.py loader path and the one-line tensorsocket swap.

Run by scripts/timm_check.py inside its venv (torch 2.14.1, torchvision, timm). The data
is a folder of generated images read with ``timm.data.create_dataset`` as train.py reads
``--data-dir``: each image is one flat colour, a code of its sample id, so the id survives
timm's crops, flips and resizes; the codes are chosen so that the sum of two codes names
the pair, so ids also come back from FastCollateMixup's batches, which mix image i with
image B-1-i (mixup blends them, cutmix pastes a box of one into the other: either way the
two images add up, pixel by pixel, to the sum of the two codes). The job writes a JSON
result: ids seen per epoch, target shapes, whether images were mixed, warnings, errors.

    python scripts/timm_job.py --make-data DIR [--images 128]
    python scripts/timm_job.py --combo NAME --name SHARE_NAME --data DIR --out RESULT.json
        [--no-prefetcher] [--mixup] [--multi-epochs-loader] [--options '{"copy": true}']
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
import traceback
import warnings
from pathlib import Path

NUM_CLASSES = 10
IMAGE_SIDE = 80
INPUT_SIZE = (3, 64, 64)
TOL = 2.5  # colour units, a flat image from its code (interpolation stays inside this)
SUM_TOL = 1.4  # a mixed pair's sum from the two codes' (mixup rounds each image: <= 1)


def codes(n: int, apart: int = 8, sums_apart: int = 3) -> list[tuple[int, int, int]]:
    """n RGB codes at least `apart` from each other (L-inf), whose pairwise sums (a code
    with itself included) are at least `sums_apart` from each other: a pair's sum is
    off by at most 1 after mixup's rounding, so it still names the pair."""
    rng = random.Random(1234)
    picked: list[tuple[int, int, int]] = []
    sums: dict[tuple[int, ...], list[tuple[int, ...]]] = {}

    def dist(v: tuple, w: tuple) -> int:
        """L-inf distance."""
        return max(abs(a - b) for a, b in zip(v, w))

    def taken(v: tuple) -> bool:
        """Whether a sum closer than sums_apart to v is already there."""
        key = [c // sums_apart for c in v]
        return any(dist(v, w) < sums_apart
                   for dx in (-1, 0, 1) for dy in (-1, 0, 1) for dz in (-1, 0, 1)
                   for w in sums.get((key[0] + dx, key[1] + dy, key[2] + dz), ()))

    while len(picked) < n:
        c = tuple(rng.randrange(8, 248) for _ in range(3))
        if any(dist(c, o) < apart for o in picked):
            continue
        new = [tuple(a + b for a, b in zip(c, o)) for o in picked + [c]]
        if any(taken(v) for v in new) or any(
                dist(v, w) < sums_apart for i, v in enumerate(new) for w in new[i + 1:]):
            continue
        picked.append(c)
        for v in new:
            sums.setdefault(tuple(x // sums_apart for x in v), []).append(v)
    return picked


def make_data(root: Path, images: int) -> None:
    """A create_dataset() folder: root/train/c<k>/<id>.png, id's class is id % 10."""
    from PIL import Image
    for i, colour in enumerate(codes(images)):
        folder = root / "train" / f"c{i % NUM_CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), colour).save(folder / f"{i:04d}.png")
    (root / "count").write_text(str(images))


class Decoder:
    """Sample ids back from a batch's input tensor (normalised with mean/std)."""

    def __init__(self, n: int, mean, std) -> None:
        """Tables for n codes and the loader's normalisation."""
        import torch
        self.codes = torch.tensor(codes(n), dtype=torch.float64)  # (n, 3)
        i, j = torch.triu_indices(n, n)
        self.pairs = list(zip(i.tolist(), j.tolist()))
        self.sums = self.codes[i] + self.codes[j]  # (pairs, 3)
        self.mean = torch.tensor(mean, dtype=torch.float64).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(std, dtype=torch.float64).view(1, 3, 1, 1) * 255

    def colours(self, x):
        """The batch in colour units (B, 3, H, W), as float64."""
        return x.detach().to("cpu", dtype=self.mean.dtype) * self.std + self.mean

    def flat(self, u) -> list[int | None]:
        """Per image: the id whose code it is everywhere, or None (a mixed image)."""
        out = []
        for img in u:
            centre = img.flatten(1).mean(1)
            dist = (self.codes - centre).abs().max(1).values
            k = int(dist.argmin())
            ok = (img - self.codes[k].view(3, 1, 1)).abs().max() <= TOL
            out.append(k if ok else None)
        return out

    def paired(self, u) -> list[int | None]:
        """Ids of a batch mixed as FastCollateMixup's 'batch' mode does (i with B-1-i)."""
        b = u.shape[0]
        out: list[int | None] = []
        for k in range((b + 1) // 2):
            l_ = b - 1 - k
            if k == l_:
                out += self.flat(u[k:k + 1])
                continue
            s = (u[k] + u[l_]).flatten(1).mean(1)
            dist = (self.sums - s).abs().max(1).values
            m = int(dist.argmin())
            out += list(self.pairs[m]) if dist[m] <= SUM_TOL else [None, None]
        return out


def train(args: argparse.Namespace) -> dict:
    """train.py's data and loop parts around tensorsocket.share(); the job's findings."""
    t0 = time.monotonic()
    import torch
    import timm
    from timm.data import (FastCollateMixup, Mixup, create_dataset, create_loader,
                           resolve_data_config)
    from timm.loss import SoftTargetCrossEntropy

    import tensorsocket

    res: dict = {"epochs": [], "problems": [], "warnings": []}
    seen_warnings: list[str] = []

    def keep(message, category, filename, lineno, file=None, line=None):
        """Collect warnings (the TensorSocketWarning text, shortened) instead of printing."""
        text = f"{category.__name__}: {str(message)[:140]}"
        if text not in seen_warnings:
            seen_warnings.append(text)
        print(f"warning: {category.__name__}: {message}", file=sys.stderr)

    warnings.showwarning = keep
    warnings.simplefilter("always")
    torch.manual_seed(0)
    device = torch.device("cpu")
    n_images = int((Path(args.data) / "count").read_text())

    # train.py: model first, then data config, datasets, mixup, loaders.
    model = timm.create_model("resnet18", num_classes=NUM_CLASSES, pretrained=False)
    data_config = resolve_data_config({"input_size": INPUT_SIZE}, model=model)
    dataset_train = create_dataset("", root=args.data, split="train", is_training=True,
                                   batch_size=args.batch_size)
    collate_fn = mixup_fn = None
    mixup_off_epoch = 0
    if args.mixup:  # train.py's mixup_args with --mixup 0.8 --cutmix 1.0 --mixup-off-epoch 1
        mixup_args = dict(mixup_alpha=0.8, cutmix_alpha=1.0, cutmix_minmax=None, prob=1.0,
                          switch_prob=0.5, mode="batch", label_smoothing=0.1,
                          num_classes=NUM_CLASSES)
        mixup_off_epoch = 1
        if args.prefetcher:
            collate_fn = FastCollateMixup(**mixup_args)
        else:
            mixup_fn = Mixup(**mixup_args)
    loader_train = create_loader(
        dataset_train,
        input_size=data_config["input_size"],
        batch_size=args.batch_size,
        is_training=True,
        use_prefetcher=args.prefetcher,
        no_aug=False,
        re_prob=0.0,  # random erasing would hide the id
        scale=[0.08, 1.0],
        ratio=[3.0 / 4.0, 4.0 / 3.0],
        hflip=0.5,
        vflip=0.0,
        color_jitter=0.0,  # jitter would change the id's colour code (train.py: 0.4)
        auto_augment=None,
        interpolation="random",
        mean=data_config["mean"],
        std=data_config["std"],
        num_workers=args.workers,
        distributed=False,
        collate_fn=collate_fn,
        pin_memory=False,
        device=device,
        use_multi_epochs_loader=args.multi_epochs_loader,
    )
    res["loader_type"] = type(loader_train).__name__
    res["own_len"] = len(loader_train)

    res["setup_s"] = round(time.monotonic() - t0, 1)
    loader_train = tensorsocket.share(loader_train, name=args.name,
                                      **json.loads(args.options))  # the one-line swap
    res["share_s"] = round(time.monotonic() - t0 - res["setup_s"], 1)

    decoder = Decoder(n_images, data_config["mean"], data_config["std"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train_loss_fn = SoftTargetCrossEntropy() if args.mixup else torch.nn.CrossEntropyLoss()
    res["len"] = len(loader_train)
    if res["len"] != res["own_len"]:
        res["problems"].append(f"len(loader_train) {res['len']} != own loader's "
                               f"{res['own_len']}")
    for epoch in range(args.epochs):
        if hasattr(loader_train.sampler, "set_epoch"):
            loader_train.sampler.set_epoch(epoch)
        mixup_on = bool(args.mixup)
        if mixup_off_epoch and epoch >= mixup_off_epoch:  # train_one_epoch's first lines
            if args.prefetcher and loader_train.mixup_enabled:
                loader_train.mixup_enabled = False
            elif mixup_fn is not None:
                mixup_fn.mixup_enabled = False
            mixup_on = False
        t_epoch = time.monotonic()
        ids: collections.Counter = collections.Counter()
        mixed = undecoded = batches = 0
        shapes = set()
        model.train()
        for batch_idx, (input, target) in enumerate(loader_train):
            if not args.prefetcher:
                input, target = input.to(device), target.to(device)
            u = decoder.colours(input)
            flat = decoder.flat(u)
            mixed += sum(k is None for k in flat)
            got = decoder.paired(u) if (args.prefetcher and args.mixup) else flat
            undecoded += sum(k is None for k in got)
            ids.update(k for k in got if k is not None)
            if target.dim() == 1:  # class targets travel with their images
                bad = [k for k, t in zip(flat, target.tolist())
                       if k is not None and t != k % NUM_CLASSES]
                if bad:
                    res["problems"].append(f"epoch {epoch}: targets do not match ids {bad}")
            if mixup_fn is not None:
                input, target = mixup_fn(input, target)
            shapes.add(tuple(target.shape))
            output = model(input)
            loss = train_loss_fn(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            batches += 1
        want = collections.Counter(range(n_images))
        e = {"epoch": epoch, "batches": batches, "samples": sum(ids.values()),
             "distinct": len(ids), "mixed_images": mixed, "undecoded": undecoded,
             "target_shapes": sorted(shapes), "loss": round(loss.item(), 3),
             "seconds": round(time.monotonic() - t_epoch, 1)}
        res["epochs"].append(e)
        if batches != res["len"]:
            res["problems"].append(f"epoch {epoch}: {batches} batches, len() said {res['len']}")
        if ids != want:
            dup = sorted(k for k, c in ids.items() if c > 1)
            missing = sorted(set(range(n_images)) - set(ids))
            res["problems"].append(f"epoch {epoch}: ids not once each: {len(dup)} repeated, "
                                   f"{len(missing)} missing, {undecoded} undecoded")
        want_shape = (args.batch_size, NUM_CLASSES) if args.mixup else (args.batch_size,)
        if shapes != {want_shape}:
            res["problems"].append(f"epoch {epoch}: target shapes {sorted(shapes)}, "
                                   f"expected {want_shape}")
        if args.prefetcher and args.mixup and not mixup_on and mixed:
            res["problems"].append(
                f"epoch {epoch}: mixup_enabled=False was set but {mixed} of "
                f"{batches * args.batch_size} images came mixed (the producer's "
                f"FastCollateMixup is still on)")
        if args.mixup and mixup_on and args.prefetcher and not mixed:
            res["problems"].append(f"epoch {epoch}: mixup on but no image came mixed")
    res["warnings"] = seen_warnings
    res["stats"] = {k: v for k, v in loader_train.stats().items()
                    if isinstance(v, (int, float, str))} if hasattr(loader_train, "stats") \
        else None
    loader_train.close()
    return res


def main() -> int:
    """Make the data folder, or run one job and write its result."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--make-data", type=Path)
    p.add_argument("--images", type=int, default=128)
    p.add_argument("--combo", default="")
    p.add_argument("--name")
    p.add_argument("--data")
    p.add_argument("--out", type=Path)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--no-prefetcher", dest="prefetcher", action="store_false")
    p.add_argument("--multi-epochs-loader", action="store_true")
    p.add_argument("--mixup", action="store_true")
    p.add_argument("--options", default="{}", help="share() consumer keywords, as JSON")
    args = p.parse_args()
    if args.make_data:
        make_data(args.make_data, args.images)
        return 0
    try:
        res = train(args)
    except Exception as exc:  # the result says how it failed; the traceback goes to stderr
        traceback.print_exc()
        last = traceback.extract_tb(exc.__traceback__)[-1]
        res = {"error": f"{type(exc).__name__}: {exc} (at {Path(last.filename).name}:"
                        f"{last.lineno})", "problems": []}
    args.out.write_text(json.dumps(res, default=str))
    return 1 if res.get("error") or res.get("problems") else 0


if __name__ == "__main__":
    sys.exit(main())
