"""What sharing one loader does for a producer, from what its ring segment measured.

Every fact here is derived once, from counters the ring header keeps (docs/cli.md,
"What sharing saves"):

- the loader's CPU: the producer's process tree CPU (its DataLoader workers, those of
  past epochs that exited too, pin-memory thread and collation included) less the CPU the
  producer process spent before its loader's first epoch began (imports, set-up,
  ``setup_cpu_ns``) and the CPU its own thread spent publishing (encoding and copying
  batches into the ring, ``publish_cpu_ns``);
- the loading CPU sharing saved: each batch the loader made was delivered
  ``batches_delivered / batches_published`` times; every consumer that got it without
  loading it again saved what loading it cost, so the saving is the loader's CPU times
  (that ratio - 1);
- the bottleneck over an interval, from how long the producer waited for free slots and
  each active consumer waited for batches, and which consumers hold the slot the producer
  must fill next (ring.next_slot()).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# The producer "hardly waits" for slots: below this fraction of the interval.
LOADER_BOUND_PRODUCER_WAIT = 0.2
# A consumer "waits for batches": at least this fraction of the interval. The loader is the
# bottleneck when every active consumer does while the producer hardly waits for slots. Not
# higher: on a machine whose cores are all busy a consumer that lacks batches still spends
# much of its time runnable but not running, which is not waiting (seen: a loader-bound
# demo run on 2 cores, consumers waiting 48 to 62%, the producer 0%).
LOADER_BOUND_CONSUMER_WAIT = 0.25
# The producer "waits for slots": at least this fraction of the interval. A consumer is
# then the bottleneck: the one the producer waits for.
CONSUMER_BOUND_PRODUCER_WAIT = 0.5


@dataclass(frozen=True)
class ConsumerWait:
    """One active consumer over the interval, as the bottleneck is judged from it."""

    index: int  # its consumer table entry
    pid: int
    waiting: float  # fraction of the interval it spent waiting for batches
    holds_next: bool  # its bit is on the slot the producer fills next (it waits for it)


@dataclass(frozen=True)
class Bottleneck:
    """Which side limits the producer's pace over an interval."""

    side: str  # "loader", "consumer", "balanced" or "idle"
    producer_waiting: float  # fraction of the interval the producer waited for slots
    consumer: ConsumerWait | None = None  # side "consumer": the one everyone waits for
    others_waiting: float | None = None  # the other active consumers' least waiting
    consumers_waiting: float | None = None  # all active consumers' least waiting


def loader_cpu_seconds(process_cpu: float | None, setup_cpu: float,
                       publish_cpu: float | None) -> float | None:
    """The loader's CPU: the producer's process tree less its set-up before the loader
    began and its publishing (None: unknown)."""
    if process_cpu is None or publish_cpu is None:
        return None
    return max(0.0, process_cpu - setup_cpu - publish_cpu)


def loader_cpu_saved_seconds(loader_cpu: float | None, batches_delivered: int | None,
                             batches_published: int | None) -> float | None:
    """Loading CPU the consumers did not spend: loader CPU x (deliveries per batch - 1),
    at least 0; None when a count or the loader's CPU is unknown or nothing was published."""
    if loader_cpu is None or batches_delivered is None or not batches_published:
        return None
    return max(0.0, loader_cpu * (batches_delivered / batches_published - 1))


def bottleneck(producer_waiting: float | None, consumers: Sequence[ConsumerWait],
               published: int | None = None) -> Bottleneck | None:
    """The bottleneck over an interval; None without a measured interval or an active
    consumer with a measured wait.

    "idle": no batch was published in the interval (`published` == 0) while the producer
    did not wait for slots: it is between epochs, waiting for consumers or done, so
    neither side is holding the other up.
    "loader": the producer waited for slots less than LOADER_BOUND_PRODUCER_WAIT and every
    consumer waited for batches at least LOADER_BOUND_CONSUMER_WAIT. "consumer": the
    producer waited for slots at least CONSUMER_BOUND_PRODUCER_WAIT; the bottleneck is,
    among the consumers holding the slot it must fill next (all of them where none does),
    the one that waited least. "balanced": neither."""
    if producer_waiting is None or not consumers:
        return None
    least = min(c.waiting for c in consumers)
    if published == 0 and producer_waiting < CONSUMER_BOUND_PRODUCER_WAIT:
        return Bottleneck("idle", producer_waiting, consumers_waiting=least)
    if producer_waiting < LOADER_BOUND_PRODUCER_WAIT and least >= LOADER_BOUND_CONSUMER_WAIT:
        return Bottleneck("loader", producer_waiting, consumers_waiting=least)
    if producer_waiting >= CONSUMER_BOUND_PRODUCER_WAIT:
        holding = [c for c in consumers if c.holds_next] or list(consumers)
        slowest = min(holding, key=lambda c: (c.waiting, c.index))
        others = [c.waiting for c in consumers if c is not slowest]
        return Bottleneck("consumer", producer_waiting, consumer=slowest,
                          others_waiting=min(others) if others else None,
                          consumers_waiting=least)
    return Bottleneck("balanced", producer_waiting, consumers_waiting=least)


def _pct(x: float) -> str:
    """A fraction as a whole percentage."""
    return f"{100 * x:.0f}%"


def bottleneck_text(b: Bottleneck | None) -> str:
    """The status line's words for a bottleneck."""
    if b is None:
        return "bottleneck: - (needs two readings and an active consumer)"
    if b.side == "loader":
        return (f"bottleneck: the loader (consumers wait for batches "
                f"{_pct(b.consumers_waiting or 0.0)} of the time)")
    if b.side == "consumer" and b.consumer is not None:
        others = "" if b.others_waiting is None else \
            f", the others wait {_pct(b.others_waiting)}"
        return (f"bottleneck: consumer {b.consumer.index} (pid {b.consumer.pid}): the "
                f"producer waits for its slots {_pct(b.producer_waiting)}{others}")
    if b.side == "idle":
        return "bottleneck: none (idle: no batch published in the interval)"
    return (f"bottleneck: none (balanced: the producer waits for slots "
            f"{_pct(b.producer_waiting)}, consumers for batches at least "
            f"{_pct(b.consumers_waiting or 0.0)})")


def _seconds(x: float) -> str:
    """CPU seconds: two decimals below 1 s (publishing costs little), else one."""
    return f"{x:.2f}" if x < 1 else f"{x:.1f}"


def saved_text(saved: float | None, loader_cpu: float | None, publish_cpu: float | None,
               batches_published: int | None, batches_delivered: int | None) -> str:
    """The status line's words for the loading CPU saved so far."""
    if saved is None:
        return "loading CPU saved so far: - (not measured)"
    return (f"loading CPU saved so far: {_seconds(saved)} s (loader "
            f"{_seconds(loader_cpu or 0.0)} s for {batches_published} batches, delivered "
            f"{batches_delivered} times; publishing cost {_seconds(publish_cpu or 0.0)} s)")
