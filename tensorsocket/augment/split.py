"""Splitting a dataset's whole transform into the part the producer runs once for every job
(deterministic: decode-side resizing, to a uint8 tensor) and the part each job runs on its
own samples (random augmentation, conversion to float, normalisation).

``split_transform(pipeline)`` cuts a torchvision ``Compose`` (v1 or v2; any object with a
``transforms`` list and a constructor taking one) before its first transform that is not
known to be deterministic and size-preserving in dtype: the prefix keeps samples uint8, as
small in the ring and the decoded cache as they can be; float conversion and
normalisation stay with the job (cheap, and a job may normalise differently).

The shared part always ends in a tensor: the producer's DataLoader collates its samples,
and default_collate refuses PIL images. A prefix that leaves PIL images (the v1 and timm
eval pipelines, ``Resize, CenterCrop, ToTensor, Normalize``) gets ``AsTensor()`` (a PIL
image to its uint8 CHW tensor) appended, and the job's part is made to take that tensor
and give what the whole pipeline gave (see _job_part_on_tensors).
"""

from __future__ import annotations

from typing import Any

# Transforms (by class name, torchvision v1 and v2) that give every job the same output and
# keep uint8 samples uint8: they may run once, in the producer.
SHAREABLE = frozenset({
    "Resize", "CenterCrop", "Pad", "Grayscale", "PILToTensor", "ToImage", "ToImageTensor",
    "ToPureTensor", "RGB", "MaybePILToTensor",
})

# Shareable transforms (by class name) that turn a PIL image into a uint8 tensor: a shared
# part with one of them hands the producer's DataLoader tensors.
TO_UINT8_TENSOR = frozenset({"PILToTensor", "ToImage", "ToImageTensor", "MaybePILToTensor"})

# Transforms (by class name) that turn a PIL image into a float tensor scaled to [0, 1]
# (torchvision's ToTensor, v1 and v2; timm's MaybeToTensor, which leaves a tensor as it is).
TO_SCALED_TENSOR = frozenset({"ToTensor", "MaybeToTensor"})


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
    producer's loader reads; the rest is each job's ``transform=``. A shared part without a
    conversion to a uint8 tensor (TO_UINT8_TENSOR) gets AsTensor() at its end, and the
    rest takes that tensor (see _job_part_on_tensors): applied one after the other they
    give what `pipeline` gives. ValueError when nothing can be shared or nothing is left
    for the job (the message names the first transform)."""
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
    shared, rest = list(steps[:cut]), list(steps[cut:])
    if not any(type(step).__name__ in TO_UINT8_TENSOR for step in shared):
        shared.append(AsTensor())
        rest = _job_part_on_tensors(rest)
    return kind(shared), kind(rest)


def store_split(transform: Any) -> tuple[Any, Any]:
    """(shared, per_job) of a dataset's transform for the decoded-sample store, never
    refusing: a Compose is cut as split_transform() cuts it, but wholly shared when every
    step is (per_job None) and, when its first step is not shareable, shared as
    AsTensor() alone (the decoded image) with every step the job's; a single transform
    (not a Compose) is shared when no step of it is random by name (random_steps), else
    the job's, after AsTensor(). None: (None, None)."""
    if transform is None:
        return None, None
    steps = getattr(transform, "transforms", None)
    if not isinstance(steps, (list, tuple)) or not steps:
        if random_steps(transform):
            return AsTensor(), transform
        return transform, None
    if not random_steps(transform) and all(type(s).__name__ in SHAREABLE for s in steps):
        return transform, None
    if type(steps[0]).__name__ not in SHAREABLE:
        return AsTensor(), type(transform)(_job_part_on_tensors(list(steps)))
    try:
        return split_transform(transform)
    except ValueError:  # every step shareable by class, some random by name: the job's
        return AsTensor(), type(transform)(_job_part_on_tensors(list(steps)))


def _job_part_on_tensors(rest: list[Any]) -> list[Any]:
    """The job's steps `rest`, made to take the uint8 CHW tensor AsTensor() gives where they
    took a PIL image, with the same outputs:
    - a ToTensor first becomes ScaleLikeToTensor() (ToTensor does not scale a tensor, and
      timm's MaybeToTensor passes one through: both would leave uint8 for Normalize);
    - a step before a tensor conversion (a PIL-only or PIL-specific step: a random crop
      resamples PIL and tensors differently) gets TensorToPIL() before it: the job runs its
      steps on the same PIL image as before;
    - steps without any tensor conversion take the tensor as they are (their pipeline
      either took tensors already, AsTensor() passing those through, or gave PIL
      images that no batch can hold)."""
    first = next((i for i, step in enumerate(rest)
                  if type(step).__name__ in TO_SCALED_TENSOR | TO_UINT8_TENSOR), None)
    if first is None:
        return rest
    if first == 0 and type(rest[0]).__name__ in TO_SCALED_TENSOR:
        return [ScaleLikeToTensor()] + rest[1:]
    return [TensorToPIL()] + rest


class AsTensor:
    """A PIL image as its uint8 CHW tensor (torchvision's PILToTensor); a tensor as it is
    (a pipeline over tensors is left unchanged). The step split_transform() appends to a
    shared part that would otherwise end in PIL images."""

    def __call__(self, image: Any) -> Any:
        import torch

        if isinstance(image, torch.Tensor):
            return image
        from torchvision.transforms.functional import pil_to_tensor

        return pil_to_tensor(image)

    def __repr__(self) -> str:
        return "AsTensor()"


class ScaleLikeToTensor:
    """What torchvision's ToTensor gives for a PIL image, from that image's PILToTensor
    tensor: uint8 to the default float dtype divided by 255 (ToTensor's own arithmetic, so
    bit for bit; ToDtype(scale=True) multiplies by 1/255, one rounding off), a mode "1"
    image's bool to 0.0 and 1.0; other dtypes (modes "I", "F") as they are, as ToTensor
    leaves them."""

    def __call__(self, image: Any) -> Any:
        import torch

        if image.dtype == torch.uint8:
            return image.to(dtype=torch.get_default_dtype()).div(255)
        if image.dtype == torch.bool:
            return image.to(dtype=torch.get_default_dtype())
        return image

    def __repr__(self) -> str:
        return "ScaleLikeToTensor()"


class TensorToPIL:
    """The PIL image a uint8 CHW tensor was made from by PILToTensor (modes L, LA, RGB,
    RGBA: the 8-bit modes an image dataset decodes to); a PIL image as it is."""

    def __call__(self, image: Any) -> Any:
        import torch

        if not isinstance(image, torch.Tensor):
            return image
        from torchvision.transforms.functional import to_pil_image

        return to_pil_image(image)

    def __repr__(self) -> str:
        return "TensorToPIL()"
