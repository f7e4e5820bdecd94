"""The training workload of ``collocated.py``: a JPEG dataset, its augmentation, a small CNN.

Only torch, numpy and PIL are used (no torchvision: the PyPI torchvision wheels are CUDA
builds whose ops do not load against a CPU-only torch), and nothing here imports
tensorsocket, so both this project's interpreter and the original TensorSocket's venv
import this file by path (``sys.path`` holds ``benchmarks/`` when ``collocated.py`` runs).

- ``ensure_images(n, size)``: ``n`` deterministic JPEGs (``size`` x ``size``, quality 90:
  a colour gradient, random ellipses and rectangles, Gaussian noise) generated once into
  ``benchmarks/.cache/images-<n>-<size>/`` (gitignored).
- ``JpegDataset``: ``__getitem__(i)`` decodes image ``i % n`` with PIL, applies
  RandomResizedCrop to 32x32 (scale (0.08, 1), ratio (3/4, 4/3), bilinear; the
  torchvision algorithm), a random horizontal flip, and converts to a float tensor
  normalised with the ImageNet mean/std. It returns ``(image, label, sample_id)`` with
  ``label = i % 10`` and ``sample_id = i``. The augmentation's random numbers come from
  ``numpy.random.default_rng([seed, epoch, i])``: deterministic per sample, whichever
  worker process (or producer) loads it.
- ``make_loader``: a shuffling ``DataLoader`` whose order depends only on ``seed`` and
  the epoch.
- ``SmallResNet`` (~20k parameters with the default widths) and ``Trainer`` (SGD with
  momentum, cross-entropy).
- ``calibrate``: the loader's and a training step's CPU cost per batch, one thread each
  (the loader in a forked process with its heap padded, as a producer's worker has it).

The same workload split in two for a shared prefix (``shared_prefix.py``):

- ``DecodedDataset``: the decode part Ld, deterministic: ``__getitem__(i)`` reads and
  decodes image ``i % n`` and resizes it to ``DECODE_SIZE`` x ``DECODE_SIZE`` (bilinear),
  a uint8 CHW tensor, with the same label and sample id as ``JpegDataset``.
- ``Augment``: the augmentation part La of one job, on one such uint8 CHW sample, in
  plain torch ops (no torchvision): a random resized crop to ``crop`` (slicing +
  ``F.interpolate``), a random horizontal flip (or none), a brightness/contrast jitter of
  strength ``jitter``, to float and normalised. Its random numbers come from torch's
  global RNG, seeded per sample by whoever calls it.
- ``AugmentedDataset``: a ``DecodedDataset`` with one job's ``Augment`` applied per
  sample, torch's CPU generator seeded first from ``sample_seed(seed, epoch, i)``: what
  one job's own DataLoader workers run (Ld + La).
"""

from __future__ import annotations

import ctypes
import functools
import io
import math
import multiprocessing
import multiprocessing.pool
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image, ImageDraw

CACHE = Path(__file__).resolve().parent / ".cache"

NUM_IMAGES = 2000
IMAGE_SIZE = 512  # decoding dominates: see collocated.py's docstring, "Calibration"
CROP = 32
NUM_CLASSES = 10
JPEG_QUALITY = 90
SCALE = (0.08, 1.0)
RATIO = (3.0 / 4.0, 4.0 / 3.0)
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
WIDTHS = (8, 16, 32)
DECODE_SIZE = 80  # the shared prefix's common size (DecodedDataset)
DONE_MARK = "COMPLETE"


# -- the image files --------------------------------------------------------------------


def image_dir(n: int = NUM_IMAGES, size: int = IMAGE_SIZE) -> Path:
    return CACHE / f"images-{n}-{size}"


