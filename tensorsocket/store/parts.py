"""A job's dataset taken apart for the decoded-sample store: the dataset whose samples the
store holds (the innermost one, its transform cut to the shared part), the map from the
job's indices to that dataset's (through ``Subset`` s), and the job's own part of the
transform (the random rest), applied to a sample's inputs.

``split_dataset(dataset)``:
- ``Subset`` chains are looked through: index j of the job's dataset is sample
  ``keys[j]`` of the base dataset, so jobs on different subsets of one dataset share the
  samples they have in common;
- a base dataset with a ``transform`` (torchvision's datasets: ``ImageFolder``, ``CIFAR10``
  ...) gets a shallow copy whose transform is the shared part (``augment.split
  .store_split``: its leading deterministic steps, ending in a uint8 tensor); the rest is
  the job's, run on the sample's inputs (element 0 of a tuple or list, ``"image"`` or the
  first key of a dict, or the sample itself) after the store;
- any other dataset is stored as its ``__getitem__`` gives samples: it must be
  deterministic, which the store checks by content (store.dataset).
"""

from __future__ import annotations

import collections.abc
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.utils.data import Subset

from ..augment.split import store_split


@dataclass
class DatasetParts:
    """A job's dataset for the store (module docstring)."""

    base: Any  # the dataset whose samples are stored (its transform: the shared part)
    keys: np.ndarray | None  # the job's index -> base index (None: the same)
    suffix: Callable[[Any], Any] | None  # the job's part of the transform, on the inputs
    transforms: dict[str, Any] = field(default_factory=dict)  # the shared ones, by attribute
    length: int = 0  # of the job's dataset

    def base_index(self, index: int) -> int:
        """The base dataset's index of the job's sample `index` (IndexError outside)."""
        if index < 0:
            index += self.length
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} is out of range for a dataset of "
                             f"{self.length} samples")
        return index if self.keys is None else int(self.keys[index])

    def base_indices(self, indices: np.ndarray) -> np.ndarray:
        """base_index of each of `indices` (int64)."""
        indices = np.where(indices < 0, indices + self.length, indices)
        return indices if self.keys is None else self.keys[indices]


def split_dataset(dataset: Any) -> DatasetParts:
    """`dataset` taken apart (module docstring)."""
    length = len(dataset)
    keys: np.ndarray | None = None
    base = dataset
    while isinstance(base, Subset):
        indices = np.asarray(base.indices, dtype=np.int64)
        keys = indices if keys is None else indices[keys]
        base = base.dataset
    transform = getattr(base, "transform", None)
    shared, suffix = store_split(transform)
    transforms = {"target_transform": getattr(base, "target_transform", None)}
    if suffix is not None:
        base = copy.copy(base)
        base.transform = shared
        _rebuild_standard_transform(base, shared)
    transforms["transform"] = shared
    return DatasetParts(base, keys, suffix, transforms, length)


def _rebuild_standard_transform(dataset: Any, shared: Any) -> None:
    """A torchvision dataset's ``transforms`` (the StandardTransform of its transform and
    target_transform, which some read instead of ``transform``) remade with the shared
    transform."""
    pair = getattr(dataset, "transforms", None)
    if type(pair).__name__ != "StandardTransform":
        return
    dataset.transforms = type(pair)(shared, getattr(pair, "target_transform", None))


def apply_to_inputs(sample: Any, fn: Callable[[Any], Any]) -> Any:
    """`sample` with fn applied to its inputs: element 0 of a tuple or list (a namedtuple
    stays one), ``"image"`` (else the first key) of a dict, or the sample itself."""
    if isinstance(sample, tuple) and sample:
        if hasattr(sample, "_fields"):
            return type(sample)(fn(sample[0]), *sample[1:])
        return (fn(sample[0]), *sample[1:])
    if isinstance(sample, list) and sample:
        return [fn(sample[0]), *sample[1:]]
    if isinstance(sample, collections.abc.Mapping) and sample:
        key = "image" if "image" in sample else next(iter(sample))
        made = dict(sample)
        made[key] = fn(sample[key])
        return made if type(sample) is dict else type(sample)(made)  # type: ignore[call-arg]
    return fn(sample)
