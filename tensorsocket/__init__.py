"""tensorsocket: shared data loading for collocated training jobs.

One producer process runs the data loader once and publishes every batch into
a shared-memory ring; each training process iterates a TensorConsumer like
the DataLoader it replaces and receives zero-copy tensors.
"""

from __future__ import annotations

import logging

from .augment.split import split_transform
from .consumer import TensorConsumer
from .errors import (
    AuthenticationError,
    BatchTooLarge,
    ConsumerDetached,
    CudaError,
    GPUFallbackWarning,
    GPUUnavailable,
    LagWarning,
    ProducerFailed,
    ProducerFinished,
    ProducerGone,
    ProducerNotFound,
    ProtocolError,
    SharedMemoryTooSmall,
    TensorSocketError,
    TensorSocketWarning,
    TooManyConsumers,
    TransformError,
    VersionMismatch,
)
from .data.gpu import gpu_available, gpu_status
from .producer import TensorProducer
from .sharing.share import share

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "BatchTooLarge",
    "ConsumerDetached",
    "CudaError",
    "GPUFallbackWarning",
    "GPUUnavailable",
    "LagWarning",
    "ProducerFailed",
    "ProducerFinished",
    "ProducerGone",
    "ProducerNotFound",
    "ProtocolError",
    "SharedMemoryTooSmall",
    "TensorConsumer",
    "TensorProducer",
    "TensorSocketError",
    "TensorSocketWarning",
    "TooManyConsumers",
    "TransformError",
    "VersionMismatch",
    "__version__",
    "gpu_available",
    "gpu_status",
    "share",
    "split_transform",
]

logging.getLogger("tensorsocket").addHandler(logging.NullHandler())
