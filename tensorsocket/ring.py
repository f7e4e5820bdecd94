"""The one Python face over the compiled core (tensorsocket._core).

Everything above this module reaches the C core through it, as pyzmq's ``sugar``
reaches its compiled ``backend`` (tests/test_layering.py holds the rule): the ring
(``Ring``, its slots and views), the limits the core checks (exported once from
``ts_ring.h``), its states and reasons as ``IntEnum`` s rather than bare ints, a ring's
header and handle state as a typed ``RingInfo`` rather than a dict read by string keys,
and the process helpers the core implements (``ProcessWatch``, a process's liveness by
pidfd; ``process_alive`` ...), and the store of decoded samples (``Store``, what a put
found as a ``StoreOutcome``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any

from . import _core
from ._core import (  # noqa: F401 - the face re-exports the core's types and helpers
    Lane,
    ProcessWatch,
    Ring,
    Slot,
    SlotView,
    Store,
    TooManyConsumers,
    VersionMismatch,
    copy_stream,
    cuda_loaded,
    cuda_status,
    fork_child,
    fork_parent,
    fork_prepare,
    process_alive,
    process_start_time,
    process_stat,
    segment_bytes,
    set_process_name,
)

MAX_CONSUMERS: int = _core.MAX_CONSUMERS  # consumers a ring's table holds (its bitmaps' bits)
MAX_SLOTS: int = _core.MAX_SLOTS  # most slots a ring holds
MIN_SLOTS: int = _core.MIN_SLOTS  # fewest slots a ring holds
# Slots a ring keeps beyond max_lag: the one the producer fills and the one a consumer
# holds while it trains (TS_RESERVE_SLOTS, which the core checks).
RESERVE_SLOTS: int = _core.RESERVE_SLOTS
MAX_NDIM: int = _core.MAX_NDIM  # dimensions of a leaf
LAYOUT_VERSION: int = _core.LAYOUT_VERSION  # of the segment (another version's is refused)


STORE_MAX_JOBS: int = _core.STORE_MAX_JOBS  # processes a store's job table holds


class StoreOutcome(enum.IntEnum):
    """What Store.put found."""

    STORED = _core.STORE_STORED  # copied in and committed: every job sees it
    PRESENT = _core.STORE_PRESENT  # another process stored it first
    RACED = _core.STORE_RACED  # another process stores it now
    NO_ROOM = _core.STORE_NO_ROOM  # the budget is taken by pinned samples, or it was dropped
    BUSY = _core.STORE_BUSY  # its lock is held by a stopped process: nothing stored


class RingState(enum.IntEnum):
    """A ring's state (its header's)."""

    OPEN = _core.RING_OPEN
    FINISHED = _core.RING_FINISHED


class ConsumerState(enum.IntEnum):
    """A consumer table entry's state."""

    FREE = _core.CONSUMER_FREE
    PENDING = _core.CONSUMER_PENDING  # reserved by a hello, not receiving yet
    ACTIVE = _core.CONSUMER_ACTIVE  # receives new entries
    LEAVING = _core.CONSUMER_LEAVING  # left (or leaving): its holds are being given back
    DETACHED = _core.CONSUMER_DETACHED  # taken off by the producer (see StopReason)


class StopReason(enum.IntEnum):
    """Why a consumer stopped receiving (NONE while it receives)."""

    NONE = 0
    LEFT = _core.REASON_LEFT  # it said bye
    LAGGED = _core.REASON_LAGGED  # it fell more than max_lag entries behind
    DIED = _core.REASON_DIED  # its process is gone
    SILENT = _core.REASON_SILENT  # alive, but no heartbeat for heartbeat_timeout
    UNREAD = _core.REASON_UNREAD  # it read nothing while the others waited for it


class DeviceType(enum.IntEnum):
    """Where a ring's slot data lives (DLPack device types)."""

    CPU = _core.DL_CPU
    CUDA = _core.DL_CUDA
    CUDA_HOST = _core.DL_CUDA_HOST


@dataclass(frozen=True)
class RingInfo:
    """A ring's header and this handle's state, read at once (``RingInfo.of(ring)``;
    Ring.info() is the same as a dict)."""

    name: str  # the segment's name
    slot_count: int
    max_leaves: int
    slot_bytes: int
    segment_bytes: int
    producer_pid: int
    producer_start_time: int  # of producer_pid, in clock ticks since boot
    state: RingState
    published: int  # entries published so far (batches, end markers, holes)
    active_mask: int  # consumers that receive new entries, one bit each
    bytes_copied: int  # producer handle: bytes it copied into slots
    data_address: int  # this handle's mapping of the slot data
    data_bytes: int
    consumer: int  # consumer handle: its table index (2**32 - 1: none)
    is_producer: int
    occupied: int  # slots some consumer holds
    window: int  # entries kept readable for late joiners
    max_lag: int  # consumers further behind are detached (0: never, lossless)
    epoch_first_seq: int  # seq of the current epoch's first entry
    lag_detached: int  # consumers detached for lagging
    publish_wait_ns: int  # producer time asleep waiting for free slots
    holes: int  # holes published (slots skipped)
    late_releases: int  # releases ignored as an older incarnation's
    incarnation: int  # consumer handle: the incarnation its releases name
    publish_cpu_ns: int  # producer thread CPU spent publishing batches
    setup_cpu_ns: int  # producer process CPU before its loader began
    batches_delivered: int  # batches handed to consumers, once per consumer each
    host_writable: int
    private_slots: int  # slots this handle made private by writing
    newest_valid: bool  # the newest entry was read whole
    newest_epoch: int
    newest_index: int
    newest_bytes: int  # its bytes; 0 for an end marker
    device_type: DeviceType
    device_ordinal: int  # the producer's device (-1 on a host ring)
    device_uuid: str
    producer_host_pinned: int
    imported_device: int
    host_pinned: int
    same_pid_namespace: bool
    gpu_importers: int

    @classmethod
    def of(cls, ring: Ring) -> RingInfo:
        """The info of `ring` now."""
        raw = ring.info()
        raw["state"] = _member(RingState, raw["state"])
        raw["device_type"] = _member(DeviceType, raw["device_type"])
        return cls(**{name: raw[name] for name in _FIELDS})


_FIELDS = tuple(f.name for f in fields(RingInfo))


def _member(kind: type[enum.IntEnum], value: int) -> Any:
    """`value` as a member of `kind`, or the int itself where it is none (a header is
    shared memory: status reads segments a producer may still be writing)."""
    try:
        return kind(value)
    except ValueError:
        return value
