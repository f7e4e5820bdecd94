"""TensorProducer, the publishing side of the ring."""

from .tensor_producer import TensorProducer

__all__ = ["TensorProducer"]
