"""Each sample's randomness, seeded from (job seed, epoch, sample id).

A transform draws from the process-wide generators of torch, ``random`` and NumPy
(torchvision's and timm's transforms do). Seeding all three before each sample makes a
sample's output a function of the job's seed, the epoch and the sample alone: the same in
any run, whichever worker computes it and in whatever order the producer's loader put the
samples; and two jobs with different seeds draw independently.
"""

from __future__ import annotations

import contextlib
import random
from typing import Iterator, Sequence

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_UNKNOWN_ID = 1 << 62  # positions stand in for ids the producer does not tell


def _mix(x: int) -> int:
    """SplitMix64's finaliser: a well-spread 64-bit function of x (stable across processes
    and Python versions, unlike hash())."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(job_seed: int, epoch: int, sample: int) -> int:
    """The seed of one sample's transform: a 63-bit mix of the job's seed, the epoch and
    the sample (its dataset index, or a position; see sample_keys)."""
    return _mix(_mix(_mix(job_seed & _MASK64) ^ (epoch & _MASK64)) ^ (sample & _MASK64)) >> 1


def sample_keys(ids: Sequence[int] | None, first_position: int, count: int) -> list[int]:
    """What identifies each of `count` samples for its seed: its dataset index when the
    producer tells it, else its position in the epoch (from `first_position`), kept apart
    from any index."""
    if ids is not None:
        return [int(i) for i in ids]
    return [_UNKNOWN_ID + first_position + k for k in range(count)]


def seed_everything(seed: int) -> None:
    """Seed torch's, random's and NumPy's process-wide generators with `seed`."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)


def draw_job_seed() -> int:
    """A job seed drawn from torch's global generator, as a DataLoader draws its base seed
    (so torch.manual_seed before makes it reproducible)."""
    return int(torch.empty((), dtype=torch.int64).random_().item()) & ((1 << 63) - 1)


@contextlib.contextmanager
def callers_generators_kept(cuda_devices: Sequence[int] = ()) -> Iterator[None]:
    """Run a block that reseeds the generators, then give the caller's states back (a
    transform run in the training process must not change the training's randomness)."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=list(cuda_devices)):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
