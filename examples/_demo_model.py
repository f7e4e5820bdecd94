"""The model and data of examples/demo.py: a synthetic in-memory image set, a CPU transform
in plain torch (random resized crop, flip, normalization), a tiny CNN, and a wrapper that
adds up the CPU time a loader spends.

Nothing here knows tensorsocket: it is what a training script brings.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

BATCH_SIZE = 32
IMAGE_SIZE = 96
CROP_SIZE = 64
NUM_CLASSES = 10
MEAN = (0.5, 0.5, 0.5)
STD = (0.25, 0.25, 0.25)
SEED = 0


class SyntheticImages(torch.utils.data.Dataset):
    """Deterministic in-memory uint8 images (3 x 96 x 96) with a class tint; label = index % 10."""

    def __init__(self, count: int, transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 seed: int = SEED) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.labels = torch.arange(count) % NUM_CLASSES
        palette = torch.randint(0, 256, (NUM_CLASSES, 3, 1, 1), generator=gen, dtype=torch.int16)
        self.images = torch.empty(count, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.uint8)
        for start in range(0, count, 256):  # in chunks: no large temporaries
            stop = min(count, start + 256)
            noise = torch.randint(0, 256, (stop - start, 3, IMAGE_SIZE, IMAGE_SIZE),
                                  generator=gen, dtype=torch.int16)
            tint = palette[self.labels[start:stop]]
            self.images[start:stop] = ((3 * noise + tint) // 4).to(torch.uint8)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])


class RandomCropFlipNormalize:
    """Random resized crop to size x size, random flip, to float, per-channel normalization."""

    def __init__(self, size: int = CROP_SIZE, scale: tuple[float, float] = (0.25, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), mean: tuple[float, ...] = MEAN,
                 std: tuple[float, ...] = STD) -> None:
        self.size = size
        self.scale = scale
        self.log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def crop_box(self, height: int, width: int) -> tuple[int, int, int, int]:
        """A random (top, left, height, width) box, as torchvision's RandomResizedCrop picks it."""
        area = height * width
        for _ in range(10):
            target = area * float(torch.empty(()).uniform_(*self.scale))
            aspect = math.exp(float(torch.empty(()).uniform_(*self.log_ratio)))
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, ()))
                left = int(torch.randint(0, width - w + 1, ()))
                return top, left, h, w
        return 0, 0, height, width

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        """Transform one uint8 C x H x W image into a normalized float C x size x size tensor."""
        top, left, h, w = self.crop_box(image.shape[-2], image.shape[-1])
        x = image[:, top:top + h, left:left + w].float().div_(255.0)
        x = F.interpolate(x.unsqueeze(0), size=(self.size, self.size), mode="bilinear",
                          align_corners=False, antialias=True).squeeze(0)
        if float(torch.rand(())) < 0.5:
            x = x.flip(-1)
        return x.sub_(self.mean).div_(self.std)


class TimedLoader:
    """Wrap a loader and add up the CPU time (time.process_time) spent fetching its batches."""

    def __init__(self, loader: torch.utils.data.DataLoader) -> None:
        self.loader = loader
        self.batch_size = loader.batch_size
        self.cpu_seconds = 0.0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        start = time.process_time()
        it = iter(self.loader)
        self.cpu_seconds += time.process_time() - start
        while True:
            start = time.process_time()
            try:
                batch = next(it)
            except StopIteration:
                return
            finally:
                self.cpu_seconds += time.process_time() - start
            yield batch


class TinyCNN(nn.Module):
    """Two strided conv layers, global average pooling and a linear classifier."""

    def __init__(self, classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.fc = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of images."""
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return self.fc(x.mean(dim=(2, 3)))
