"""The counters of TensorProducer.stats(): the ring's, the control server's, and one row
per consumer (see that method's docstring for each)."""

from __future__ import annotations

from typing import Any

from ..control.server import ControlServer
from ..ring import ConsumerState, RingInfo

STATE_NAMES = {
    ConsumerState.PENDING: "joining",
    ConsumerState.ACTIVE: "active",
    ConsumerState.LEAVING: "leaving",
    ConsumerState.DETACHED: "detached",
}


def producer_stats(ring: Any, server: ControlServer, closed: bool, *, epoch: int,
                   device: str, batches: int, consumer_wait_seconds: float, window: int,
                   max_lag: int | None, cache: dict) -> dict:
    """stats() of a producer whose ring is `ring` (None before the first batch) and whose
    control server is `server`; the producer's own counters come as keywords (cache: the
    decoded-sample cache's, CachedEpochs.stats())."""
    ring = ring if ring is not None and not ring.closed else None
    info = RingInfo.of(ring) if ring is not None else None
    return {
        "epoch": epoch,
        "device": device,
        "host_pinned": bool(info.producer_host_pinned) if info else False,
        "batches": batches,
        "bytes_copied": info.bytes_copied if info else 0,
        "wait_seconds": info.publish_wait_ns / 1e9 if info else 0.0,
        "consumer_wait_seconds": consumer_wait_seconds,
        "consumers": server.consumer_count() if not closed else 0,
        "slots": info.slot_count if info else 0,
        "slot_bytes": info.slot_bytes if info else 0,
        "occupied": info.occupied if info else 0,
        "window": window,
        "max_lag": max_lag,
        "lag_detached": info.lag_detached if info else 0,
        "skipped_slots": info.holes if info else 0,
        "late_releases": info.late_releases if info else 0,
        "rejected_messages": server.rejected,
        **cache,
        "consumer_table": consumer_table(ring, server) if ring is not None else [],
    }


def consumer_table(ring: Any, server: ControlServer) -> list[dict]:
    """One row per consumer of `ring`: its state, batch size, lag and deliveries."""
    sizes = server.batch_sizes()
    return [{
        "index": c["index"],
        "pid": c["pid"],
        "state": STATE_NAMES.get(c["state"], str(c["state"])),
        "batch_size": sizes.get(c["index"]),
        "lag": c["lag"],
        "delivered": c["delivered"],
        "delivered_bytes": c["delivered_bytes"],
        "wait_seconds": c["wait_ns"] / 1e9,
    } for c in ring.consumers()]
