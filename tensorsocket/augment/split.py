"""Splitting a dataset's whole transform into the part the producer runs once for every job
(deterministic: decode-side resizing, to a uint8 tensor) and the part each job runs on its
own samples (random augmentation, conversion to float, normalisation).

``split_transform(pipeline)`` cuts a torchvision ``Compose`` (v1 or v2; any object with a
``transforms`` list and a constructor taking one) before its first transform that is not
known to be deterministic and size-preserving in dtype: the prefix keeps samples uint8, as
small in the ring and the decoded cache as they can be; float conversion and
normalisation stay with the job (cheap, and a job may normalise differently).
"""

from __future__ import annotations

from typing import Any

# Transforms (by class name, torchvision v1 and v2) that give every job the same output and
# keep uint8 samples uint8: they may run once, in the producer.
SHAREABLE = frozenset({
    "Resize", "CenterCrop", "Pad", "Grayscale", "PILToTensor", "ToImage", "ToImageTensor",
    "ToPureTensor", "RGB",
})


# Transforms (by class name) that draw random numbers beyond those named Random*.
_RANDOM = frozenset({"ColorJitter", "AutoAugment", "RandAugment", "TrivialAugmentWide",
                     "AugMix", "GaussianBlur", "ElasticTransform", "MixUp", "CutMix",
                     "ScaleJitter", "GaussianNoise", "JPEG"})


def random_steps(transform: Any) -> list[str]:
    """The class names of the steps of `transform` (a Compose, or one transform) that draw
    random numbers, as far as their names tell (Random*, ColorJitter, RandAugment, ...)."""
    steps = getattr(transform, "transforms", None)
    steps = steps if isinstance(steps, (list, tuple)) else [transform]
    found = []
    for step in steps:
        inner = getattr(step, "transforms", None)
        if isinstance(inner, (list, tuple)):
            found += random_steps(step)
            continue
        kind = type(step).__name__
        if kind.startswith("Random") or kind in _RANDOM:
            found.append(kind)
    return found


def split_transform(pipeline: Any) -> tuple[Any, Any]:
    """(shared, per_job): `pipeline`'s leading shareable transforms (see SHAREABLE) and the
    rest, each a pipeline of the same kind. The shared part goes in the dataset the
    producer's loader reads; the rest is each job's ``transform=``. ValueError when nothing
    can be shared or nothing is left for the job (the message names the first transform)."""
    steps = getattr(pipeline, "transforms", None)
    if not isinstance(steps, (list, tuple)) or not steps:
        raise TypeError(f"split_transform() takes a Compose of transforms (an object with a "
                        f"non-empty .transforms list), got {type(pipeline).__name__}")
    cut = 0
    while cut < len(steps) and type(steps[cut]).__name__ in SHAREABLE:
        cut += 1
    if cut == 0:
        raise ValueError(
            f"split_transform(): the pipeline's first transform, {type(steps[0]).__name__}, "
            "is not one every job shares (it is random, or not known to keep samples "
            "uint8): put the decode-side resize and PILToTensor() first (e.g. Resize((S, S)), "
            "PILToTensor()), with S no smaller than the jobs' crops")
    if cut == len(steps):
        raise ValueError("split_transform(): every transform of the pipeline is shared: "
                         "nothing is left for the job (pass the pipeline to the dataset, "
                         "and no transform=)")
    kind = type(pipeline)
    return kind(list(steps[:cut])), kind(list(steps[cut:]))