def make_image(i: int, size: int) -> bytes:
    """JPEG bytes of image ``i`` (deterministic in ``i`` and ``size``)."""
    rng = np.random.default_rng([20240917, i, size])
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    t = xx * rng.uniform(-1, 1) + yy * rng.uniform(-1, 1)
    t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
    c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    arr = c0 * (1 - t[..., None]) + c1 * t[..., None]
    img = Image.fromarray(arr.astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(4, 12))):
        x0, y0 = (int(v) for v in rng.integers(0, size, 2))
        dx, dy = (int(v) for v in rng.integers(size // 20 + 1, size // 2, 2))
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape([x0, y0, x0 + dx, y0 + dy], fill=colour)
    noisy = np.asarray(img, dtype=np.float32)
    noisy += rng.standard_normal(noisy.shape, dtype=np.float32) * 12.0
    img = Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=JPEG_QUALITY)
    return out.getvalue()


def _pool(processes: int) -> "multiprocessing.pool.Pool":
    """A pool of forked processes whose SIGTERM is the default one and that ignore SIGINT:
    the caller's handlers (a script's, turning them into exceptions) would make each worker
    print a traceback at Pool.terminate() or Ctrl-C."""
    return multiprocessing.get_context("fork").Pool(processes, initializer=_quiet_worker)


def _quiet_worker() -> None:
    """A pool worker: SIGTERM ends it (Pool.terminate), Ctrl-C is its caller's to handle."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _write_image(tmp: Path, size: int, i: int) -> None:
    (tmp / f"{i:06d}.jpg").write_bytes(make_image(i, size))


def ensure_images(n: int = NUM_IMAGES, size: int = IMAGE_SIZE,
                  progress: Callable[[str], None] | None = None,
                  processes: int = 1) -> Path:
    """The directory of the ``n`` images, generating them on first use (in ``processes``
    forked processes when more than 1).

    They are written into a temporary directory that is renamed into place when
    complete, so a crash never leaves a partial cache behind.
    """
    root = image_dir(n, size)
    if (root / DONE_MARK).exists():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = CACHE / f"{root.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        t0 = time.monotonic()
        write = functools.partial(_write_image, tmp, size)
        pool = _pool(processes) if processes > 1 else None
        try:
            done = (pool.imap_unordered(write, range(n), chunksize=8) if pool is not None
                    else map(write, range(n)))
            for k, _ in enumerate(done, 1):
                if progress is not None and k % 250 == 0:
                    progress(f"generating images: {k}/{n} ({time.monotonic() - t0:.0f} s)")
            if pool is not None:
                pool.close()  # every image written: the workers exit on their own
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
        (tmp / DONE_MARK).write_text(f"{n} {size}\n")
        if root.exists():  # an incomplete cache from an older layout: replace it
            shutil.rmtree(root, ignore_errors=True)
        try:
            os.rename(tmp, root)
        except OSError:
            if not (root / DONE_MARK).exists():  # not another process winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


# -- the dataset ------------------------------------------------------------------------


def random_resized_crop_box(rng: np.random.Generator, width: int, height: int,
                            scale: tuple[float, float] = SCALE,
                            ratio: tuple[float, float] = RATIO) -> tuple[int, int, int, int]:
    """(left, top, w, h) of a RandomResizedCrop, as torchvision draws it."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, w, h
    # Fallback: a central crop with the ratio clamped to the allowed range.
    in_ratio = width / height
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def transform(img: Image.Image, rng: np.random.Generator, crop: int = CROP) -> torch.Tensor:
    """RandomResizedCrop(crop) + RandomHorizontalFlip + ToTensor + Normalize."""
    left, top, w, h = random_resized_crop_box(rng, img.width, img.height)
    img = img.resize((crop, crop), Image.BILINEAR, box=(left, top, left + w, top + h))
    if rng.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    arr = np.asarray(img, dtype=np.float32) * (1.0 / 255.0)
    arr = (arr - MEAN) / STD
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))


