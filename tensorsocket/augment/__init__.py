"""Each job's own per-sample transform, run in the consumer on the producer's shared samples.

The producer runs the expensive, deterministic part of a pipeline once (read, decode, resize
to a common size); each consumer applies its own random part (crop, flip, jitter, normalise)
to every sample of the batches it receives: ``share(loader, name=..., transform=augment)``.
One file per job:

- ``options``: the consumer's transform settings, checked.
- ``seeding``: each sample's randomness from (job seed, epoch, sample id).
- ``samples``: which leaf of a batch holds the samples, and putting the outputs back.
- ``shared_views``: a worker process's zero-copy view of a ring slot's tensor.
- ``workers``: the worker processes (forked, as a DataLoader's).
- ``stage``: the batches in flight between the ring and the training step.
- ``split``: a dataset's whole transform cut into the shared part and the job's part.
"""

from .options import TransformOptions
from .split import split_transform
from .stage import TransformStage

__all__ = ["TransformOptions", "TransformStage", "split_transform"]
