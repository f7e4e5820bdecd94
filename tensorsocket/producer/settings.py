"""The producer's settings: the constructor's arguments resolved (the argument, else its
``TENSORSOCKET_*`` variable, else the default) and checked, in one object that the
producer's parts share and its public attributes read and write (``setting``)."""

from __future__ import annotations

from typing import Any, Callable

from .. import config
from ..config import UNSET
from ..ring import MAX_SLOTS, RESERVE_SLOTS
from ..control.endpoints import Endpoint, resolve
from ..validation import parse_device

DEFAULT_RUBBER_BAND_PCT = 0.005  # of an epoch's batches (sizing.DEFAULT_MAX_WINDOW caps it)


class ProducerSettings:
    """The settings of one producer, resolved from the arguments of TensorProducer (see
    its docstring for each); ``resolver`` names the variable a value came from, for
    messages and the log."""

    def __init__(self, *, name: str | None, port: int | str | None, address: str | None,
                 auth_token: str | None, min_consumers: Any, start_timeout: Any,
                 start_grace: Any, park_hold: Any, heartbeat_timeout: Any, ring_slots: Any,
                 consumer_max_buffer_size: int | None, slot_bytes: Any, ring_bytes: Any,
                 max_leaves: int | None, publish_timeout: Any, rubber_band_pct: float | None,
                 rubber_band: int | None, max_lag: Any, lag_policy: Any, device: Any,
                 device_fallback: Any, release_timeout: Any, worker_heap_pad: Any,
                 cache_bytes: Any, pack_fn: Callable[[Any], Any] | None) -> None:
        """Resolve and check TensorProducer's parameters of the same names (UNSET: not
        given; ValueError, TypeError for a wrong one). In the order the producer always
        looked them up: the first wrong one is the one reported."""
        given = self.resolver = config.Resolver()
        if ring_slots is None or ring_slots is UNSET:
            ring_slots = consumer_max_buffer_size  # the original's name for it
        elif consumer_max_buffer_size is not None:
            raise ValueError("give ring_slots= or consumer_max_buffer_size=, not both")
        self.ring_slots: int | None = given.get("ring_slots", ring_slots)
        self.slot_bytes: int | None = given.get("slot_bytes", slot_bytes)
        self.ring_bytes: int | None = given.get("ring_bytes", ring_bytes)
        self.max_lag: int | None = given.get("max_lag", max_lag)
        where: Any = given.get("producer_device", device)
        self._check_window(rubber_band_pct, rubber_band)
        kind, ordinal = parse_device(where)
        # The device of the ring's slots: "cuda:N" or "cpu" (ring_maker falls back to cpu).
        self.device_ordinal: int | None = (ordinal or 0) if kind == "cuda" else None
        self.device = "cpu" if self.device_ordinal is None else f"cuda:{self.device_ordinal}"
        self.device_fallback: bool = given.get("device_fallback", device_fallback)
        self.release_timeout: float | None = given.get("release_timeout", release_timeout)
        self.worker_heap_pad: int = given.get("worker_heap_pad", worker_heap_pad)
        self.cache_bytes: int = given.get("cache_bytes", cache_bytes)
        self.lag_policy: str = given.get("lag_policy", lag_policy)
        self.pack_fn: Callable[[Any], Any] | None = pack_fn
        self.min_consumers: int = given.get("min_consumers", min_consumers)
        self.start_timeout: float | None = given.get("start_timeout", start_timeout)
        self.start_grace = float(given.get("start_grace", start_grace))
        self.park_hold = float(given.get("park_hold", park_hold))
        silence = given.get("heartbeat_timeout", heartbeat_timeout)
        self.heartbeat_timeout: float | None = None if silence is None else float(silence)
        self.publish_timeout: float | None = given.get("publish_timeout", publish_timeout)
        self.max_leaves: int | None = max_leaves
        # (never through the Resolver: the log of settings from the environment shows values)
        self.auth_token: str | None = auth_token
        self.endpoint: Endpoint = self._endpoint(name, port, address)

    def _check_window(self, rubber_band_pct: float | None, rubber_band: int | None) -> None:
        """The late-joiner window's arguments, checked (sizing computes the window)."""
        if rubber_band_pct is not None and not 0 <= float(rubber_band_pct) <= 1:
            raise ValueError(f"rubber_band_pct must be in 0..1, got {rubber_band_pct}")
        most = MAX_SLOTS - RESERVE_SLOTS
        if rubber_band is not None and not 0 <= int(rubber_band) <= most:
            raise ValueError(f"rubber_band must be in 0..{most} batches, got "
                             f"{rubber_band}")
        self.explicit_window = rubber_band is not None or rubber_band_pct is not None
        self.rubber_band_pct = DEFAULT_RUBBER_BAND_PCT if rubber_band_pct is None \
            else float(rubber_band_pct)
        self.rubber_band = int(rubber_band) if rubber_band is not None else None

    def _endpoint(self, name: str | None, port: int | str | None,
                  address: str | None) -> Endpoint:
        """Where the producer listens: a port, else the address setting, under the name."""
        given = self.resolver
        name = given.get("name", name)
        if port is None:
            address = given.get("address", address)
        given.get("runtime_dir")  # (looked up by resolve(); here for the log of its origin)
        return resolve(name, port, address, for_producer=True)

    def show(self, key: str, value: Any) -> str:
        """``argument=value`` for messages, naming the variable it came from."""
        return self.resolver.show(key, value)


def setting(key: str, doc: str) -> Any:
    """A property of the producer that reads and writes its settings' `key`. The parts
    read the settings when they use them, so a value set on the producer counts from then
    on, except park_hold, heartbeat_timeout and release_timeout, which the control server
    and the finalizer take when the producer starts (as before the split)."""

    def read(self: Any) -> Any:
        return getattr(self._settings, key)

    def write(self: Any, value: Any) -> None:
        setattr(self._settings, key, value)

    read.__doc__ = doc
    return property(read, write, doc=doc)