class JpegDataset(torch.utils.data.Dataset):
    """``length`` samples over the JPEGs in ``root``: sample ``i`` is file ``i % n``."""

    def __init__(self, root: str | os.PathLike, length: int | None = None, crop: int = CROP,
                 seed: int = 0) -> None:
        self.files = sorted(str(p) for p in Path(root).glob("*.jpg"))
        if not self.files:
            raise FileNotFoundError(f"no .jpg files in {root}")
        self.length = len(self.files) if length is None else int(length)
        self.crop = crop
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        rng = np.random.default_rng([self.seed, self.epoch, i])
        with Image.open(self.files[i % len(self.files)]) as f:
            img = f.convert("RGB")
        return transform(img, rng, self.crop), i % NUM_CLASSES, i


M_TOP_PAD, M_MMAP_THRESHOLD = -2, -3  # glibc <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's largest dynamic mmap threshold (64-bit)
CALIBRATION_TOP_PAD = 16 << 20  # tensorsocket's default worker_heap_pad


def pad_heap(top_pad: int, worker_id: int = 0, strict: bool = True) -> None:
    """glibc only: keep ``top_pad`` bytes at the top of this process's heap (``mallopt
    M_TOP_PAD``) and serve blocks under 32 MiB from the heap (``M_MMAP_THRESHOLD``), so
    that freeing a decoded image never hands memory back to the kernel only for the next
    image to fault it in again. A DataLoader ``worker_init_fn``. Both are needed: setting
    either one turns off glibc's dynamic thresholds, and M_TOP_PAD alone leaves images
    above the inherited mmap threshold to be mapped and unmapped one by one. OSError where
    mallopt refuses (not glibc, or a sanitizer's allocator), unless not `strict`: then the
    heap is left as it is, as tensorsocket's producer leaves it there."""
    del worker_id
    libc = ctypes.CDLL(None)
    for option, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TOP_PAD, int(top_pad))):
        if libc.mallopt(option, value) != 1:
            if not strict:
                return
            raise OSError(f"mallopt({option}, {value}) failed")


def decode(path: str, size: int = DECODE_SIZE) -> torch.Tensor:
    """Image file ``path`` decoded to RGB and resized to ``size`` x ``size`` (bilinear), as a
    uint8 CHW tensor."""
    with Image.open(path) as f:
        img = f.convert("RGB")
    img = img.resize((size, size), Image.BILINEAR)
    return torch.from_numpy(np.array(img)).permute(2, 0, 1).contiguous()


class DecodedDataset(torch.utils.data.Dataset):
    """The decode part alone: sample ``i`` is image ``i % n`` decoded and resized to
    ``size`` x ``size``, a uint8 CHW tensor, with ``JpegDataset``'s label and id."""

    def __init__(self, root: str | os.PathLike, length: int | None = None,
                 size: int = DECODE_SIZE) -> None:
        self.files = sorted(str(p) for p in Path(root).glob("*.jpg"))
        if not self.files:
            raise FileNotFoundError(f"no .jpg files in {root}")
        self.length = len(self.files) if length is None else int(length)
        self.size = size

    def set_epoch(self, epoch: int) -> None:
        """Nothing: the decoded samples are the same in every epoch."""

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        return decode(self.files[i % len(self.files)], self.size), i % NUM_CLASSES, i


_MEAN_T = torch.from_numpy(MEAN * 255.0).view(3, 1, 1)
_STD_T = torch.from_numpy(STD * 255.0).view(3, 1, 1)


