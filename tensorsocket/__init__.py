"""tensorsocket: shared data loading for collocated training jobs.

One producer process runs the data loader once and publishes every batch into
a shared-memory ring; each training process iterates a TensorConsumer like
the DataLoader it replaces and receives zero-copy tensors.
"""

from __future__ import annotations

import logging

from . import errors
from .augment.split import split_transform
from .consumer import TensorConsumer
from .data.gpu import gpu_available, gpu_status
from .errors import *  # every error and warning (errors.__all__)
from .producer import TensorProducer
from .sharing.share import share
from .store import StoreLoader

__version__ = "0.1.0"

__all__ = [
    "StoreLoader",
    "TensorConsumer",
    "TensorProducer",
    "__version__",
    "gpu_available",
    "gpu_status",
    "share",
    "split_transform",
]
__all__ += errors.__all__

logging.getLogger("tensorsocket").addHandler(logging.NullHandler())
