"""TensorConsumer, the consumer side of tensorsocket (see tensor_consumer for its parts)."""

from .options import SharedLoader
from .tensor_consumer import EpochIterator, TensorConsumer

__all__ = ["EpochIterator", "SharedLoader", "TensorConsumer"]