class Augment:
    """One job's augmentation of a uint8 CHW sample (plain torch ops): a random resized
    crop to ``crop`` (scale and ratio as ``random_resized_crop_box``; slicing, then
    bilinear ``F.interpolate``), a horizontal flip with probability 0.5 if ``flip``,
    brightness and contrast factors drawn from [1 - jitter, 1 + jitter], then float and
    normalised (ImageNet mean/std). Random numbers: torch's global RNG."""

    def __init__(self, crop: int, flip: bool, jitter: float) -> None:
        self.crop, self.flip, self.jitter = int(crop), bool(flip), float(jitter)

    def __repr__(self) -> str:
        return f"Augment(crop={self.crop}, flip={self.flip}, jitter={self.jitter})"

    def box(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(left, top, w, h) of the random resized crop, from torch's RNG."""
        area = height * width
        log_lo, log_hi = math.log(RATIO[0]), math.log(RATIO[1])
        for _ in range(10):
            u = torch.rand(4).tolist()
            target = area * (SCALE[0] + (SCALE[1] - SCALE[0]) * u[0])
            aspect = math.exp(log_lo + (log_hi - log_lo) * u[1])
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return int(u[3] * (width - w + 1)), int(u[2] * (height - h + 1)), w, h
        return 0, 0, width, height

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        left, top, w, h = self.box(img.shape[-2], img.shape[-1])
        x = img[:, top:top + h, left:left + w].unsqueeze(0).float()
        x = F.interpolate(x, size=(self.crop, self.crop), mode="bilinear",
                          align_corners=False)[0]
        if self.flip and float(torch.rand(())) < 0.5:
            x = x.flip(-1)
        if self.jitter > 0:
            b, c = (1.0 + self.jitter * (2.0 * torch.rand(2) - 1.0)).tolist()
            x = (x - x.mean()) * c + x.mean() * b
        return (x - _MEAN_T) / _STD_T


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's augmentation: a function of (seed, epoch, index) only, in
    a microsecond (numpy's SeedSequence takes 30 us, a tenth of an augmentation)."""
    return ((seed * 1_000_003 + epoch) * 1_000_000_007 + index) & ((1 << 63) - 1)


class AugmentedDataset(torch.utils.data.Dataset):
    """``base`` (a ``DecodedDataset``) with ``augment`` applied to each sample's image,
    torch's RNG seeded first from ``sample_seed(seed, epoch, i)``: one job's Ld + La."""

    def __init__(self, base: DecodedDataset, augment: Callable[[torch.Tensor], torch.Tensor],
                 seed: int = 0) -> None:
        self.base, self.augment, self.seed = base, augment, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:
        img, label, sample_id = self.base[i]
        # The CPU generator only: torch.manual_seed also seeds every other device type's
        # generators, ~0.3 ms a call here (as long as an augmentation), which a job's own
        # DataLoader, seeded once per worker, never pays.
        torch.default_generator.manual_seed(sample_seed(self.seed, self.epoch, i))
        return self.augment(img), label, sample_id


def make_loader(dataset: "JpegDataset | DecodedDataset | AugmentedDataset", batch_size: int, workers: int, seed: int = 0,
                epoch: int = 0, worker_top_pad: int = 0,
                strict_pad: bool = True) -> torch.utils.data.DataLoader:
    """A shuffling DataLoader whose order depends only on ``seed`` and ``epoch``; with
    ``worker_top_pad`` > 0 each worker calls ``pad_heap(worker_top_pad)`` first."""
    dataset.set_epoch(epoch)
    gen = torch.Generator()
    gen.manual_seed(seed * 1000 + epoch)
    init = functools.partial(pad_heap, worker_top_pad, strict=strict_pad) \
        if worker_top_pad > 0 else None
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True,
                                       num_workers=workers, generator=gen, worker_init_fn=init)


# -- the model ---------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = None
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.shortcut is None else self.shortcut(x)))


