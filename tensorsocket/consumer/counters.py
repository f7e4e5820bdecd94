"""A consumer's counters (TensorConsumer.stats()), read from its parts in one place."""

from __future__ import annotations

from typing import Any


def consumer_stats(consumer: Any, place: Any, state: Any, acquirer: Any,
                   transforms: Any) -> dict:
    """stats() of `consumer` (a TensorConsumer) from its place, epoch state, acquirer and
    transform stage (None without transform=); see TensorConsumer.stats."""
    flow, rebatcher = state.flow, state.rebatcher
    lag = None
    if not place.closed:
        lag = place.ring.consumer(place.index)["lag"]
        if lag > 0 and state.cursor.end_marker_unread and place.attached:
            lag -= 1
    return {
        "epoch": consumer.epoch, "device": consumer.device,
        "zero_copy_gpu": place.delivery.gpu_import,
        "device_fallback_reason": consumer.device_fallback_reason,
        "batches": flow.batches, "samples": flow.samples,
        "loader_batches": flow.loader_batches, "bytes": flow.bytes,
        "wait_seconds": acquirer.wait_s, "lag": lag,
        "rejoins": place.rejoins, "skipped_entries": place.skipped,
        "dropped_samples": rebatcher.dropped_samples if rebatcher else 0,
        "copied_kept_batches": place.set_aside_batches,
        **({} if transforms is None else transforms.stats()),
    }
