"""The examples' data: a folder of JPEG files in torchvision's ImageFolder layout.

``image_folder(per_class, size)`` writes ``root/class<k>/<i>.jpg`` once (10 classes,
``size`` x ``size`` pixels, quality 90) and returns ``root``; later calls, from any process,
reuse it. Each class has its own colours and shapes, so a model can learn them; the noise
makes the JPEGs realistically costly to decode. The default root is
``$TMPDIR/tensorsocket-examples-<uid>/jpegs-<per_class>x10-<size>px`` (a few MB; delete it
when done) or ``--data DIR`` in the examples.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

CLASSES = 10
DONE = "COMPLETE"


def default_root(per_class: int, size: int) -> Path:
    base = Path(tempfile.gettempdir()) / f"tensorsocket-examples-{os.getuid()}"
    return base / f"jpegs-{per_class}x{CLASSES}-{size}px"


def make_jpeg(label: int, i: int, size: int, path: Path) -> None:
    """One deterministic image of class ``label``: tinted gradient, class shapes, noise."""
    rng = np.random.default_rng([label, i, size])
    hue = np.random.default_rng(label).uniform(0, 255, (2, 3))  # the class's two colours
    t = np.linspace(0.0, 1.0, size, dtype=np.float32)
    t = t[None, :] if label % 2 else t[:, None]  # horizontal or vertical gradient
    arr = hue[0] * (1 - t[..., None]) + hue[1] * t[..., None] + np.zeros((size, size, 1))
    img = Image.fromarray(np.clip(arr + rng.normal(0, 20, 3), 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(2 + label % 4):  # the number and kind of shapes depend on the class
        x, y = rng.integers(0, size * 3 // 4, 2)
        d = int(rng.integers(size // 8, size // 3))
        colour = tuple(int(c) for c in 255 - hue[0])
        (draw.ellipse if label % 3 else draw.rectangle)([x, y, x + d, y + d], fill=colour)
    noisy = np.asarray(img, dtype=np.float32) + 12 * rng.standard_normal((size, size, 3),
                                                                         dtype=np.float32)
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(path, quality=90)


def image_folder(per_class: int = 32, size: int = 256, root: str | os.PathLike | None = None,
                 ) -> Path:
    """The folder of ``10 x per_class`` JPEGs, written on first use (atomically)."""
    root = Path(root) if root is not None else default_root(per_class, size)
    if (root / DONE).exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # processes started together: one writes, others wait
        if not (root / DONE).exists():
            _write(root, per_class, size)
    return root


def _write(root: Path, per_class: int, size: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".tmp-", dir=root.parent))
    try:
        for label in range(CLASSES):
            (tmp / f"class{label}").mkdir()
            for i in range(per_class):
                make_jpeg(label, i, size, tmp / f"class{label}" / f"{i:05d}.jpg")
        (tmp / DONE).write_text(f"{per_class} x {CLASSES} images of {size}px\n")
        os.rename(tmp, root)  # complete or absent, even if this process is killed
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