class SmallResNet(nn.Module):
    """Stem (stride 2) + three basic blocks (32x32 input: 16x16, 8x8, 4x4) + linear."""

    def __init__(self, widths: tuple[int, int, int] = WIDTHS,
                 num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        w1, w2, w3 = widths
        self.stem = nn.Sequential(nn.Conv2d(3, w1, 3, 2, 1, bias=False), nn.BatchNorm2d(w1),
                                  nn.ReLU())
        self.layer1 = BasicBlock(w1, w1, 1)
        self.layer2 = BasicBlock(w1, w2, 2)
        self.layer3 = BasicBlock(w2, w3, 2)
        self.fc = nn.Linear(w3, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class Trainer:
    """A SmallResNet and its optimiser; ``step(x, y)`` is one SGD step, returning the loss."""

    def __init__(self, seed: int = 0, lr: float = 0.05,
                 widths: tuple[int, int, int] = WIDTHS) -> None:
        torch.manual_seed(seed)
        self.model = SmallResNet(widths)
        self.model.train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9,
                                   weight_decay=5e-4)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        return float(loss.detach())


# -- calibration -------------------------------------------------------------------------


def _loader_cpu_s(root: str, batch_size: int, batches: int, warmup: int,
                  top_pad: int, strict_pad: bool = True) -> tuple[float, float]:
    """CPU and wall seconds per batch of ``dataset[i]`` x batch + collate in this
    process (one thread), after ``pad_heap(top_pad)``: what one padded worker does."""
    torch.set_num_threads(1)
    pad_heap(top_pad, strict=strict_pad)
    ds = JpegDataset(root, seed=0)
    order = np.random.default_rng(0).permutation(len(ds))
    collate = torch.utils.data.default_collate

    def load(b: int):
        idx = order[(b * batch_size + np.arange(batch_size)) % len(order)]
        return collate([ds[int(i)] for i in idx])

    for b in range(warmup):
        load(b)
    c0, t0 = time.thread_time(), time.perf_counter()
    for b in range(batches):
        load(warmup + b)
    return ((time.thread_time() - c0) / batches, (time.perf_counter() - t0) / batches)


def calibrate(root: str | os.PathLike, batch_size: int, batches: int = 6,
              warmup: int = 1, top_pad: int = CALIBRATION_TOP_PAD,
              strict_pad: bool = True) -> dict:
    """Loader-only and train-only CPU cost per batch, one thread each.

    loader: ``dataset[i]`` for a shuffled run of indices plus ``default_collate``, what one
    DataLoader worker does per batch, measured in a forked process whose heap is padded
    first (``pad_heap(top_pad)``), as the producer's workers pad theirs: decoding in this
    process instead would measure whatever malloc heap it happens to have (see
    benchmarks/README.md, "The allocator"), up to twice the cost. train: ``Trainer.step``
    on a batch of the loader's, in this process. Times are the calling thread's CPU time
    (``time.thread_time``), the quantity the CPU-per-sample ratio is made of; the wall
    times are kept beside them.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _pool(1) as pool:
            load_s, load_wall_s = pool.apply(
                _loader_cpu_s, (str(root), batch_size, batches, warmup, top_pad, strict_pad))
        ds = JpegDataset(root, seed=0)
        collate = torch.utils.data.default_collate
        x, y, _ = collate([ds[i] for i in range(batch_size)])
        trainer = Trainer(seed=0)
        for _ in range(warmup + 1):
            trainer.step(x, y)
        c0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(batches):
            trainer.step(x, y)
        train_s = (time.thread_time() - c0) / batches
        train_wall_s = (time.perf_counter() - t0) / batches
    finally:
        torch.set_num_threads(threads)
    return {
        "batch_size": batch_size,
        "clock": "thread CPU time",
        "loader_top_pad": top_pad,
        "loader_batches_per_s": 1.0 / load_s,
        "loader_samples_per_s": batch_size / load_s,
        "loader_ms_per_batch": load_s * 1e3,
        "loader_wall_ms_per_batch": load_wall_s * 1e3,
        "train_batches_per_s": 1.0 / train_s,
        "train_samples_per_s": batch_size / train_s,
        "train_ms_per_batch": train_s * 1e3,
        "train_wall_ms_per_batch": train_wall_s * 1e3,
        "train_over_loader": load_s / train_s,
        "loader_bound_one_worker": load_s > train_s,
        "model_params": num_params(trainer.model),
        "threads": 1,
    }
