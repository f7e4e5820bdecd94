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
        "wait_seconds": acquirer.wait_s + flow.waited, "lag": lag,
        "rejoins": place.rejoins, "skipped_entries": place.skipped,
        "dropped_samples": rebatcher.dropped_samples if rebatcher else 0,
        "copied_kept_batches": place.set_aside_batches,
        **producer_cache(place),
        **({} if transforms is None else transforms.stats()),
    }


def producer_cache(place: Any) -> dict:
    """The producer's decoded-sample cache, as noted in its ring's header: cache_budget
    (bytes allowed; 0: none asked for), cache_bytes, cache_samples (filled), cache_epochs
    (served from it) and cache_off (why there is none: "not made: ..." or "dropped: ...";
    None while there is one, or before the producer decided). All None once the consumer
    is closed, or where the note could not be read whole."""
    note = None if place.closed else place.ring.cache()
    if note is None:
        return dict.fromkeys(("cache_budget", "cache_bytes", "cache_samples", "cache_epochs",
                              "cache_off"))
    return {"cache_budget": note["budget"], "cache_bytes": note["bytes"],
            "cache_samples": note["samples"], "cache_epochs": note["epochs"],
            "cache_off": note["off"]}
