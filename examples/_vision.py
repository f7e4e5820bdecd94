"""A stand-in for the few torchvision pieces the examples use, when torchvision cannot be used.

The examples import torchvision when it imports. Where it does not (not installed, or a wheel
built for another torch: ``operator torchvision::nms does not exist``), they import this file
instead, under the same names::

    from _vision import datasets, models, transforms

It implements only what the examples call, with torchvision's semantics, on PIL, numpy and
torch: ``datasets.ImageFolder``, ``transforms.Compose / RandomResizedCrop /
RandomHorizontalFlip / ToTensor / Normalize`` (PIL images; the random numbers are drawn from
torch's generator exactly as torchvision draws them, so the same seed gives the same crops)
and ``models.resnet18`` (the same layers, parameter names and initialisation as
torchvision's; its state_dict loads into torchvision's model and back). Checked against
torchvision 0.29.1: the same ImageFolder samples, bit-identical transform outputs and
ResNet-18 initial weights and outputs under the same torch seed, so train_alone.py prints the
same losses with either.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn as nn
from PIL import Image

# -- datasets ---------------------------------------------------------------------------

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def pil_loader(path: str) -> Image.Image:
    with open(path, "rb") as f:
        return Image.open(f).convert("RGB")


class ImageFolder(torch.utils.data.Dataset):
    """``root/<class>/<image>`` files; classes are the sorted sub-directory names."""

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None,
                 target_transform: Callable | None = None,
                 loader: Callable[[str], Any] = pil_loader) -> None:
        self.root = os.fspath(root)
        self.classes = sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        if not self.classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {self.root}.")
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples = []
        for cls in self.classes:
            for dirpath, _, files in sorted(os.walk(os.path.join(self.root, cls),
                                                    followlinks=True)):
                for f in sorted(files):
                    if f.lower().endswith(IMG_EXTENSIONS):
                        self.samples.append((os.path.join(dirpath, f), self.class_to_idx[cls]))
        self.targets = [t for _, t in self.samples]
        self.transform = transform
        self.target_transform = target_transform
        self.loader = loader

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        path, target = self.samples[index]
        sample = self.loader(path)
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target


# -- transforms (PIL images in, as torchvision.transforms v1) -------------------------


class Compose:
    def __init__(self, transforms: Sequence[Callable]) -> None:
        self.transforms = list(transforms)

    def __call__(self, img: Any) -> Any:
        for t in self.transforms:
            img = t(img)
        return img


class RandomResizedCrop:
    """Crop a random area (``scale``) of random aspect ratio (``ratio``), resize to ``size``."""

    def __init__(self, size: int | Sequence[int], scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3.0 / 4.0, 4.0 / 3.0)) -> None:
        self.size = (size, size) if isinstance(size, int) else tuple(size)  # (h, w)
        self.scale = scale
        self.ratio = ratio

    @staticmethod
    def get_params(img: Image.Image, scale: Sequence[float],
                   ratio: Sequence[float]) -> tuple[int, int, int, int]:
        """(top, left, height, width) of the crop, drawn as torchvision draws it."""
        width, height = img.size
        area = height * width
        log_ratio = torch.log(torch.tensor(ratio))
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
            aspect = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                i = torch.randint(0, height - h + 1, size=(1,)).item()
                j = torch.randint(0, width - w + 1, size=(1,)).item()
                return i, j, h, w
        in_ratio = width / height  # fallback: a central crop
        if in_ratio < min(ratio):
            w, h = width, int(round(width / min(ratio)))
        elif in_ratio > max(ratio):
            w, h = int(round(height * max(ratio))), height
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, img: Image.Image) -> Image.Image:
        i, j, h, w = self.get_params(img, self.scale, self.ratio)
        img = img.crop((j, i, j + w, i + h))
        return img.resize((self.size[1], self.size[0]), Image.BILINEAR)


class RandomHorizontalFlip:
    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, img: Image.Image) -> Image.Image:
        if torch.rand(1) < self.p:
            return img.transpose(Image.FLIP_LEFT_RIGHT)
        return img


class ToTensor:
    """PIL image (H x W x C, uint8) -> float tensor C x H x W in [0, 1]."""

    def __call__(self, pic: Image.Image) -> torch.Tensor:
        arr = np.array(pic, dtype=np.uint8, copy=True)
        if arr.ndim == 2:
            arr = arr[:, :, None]
        img = torch.from_numpy(arr).permute(2, 0, 1).contiguous()
        return img.to(dtype=torch.get_default_dtype()).div(255)


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = mean
        self.std = std

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        mean = torch.as_tensor(self.mean, dtype=tensor.dtype).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=tensor.dtype).view(-1, 1, 1)
        return (tensor - mean) / std


# -- models -----------------------------------------------------------------------------


def conv3x3(inplanes: int, planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, layers: Sequence[int], num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        inplanes = 64
        widths = (64, 128, 256, 512)
        for n, (planes, blocks) in enumerate(zip(widths, layers, strict=True), start=1):
            stride = 1 if n == 1 else 2
            stage = [BasicBlock(inplanes, planes, stride)]
            stage += [BasicBlock(planes, planes) for _ in range(blocks - 1)]
            setattr(self, f"layer{n}", nn.Sequential(*stage))
            inplanes = planes
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18(num_classes: int = 1000) -> ResNet:
    return ResNet((2, 2, 2, 2), num_classes=num_classes)


datasets = SimpleNamespace(ImageFolder=ImageFolder)
transforms = SimpleNamespace(Compose=Compose, RandomResizedCrop=RandomResizedCrop,
                             RandomHorizontalFlip=RandomHorizontalFlip, ToTensor=ToTensor,
                             Normalize=Normalize)
models = SimpleNamespace(resnet18=resnet18)
