"""A consumer's transform settings (TensorConsumer / share() arguments), checked once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .seeding import draw_job_seed

_INPUTS = ("tensor", "pil")


@dataclass(frozen=True)
class TransformOptions:
    """transform: run on each sample; seed: the job's seed; workers: worker processes (0:
    in the calling thread, at next()); pil: samples handed over as PIL images; key: the
    dict key of the inputs (None: "image", else the first); prefetch: batches in flight
    per worker; context: the workers' multiprocessing start method (None: fork)."""

    transform: Callable[[Any], Any]
    seed: int
    workers: int
    pil: bool
    key: Any
    prefetch: int
    context: str | None

    @classmethod
    def resolve(cls, transform: Any, seed: Any, workers: Any, transform_input: Any,
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
