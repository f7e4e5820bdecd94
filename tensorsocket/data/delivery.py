"""Where a consumer's tensors are delivered, and how a ring slot becomes them.

A host ring's slots are read in place (zero-copy DLPack views, numpy arrays for numpy
leaves), or copied to a GPU when the consumer asked for one (``device="cuda:N"``,
asynchronously with ``pin_memory=True``). A GPU ring's slots are read in place through
CUDA IPC (ordered after the producer's copy on the current stream), through peer access
from another GPU, or through host memory where CUDA IPC cannot work (with a
GPUFallbackWarning saying why). ``copy=True`` gives private copies instead of views.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np
import torch

from . import sample_ids
from ..errors import GPUFallbackWarning, GPUUnavailable
from ..ring import DeviceType, RingInfo, cuda_status
from ..validation import parse_device
from .structure import NUMPY, NUMPY_SCALAR, TORCH, Decoder

log = logging.getLogger("tensorsocket")


class Delivery:
    """A consumer's delivery of batches: where its tensors go (``device``, set by
    attach()), and the making of a batch from a slot (build()).

    device: as TensorConsumer's (None or "auto": where the producer put them). copy:
    private copies. pin_memory: page-lock the ring's host slots for asynchronous copies to
    a GPU. peer_access: read a GPU ring on another GPU in place."""

    def __init__(self, device: Any, copy: bool, pin_memory: bool, peer_access: bool) -> None:
        """Nothing decided yet: that needs the ring (attach())."""
        self.kind, self.index = parse_device(device)
        self.copy = copy
        self.pin_memory = pin_memory
        self.peer_access = peer_access
        self.device = "cpu"  # where tensors are delivered (set by attach())
        self.fallback_reason: str | None = None  # why the GPU ring is read through host
        self.gpu_import = False  # tensors come from the ring's GPU copy
        self._cuda: torch.device | None = None  # the GPU they are on, when they do
        self._move_to: torch.device | None = None  # host tensors are copied here
        self._pinned: torch.device | None = None  # the GPU the host ring was page-locked for
        self._decoder = Decoder()

    @property
    def defers_releases(self) -> bool:
        """Whether GPU work may read the slots, so that the releases of dropped views wait
        for flush_releases(): a GPU ring read in place, or page-locked host slots."""
        return self.gpu_import or self.pin_memory

    def flush_releases(self, ring: Any, wait_ms: int = 0) -> None:
        """Order the releases of the views dropped since the last call after the GPU work
        queued so far on the streams their views were used on and on this thread's current
        stream (Ring.flush_releases; docs/gpu.md, "Orderings on the GPU path"). A release
        whose stream is being captured (CUDA graphs) waits for a later call: nothing here
        touches a capture, on this thread or another. Only where releases are deferred
        (defers_releases)."""
        if self.defers_releases:
            ring.flush_releases(wait_ms, current_stream(self._cuda or self._pinned))

    def attach(self, ring: Any) -> None:
        """Decide where tensors are delivered from `ring` and open what that needs."""
        info = RingInfo.of(ring)
        gpu_ring = info.device_type == DeviceType.CUDA
        kind, index = self.kind, self.index
        if kind == "cuda" and index is None:
            index = _current_gpu()  # as torch reads "cuda": a DDP rank's own GPU
        if kind == "cpu" or (kind == "auto" and not gpu_ring):
            self.device = "cpu"
        elif gpu_ring and (kind == "auto" or self.peer_access or _same_gpu(info, index)):
            try:
                ordinal = ring.import_device(None if kind == "auto" else index)
            except GPUUnavailable as e:
                self._fall_back(str(e), None if kind == "auto" else index)
            else:
                self.gpu_import = True
                self._cuda = torch.device("cuda", ordinal)
                self.device = str(self._cuda)
                return  # tensors come from GPU memory: nothing to page-lock
        else:
            # A host ring, or another GPU without peer access: copy from host memory.
            assert index is not None  # only kind "cuda" comes here, and it has one
            self._move_to = torch.device("cuda", index)
            self.device = str(self._move_to)
        if self.pin_memory:
            # Page-locked for (and releases ordered after the work of) the GPU the copies
            # go to, else this thread's current one, as torch's DataLoader(pin_memory=True)
            # pins for torch.accelerator.current_device_index() taken when its iterator is
            # made (torch/utils/data/dataloader.py, _MultiProcessingDataLoaderIter): a DDP
            # rank r that called torch.cuda.set_device(r) copies to cuda:r.
            pinned = index if index is not None else _current_gpu()
            try:
                ring.pin_host(pinned)
            except GPUUnavailable as e:
                raise GPUUnavailable(f"pin_memory=True needs a GPU: {e}") from None
            self._pinned = torch.device("cuda", pinned)

    def _fall_back(self, reason: str, index: int | None) -> None:
        """CUDA IPC cannot work here: deliver through host memory instead."""
        self.fallback_reason = reason
        if index is not None:
            self._move_to = torch.device("cuda", index)
            self.device = str(self._move_to)
        where = f"copied to {self.device} by this consumer" if index is not None else \
            "delivered as host tensors"
        warnings.warn(f"tensorsocket: cannot read the producer's GPU ring here ({reason}); "
                      f"batches are {where}", GPUFallbackWarning, stacklevel=4)
        log.warning("GPU ring unavailable to this consumer: %s", reason)

    def _to_device(self, leaves: list, kinds: list) -> list:
        """Copy the torch leaves to self._move_to. With pin_memory=True the copies are
        asynchronous, on the current stream: the host views' slot goes back only after the
        work queued there (their releases are deferred, defers_releases), with no event
        query of ours (one during another thread's CUDA-graph capture would break it)."""
        return [leaf.to(self._move_to, non_blocking=self.pin_memory) if kind == TORCH else leaf
                for kind, leaf in zip(kinds, leaves, strict=True)]

    @property
    def zero_copy_host(self) -> bool:
        """Whether batches are host views of the ring as they are (no copy, no device, no
        deferred release): what the consumer's common path (tensorsocket._core.Lane)
        delivers itself."""
        return not (self.gpu_import or self.copy or self.defers_releases or
                    self._move_to is not None)

    def common_builder(self, structure: bytes) -> Any:
        """The build function of a batch structure whose leaves are all torch tensors, for
        the common path; None for another (numpy leaves: the slow path makes them)."""
        build, kinds = self._decoder.compile(structure)
        return build if all(kind == TORCH for kind in kinds) else None

    def build(self, slot: Any, count: bool = False) -> tuple[Any, int | None, Any]:
        """Turn a slot into the loader's batch structure of tensors and values. With count,
        also the batch's sample count as far as its tensors tell: dim 0 of the first tensor
        or array with a dimension, in the batch's order (None if it holds none, or without
        count); and the dataset indices of its samples, if the producer tells them (None
        otherwise). The slot's own hold stays (the caller releases it; until then it may build
        again, after an interrupt); the tensors hold it as long as they live."""
        structure, ids = sample_ids.split(slot.meta)
        build, kinds = self._decoder.compile(structure)
        if self.gpu_import:
            leaves = self._device_leaves(slot, kinds)
        elif NUMPY not in kinds and NUMPY_SCALAR not in kinds:
            leaves = [from_capsule(c) for c in slot.capsules(versioned=True, copy=self.copy)]
        else:
            leaves = []
            for kind, view in zip(kinds, slot.views(), strict=True):
                if kind == TORCH:
                    leaves.append(torch.from_dlpack(view.__dlpack__(max_version=(1, 0),
                                                                    copy=self.copy or None)))
                else:
                    array = np.from_dlpack(view)
                    leaves.append(array.copy() if self.copy else array)
        leading = None
        for leaf in leaves if count else ():  # in the batch's order (structure.flatten)
            if leaf.ndim:
                leading = int(leaf.shape[0])
                break
        if self._move_to is not None:
            leaves = self._to_device(leaves, kinds)
        return build(leaves), leading, ids

    def _device_leaves(self, slot: Any, kinds: list) -> list:
        """Torch leaves from the slot's GPU copy (zero-copy; ordered after the producer's
        copy on the current stream), numpy leaves from its host copy."""
        assert self._cuda is not None  # set when the GPU ring was imported
        if NUMPY not in kinds and NUMPY_SCALAR not in kinds:
            tensors = _device_tensors(slot, self._cuda)
            return [t.clone() for t in tensors] if self.copy else tensors
        device_views = slot.views(device=True)
        host_views = slot.views()  # numpy leaves come from the host copy
        leaves: list[Any] = []
        for i, kind in enumerate(kinds):
            if kind == TORCH:
                tensor = _device_tensor(device_views[i])
                leaves.append(tensor.clone() if self.copy else tensor)
            else:
                array = np.from_dlpack(host_views[i])
                leaves.append(array.copy() if self.copy else array)
        return leaves


# A tensor from a DLPack capsule: torch.utils.dlpack.from_dlpack's own call for a capsule
# (it is a Python wrapper that first asks whether its argument has __dlpack__).
from_capsule = getattr(torch._C, "_from_dlpack", torch.from_dlpack)


def _device_tensor(view: Any) -> torch.Tensor:
    """A torch tensor over a device SlotView; torch passes its current stream, which
    is made to wait for the producer's copy of the slot."""
    return torch.from_dlpack(view)


def _device_tensors(slot: Any, device: torch.device) -> list[torch.Tensor]:
    """Torch tensors over every leaf of a slot's GPU copy, all exported in one call with
    this thread's current stream on ``device`` (made to wait for the producer's copy),
    without torch.from_dlpack's per-view protocol calls."""
    caps = slot.capsules(versioned=True, device=True, stream=_stream_of(device))
    return [from_capsule(c) for c in caps]


# The raw handle of the current stream without building a torch.cuda.Stream (a private
# function torch's own generated code calls; the public way where it is missing).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream_of(device: torch.device) -> int:
    """The DLPack stream number of this thread's current stream on ``device``: its handle,
    or 1 for the legacy default stream (whose handle is 0, which DLPack forbids)."""
    if _raw_stream is not None:
        handle = _raw_stream(device.index)
    else:
        handle = torch.cuda.current_stream(device).cuda_stream
    return handle if handle != 0 else 1


def current_stream(device: torch.device | None) -> int | None:
    """The DLPack number of this thread's current stream on ``device`` in torch, the stream
    a training step queues its work on; None where torch has not used CUDA here (then no
    work of torch's can be queued either)."""
    if device is None or not torch.cuda.is_initialized():
        return None
    return _stream_of(device)


def _current_gpu() -> int:
    """This thread's current CUDA device in torch (torch.cuda.current_device()); 0 where
    this torch has no CUDA (nothing of torch can then queue work on a GPU)."""
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.current_device()


def _same_gpu(info: dict, index: int | None) -> bool:
    """True if CUDA device index of this process is the GPU holding the ring's pool."""
    status = cuda_status()
    for dev in status["devices"] or ():
        if dev["ordinal"] == index:
            return dev["uuid"] == info.device_uuid
    return False
