"""A consumer's transform settings (TensorConsumer / share() arguments), checked once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .seeding import draw_job_seed

_INPUTS = ("tensor", "pil")


@dataclass(frozen=True)
class TransformOptions:
    """The TensorConsumer / share() arguments of a job's own transform (docs/usage.md, "A
    shared decode, each job's own augmentation"):

    transform: a function of one sample, run on every sample the consumer delivers, as a
      dataset's ``transform=``: on each row of the batch's inputs (element 0 of a tuple or
      list batch, ``batch[transform_key]`` of a dict batch, a tensor batch itself); the
      outputs are stacked in their place. It must accept what the producer's loader makes
      (say uint8 CHW tensors): else the first batch raises TransformError naming both.
    seed: the job's seed; before each sample torch, random and NumPy are seeded from
      (seed, epoch, the sample's dataset index). None: drawn from torch's generator when
      the consumer is made (as a DataLoader's base seed).
    workers (transform_workers=): forked worker processes that run it ahead of the
      training step, reading the inputs in place in the ring; 0: at next(), here, the
      caller's generators left as they were.
    prefetch (transform_prefetch=): batches in flight per worker (default 2), kept below
      the ring's slots.
    pil (transform_input="pil"): each sample handed over as a PIL image.
    key (transform_key=): the inputs' key in a dict batch (None: "image", else the first).
    context (transform_context=): the workers' start method (None: fork)."""

    transform: Callable[[Any], Any]
    seed: int
    workers: int
    pil: bool
    key: Any
    prefetch: int
    context: str | None

    @classmethod
    def resolve(cls, *, transform: Any, seed: Any, workers: Any, transform_input: Any,
                key: Any, prefetch: Any, context: Any) -> "TransformOptions | None":
        """The options, or None without a transform; TypeError / ValueError naming the
        argument otherwise. A transform setting given without transform= is an error (it
        would do nothing)."""
        if transform is None:
            given = [n for n, v, d in (("seed", seed, None), ("transform_workers", workers, 0),
                                       ("transform_input", transform_input, "tensor"),
                                       ("transform_key", key, None),
                                       ("transform_prefetch", prefetch, 2),
                                       ("transform_context", context, None)) if v != d]
            if given:
                raise TypeError(f"{', '.join(given)} given without transform=: "
                                "they set how the transform runs")
            return None
        if not callable(transform):
            raise TypeError(f"transform must be callable (a function of one sample), got "
                            f"{type(transform).__name__}")
        if seed is None:
            seed = draw_job_seed()
        elif isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        for name, value, low in (("transform_workers", workers, 0),
                                 ("transform_prefetch", prefetch, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if transform_input not in _INPUTS:
            raise ValueError(f"transform_input must be one of {_INPUTS}, got "
                             f"{transform_input!r}")
        if context is not None and context not in ("fork", "spawn", "forkserver"):
            raise ValueError(f"transform_context must be 'fork', 'spawn', 'forkserver' or "
                             f"None, got {context!r}")
        return cls(transform, seed, workers, transform_input == "pil", key, prefetch, context)
