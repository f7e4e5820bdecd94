"""Exceptions raised by tensorsocket.

Every error derives from :class:`TensorSocketError` (a ``RuntimeError``). The
ones that the C core raises are created there and re-exported here.
"""

from __future__ import annotations

from ._core import (
    BatchTooLarge,
    ConsumerDetached,
    CudaError,
    GPUUnavailable,
    ProducerFinished,
    ProducerGone,
    SharedMemoryTooSmall,
    TensorSocketError,
    TooManyConsumers,
    VersionMismatch,
)

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
    "TensorSocketError",
    "TensorSocketWarning",
    "TooManyConsumers",
    "TransformError",
    "VersionMismatch",
]


class ProducerNotFound(TensorSocketError, TimeoutError):
    """No producer answered at the endpoint within the consumer's timeout."""


class ProducerFailed(ProducerGone):
    """The producer ended by a failure, not a normal end: its loader (or the code that
    runs it) raised, or its process died without finishing (killed, crashed).

    ``cause`` is the producer's own error (``"ValueError: ..."``, where it was raised)
    when it could tell, else None. A ProducerGone, so ``except ProducerGone`` catches it;
    never a ProducerFinished, which is the normal end of the stream.
    """

    def __init__(self, message: str, cause: str | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class ProtocolError(TensorSocketError):
    """A control message was malformed or out of order."""


class AuthenticationError(TensorSocketError, PermissionError):
    """The producer refused this consumer: another user's process, a hello for another
    process, or a missing or wrong secret on a TCP address (see tensorsocket.control.auth)."""


class TensorSocketWarning(UserWarning):
    """Base class of tensorsocket warnings."""


class GPUFallbackWarning(TensorSocketWarning):
    """The GPU path could not work here; tensors come through host memory instead."""


class LagWarning(TensorSocketWarning):
    """A consumer fell behind, was detached and attached again, skipping batches."""


class TransformError(TensorSocketError, ValueError):
    """A consumer's per-sample ``transform=`` cannot run on the shared samples (or its
    outputs cannot make a batch); raised at the first batch, naming the transform and what
    the producer's samples are. A worker process's error carries the worker's traceback."""
