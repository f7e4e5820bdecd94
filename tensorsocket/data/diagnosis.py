"""Why a wait lasts: batches kept alive that hold ring slots, and consumers that lag.

Every live batch holds its ring slot, and the producer reuses a slot only once
every consumer let go of it; a consumer more than the ring behind the fastest
one holds the producer and the others back. Both stall everyone, and both
are told here, read from the ring's consumer table and slot bitmaps:

- the consumer's side: whether the slot the producer must reuse next holds a
  batch this consumer keeps (the core counts that, Ring.held_blocking; it then
  copies its kept batches privately and reads on, or warns where it cannot),
  and whether it was detached for lagging;
- the producer's side: which consumers keep the slot it waits for, and which
  lag behind the fastest (the control thread warns about them).

The timing of the warnings (how long a wait lasts first) stays with their callers.
"""

from __future__ import annotations

from typing import Any

from ..ring import RESERVE_SLOTS, ConsumerState, RingInfo, RingState


# -- the consumer's side ---------------------------------------------------------------


def may_set_aside(ring: Any, gpu_import: bool) -> bool:
    """Whether this consumer's kept batches may come to block its next batch and can then
    be copied privately instead (ring.set_aside): it holds slots, on a host ring (GPU
    memory has no private copy; a pinned ring refuses it in set_aside)."""
    return bool(ring.held_slots()) and not gpu_import


def kept_batches_warning(waited: float, held: int, slot_count: int) -> str:
    """The consumer's warning when its own kept batches block its next batch."""
    return (
        f"this consumer has waited {waited:.0f} s for its next batch, which the producer "
        f"cannot publish: the ring slot it must reuse holds a batch this process received "
        f"and still keeps alive ({held} of the ring's {slot_count} slots are held so). "
        "Every consumer of this producer waits until those batches are dropped. Kept "
        "batches are e.g. list(consumer), a batch from next(iter(consumer)) kept while the "
        "loop runs, or outputs that still reference a batch; drop them, or take private "
        "copies: TensorConsumer(copy=True) or tensor.clone()")


def kept_batches_no_memory(held: int, copied: int) -> str:
    """Why the consumer stops when its kept batches cannot be copied privately."""
    return (
        f"this consumer keeps {copied + held} batches (or pieces of them) alive: {copied} "
        f"were copied privately already, and the {held} whose ring slots the producer must "
        "refill now cannot be: no memory is left for their copies and a new mapping of the "
        "ring (or no memory mapping: vm.max_map_count; each kept batch takes one or two). "
        "Keep clones of the pieces you keep (batch['idx'][:2].clone()), which hold no ring "
        "memory, keep fewer batches, or use TensorConsumer(copy=True)")


def detach_reason(ring: Any, index: int, token: int) -> int | None:
    """Why consumer `index` (still this token's) was detached (a REASON_*), or None
    where the entry is another consumer's now."""
    entry = ring.consumer(index)
    return entry["reason"] if entry["token"] == token else None


# -- the producer's side ---------------------------------------------------------------


def next_slot_holders(ring: Any) -> list[dict]:
    """The consumers (table entries) that read the entry in the slot the producer must
    reuse next and still hold it (keep its batch alive); empty if the slot is free or only
    unread (a slow consumer: lag, not a kept batch). A consumer that receives no more
    (detached, left, taken off as silent) only holds: its slot may keep an older batch
    than the ring's last round (the producer put holes there), and it waits only when
    every slot is kept so. Which slot that is, and its readers, the core says
    (ring.next_slot())."""
    nxt = ring.next_slot()
    readers, entry_seq = nxt["readers"], nxt["seq"]  # entry_seq: the entry in that slot
    if readers == 0:
        return []
    return [e for e in ring.consumers() if readers >> e["index"] & 1
            and e["cursor"] is not None
            and (entry_seq < e["cursor"] or e["state"] != ConsumerState.ACTIVE)]


def holding_back(ring: Any) -> list[dict]:
    """The consumers (table entries) that keep the producer from publishing its next
    entry: the slot it must reuse holds an entry they receive and have not released
    (unread, or read and kept). Empty while the producer has a free slot. Consumers that
    receive no more (left, detached) do not count: the producer passes their slots."""
    if RingInfo.of(ring).state != RingState.OPEN:
        return []
    readers = ring.next_slot()["readers"]
    return [e for e in ring.consumers()
            if readers >> e["index"] & 1 and e["state"] == ConsumerState.ACTIVE]


def kept_slot_warning(waited: float, holders: list[dict]) -> str:
    """The producer's warning when it waits for a slot that consumers keep."""
    who = ", ".join(f"consumer {e['index']} (pid {e['pid']})" for e in holders)
    return (
        f"the producer has waited {waited:.0f} s to reuse a ring slot that {who} read and "
        f"still keep{'s' if len(holders) == 1 else ''} alive; every consumer waits "
        "meanwhile. Unless a training step takes that long, the script keeps batches "
        "(list(consumer), a batch from next(iter(consumer)) kept while the loop runs): drop "
        "them, or use TensorConsumer(copy=True)")


def lag_behind_fastest(ring: Any) -> dict[int, tuple[int, bool]]:
    """For each active consumer when two or more are: (entries behind the fastest one,
    whether that is (nearly) the whole ring, so that it holds the producer and the others
    back). Consumers that are all equally slow hold nobody back."""
    entries = {e["index"]: e for e in ring.consumers()
               if e["state"] == ConsumerState.ACTIVE}
    if len(entries) < 2:
        return {}
    lead = max(e["cursor"] for e in entries.values())
    limit = max(RESERVE_SLOTS, ring.slot_count - RESERVE_SLOTS)
    return {index: (lead - e["cursor"], lead - e["cursor"] >= limit)
            for index, e in entries.items()}


def laggard_warning(index: int, pid: int, behind: int, held_back: float) -> str:
    """The producer's warning about a consumer that holds the others back."""
    return (
        f"consumer {index} (pid {pid}) is {behind} batches behind the fastest consumer and "
        f"has held the producer and the others back for {held_back:.0f} s; they go at its "
        "pace (TensorProducer(max_lag=N) detaches consumers that fall further behind)")
