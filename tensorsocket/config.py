"""Settings of TensorProducer and TensorConsumer: one registry, one lookup rule.

Every setting is looked up the same way:

1. the argument, when it is given, checked;
2. else its environment variable (``TENSORSOCKET_*``), parsed and checked;
   a bad value raises ValueError naming the variable, the value and what it
   accepts; an empty variable counts as unset;
3. else the default.

Each :class:`Setting` declares the kind of value it takes (:class:`Kind`:
seconds, an integer in a range, a size in bytes, ...), which checks an
argument and parses the variable's text alike, so both accept the same values
and a bad one of either is refused with an error naming the argument and its
variable. :class:`Resolver` looks up the settings of one producer or consumer
and remembers which came from the environment.

An argument counts as "not given" when it is left out. For settings whose
``None`` only means "automatic" (``name``, ``address``, ``ring_slots``,
``device`` ...), passing ``None`` counts as not given too, so a wrapper that
forwards ``None`` still lets the environment apply. For settings whose
``None`` is a choice of its own - the timeouts (``None``: wait forever) and
``max_lag`` (``None``: lossless) - an explicit ``None`` wins over the
environment, and the environment spells that choice ``none``.

Names, addresses, secrets and devices are checked by tensorsocket.validation, for
an argument and a variable alike. docs/configuration.md is generated from
:data:`SETTINGS` and :data:`OTHER_VARIABLES` by ``tensorsocket config --markdown``
(tensorsocket.cli.config_command), which also checks the ``TENSORSOCKET_*`` variables
of the current environment (:func:`check_environment`, :func:`environment_warnings`).
"""

from __future__ import annotations

import math
import numbers
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .ring import MAX_CONSUMERS, MAX_SLOTS, MIN_SLOTS, RESERVE_SLOTS
from .validation import check_address, check_name, check_token, exposed_address_warning, \
    parse_device

__all__ = [
    "ENV_PREFIX",
    "ArgumentTypeError",
    "Kind",
    "OTHER_VARIABLES",
    "Resolver",
    "SETTINGS",
    "UNSET",
    "Setting",
    "Unset",
    "check_environment",
    "describe_origins",
    "environment_warnings",
    "get",
    "lookup",
]

ENV_PREFIX = "TENSORSOCKET_"
MIN_HEARTBEAT_TIMEOUT = 3.0  # seconds: three of the consumers' heartbeat intervals
_NONE_WORDS = ("none", "inf", "forever")
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


class Unset:
    """Type of :data:`UNSET`, the default of every configurable argument: "not given"."""

    _instance: "Unset | None" = None

    def __new__(cls) -> "Unset":
        """The one instance."""
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        """``UNSET``, as signatures show it."""
        return "UNSET"

    def __bool__(self) -> bool:
        """False, like None."""
        return False

    def __reduce__(self) -> str:
        """Pickles as the module-level singleton."""
        return "UNSET"


UNSET: Any = Unset()
"""Argument default meaning "not given": look at the environment, then the default."""


class ArgumentTypeError(TypeError, ValueError):
    """A setting's argument of a type it does not take. A TypeError, and a ValueError
    too, as a bad value is: code that catches either for a bad setting sees it."""


# -- kinds of value (what a variable's text and an argument may be) --------------------


class Kind:
    """What values a setting takes. parse() reads its variable's text, check() an
    argument; both raise ValueError with a short reason (check(): ArgumentTypeError for
    an argument of another type). takes: what an argument takes, for errors. none: what
    None means where it is a value of its own (wait forever, lossless), else None: then
    a None argument only means "not given"."""

    none: str | None = None

    @property
    def takes(self) -> str:
        """What an argument takes (in words, for errors)."""
        return "a str"

    def parse(self, text: str) -> Any:
        """The value of a variable's text (stripped, not empty)."""
        raise NotImplementedError

    def check(self, value: Any) -> Any:
        """An argument, checked (and an infinite timeout turned into None)."""
        return value


@dataclass(frozen=True)
class Text(Kind):
    """A string checked where it is used (a name, an address, a directory, a secret):
    reader parses the variable's text; an argument is checked by its user (endpoints,
    auth), whose errors name it."""

    reader: Callable[[str], str]

    def parse(self, text: str) -> Any:
        """The text, checked by reader."""
        return self.reader(text)


@dataclass(frozen=True)
class Seconds(Kind):
    """A number of seconds >= minimum (> minimum if above). none: what None (variable:
    `none`, `inf`, `forever`; argument: None or float('inf')) means, if anything.
    at_minimum: why the minimum itself is refused, if above; why_minimum: why there is a
    minimum above 0."""

    minimum: float = 0.0
    none: str | None = None
    above: bool = False
    at_minimum: str = ""
    why_minimum: str = ""

    @property
    def takes(self) -> str:
        """What an argument takes."""
        bound = f"{'>' if self.above else '>='} {self.minimum:g}"
        forever = f", or None or float('inf') ({self.none})" if self.none else ""
        return f"a number of seconds {bound}{forever}"

    def parse(self, text: str) -> Any:
        """The seconds of a variable's text."""
        if self.none and text.lower() in _NONE_WORDS:
            return None
        try:
            value = float(text)
        except ValueError:
            raise ValueError("not a number") from None
        return self._bounded(value)

    def check(self, value: Any) -> Any:
        """A seconds argument: a real number (not a bool), or None where that is a value."""
        if value is None and self.none:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ArgumentTypeError(f"takes {self.takes}, not {value!r}")
        return None if self._bounded(float(value)) is None else value

    def _bounded(self, value: float) -> float | None:
        """value if it is in range; None for infinity where None is a value."""
        finite = "" if self.none else " finite"
        if math.isnan(value) or (math.isinf(value) and not self.none) or value < 0:
            raise ValueError(f"not a{finite} number of seconds >= 0")
        if value < self.minimum:
            why = f": {self.why_minimum}" if self.why_minimum else ""
            raise ValueError(f"{value:g} is under {self.minimum:g} seconds{why}")
        if self.above and value == self.minimum:
            raise ValueError(self.at_minimum or f"{value:g} is refused")
        return None if math.isinf(value) else value


@dataclass(frozen=True)
class Integer(Kind):
    """An integer in lo..hi (hi None: no bound above); none: what None (variable: `none`)
    means, if anything."""

    lo: int
    hi: int | None = None
    none: str | None = None

    @property
    def takes(self) -> str:
        """What an argument takes."""
        bound = f">= {self.lo}" if self.hi is None else f"in {self.lo}..{self.hi}"
        return f"an int {bound}" + (f", or None ({self.none})" if self.none else "")

    def parse(self, text: str) -> Any:
        """The integer of a variable's text."""
        if self.none and text.lower() == "none":
            return None
        try:
            value = int(text)
        except ValueError:
            raise ValueError("not an integer") from None
        return self._bounded(value)

    def check(self, value: Any) -> Any:
        """An integer argument (a whole number, not a bool), or None where that is a
        value."""
        if value is None and self.none:
            return None
        return self._bounded(_whole(value, self.takes))

    def _bounded(self, value: int) -> int:
        """value if it is in range."""
        if self.hi is None and value < self.lo:
            raise ValueError(f"{value} is under {self.lo}")
        if self.hi is not None and not self.lo <= value <= self.hi:
            raise ValueError(f"{value} is outside {self.lo}..{self.hi}")
        return value


def _whole(value: Any, takes: str) -> int:
    """An argument that must be a whole number: an int (a float such as 64e6 too, if
    whole), never a bool."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and \
            math.isfinite(value) and float(value).is_integer():
        return int(float(value))
    raise ArgumentTypeError(f"takes {takes}, not {value!r}")


_SIZE_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
               "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}
# The text forms of a size, for errors: what parse_size() reads.
SIZE_FORMS = ("a whole number with an optional suffix K, M, G, T (or KiB, MiB, GiB, TiB: "
              "the same powers of 1024), e.g. '65536', '64M', '2G'")


def parse_size(text: str) -> int:
    """The bytes of a size's text (stripped): SIZE_FORMS, units case-insensitive, a space
    allowed before the unit. A fraction ('1.5G') is refused rather than rounded: bytes
    are whole, and the same number in a smaller unit says it exactly ('1536M')."""
    m = re.match(r"^(-?)(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)$", text)
    if m is None:
        raise ValueError("not a size in bytes")
    sign, number, unit = m.group(1), m.group(2), m.group(3).lower()
    if sign:
        raise ValueError("negative")
    if unit not in _SIZE_UNITS:
        raise ValueError(f"unknown unit {m.group(3)!r}")
    if not number.isdigit():
        raise ValueError(f"{number} is not a whole number: give the size in a smaller "
                         "unit, 1536M for 1.5G")
    return int(number) * _SIZE_UNITS[unit]


@dataclass(frozen=True)
class Size(Kind):
    """A number of bytes > 0, with an optional unit suffix in a variable (`64M`, see
    parse_size); with off, 0 too (variable: also `off` and the other false words), which
    turns it off. With text, an argument may be such text too, read by the same parser
    as the variable (cache_bytes: share()'s signature takes ``int | str``)."""

    off: bool = False
    text: bool = False

    @property
    def takes(self) -> str:
        """What an argument takes."""
        number = "a number of bytes >= 0 (0 turns it off)" if self.off else \
            "a number of bytes > 0"
        if not self.text:
            return number
        off = ", or 'off'" if self.off else ""
        return f"{number}: an int, or text: {SIZE_FORMS}{off}"

    def parse(self, text: str) -> Any:
        """The bytes of a variable's text."""
        if self.off and text.lower() in _FALSE_WORDS:
            return 0
        value = parse_size(text)
        if value <= 0:
            raise ValueError("not positive")
        return value

    def check(self, value: Any) -> Any:
        """A bytes argument: a whole number (not a bool) in range, or, where text is taken,
        a str read as the variable's text is."""
        if self.text and isinstance(value, str):
            return self.parse(value.strip())
        value = _whole(value, self.takes)
        if value < 0 or (value == 0 and not self.off):
            raise ValueError("negative" if value < 0 else "not positive")
        return value


@dataclass(frozen=True)
class Choice(Kind):
    """One of a few words."""

    choices: tuple[str, ...]

    @property
    def takes(self) -> str:
        """What an argument takes."""
        return " or ".join(repr(c) for c in self.choices)

    def parse(self, text: str) -> Any:
        """The word of a variable's text."""
        return self.check(text)

    def check(self, value: Any) -> Any:
        """One of the choices."""
        if value not in self.choices:
            raise ValueError(f"{value!r} is not one of {', '.join(self.choices)}")
        return value


@dataclass(frozen=True)
class Boolean(Kind):
    """True or False (a variable: `1`, `true`, `yes`, `on` or `0`, `false`, `no`, `off`)."""

    @property
    def takes(self) -> str:
        """What an argument takes."""
        return "True or False"

    def parse(self, text: str) -> Any:
        """The truth of a variable's text."""
        if text.lower() in _TRUE_WORDS:
            return True
        if text.lower() in _FALSE_WORDS:
            return False
        raise ValueError("not a boolean")

    def check(self, value: Any) -> Any:
        """A bool (or a number equal to one: 0, 1)."""
        if not isinstance(value, numbers.Number) or value not in (True, False):
            raise ArgumentTypeError(f"takes {self.takes}, not {value!r}")
        return bool(value)


@dataclass(frozen=True)
class Device(Kind):
    """A device name (`cpu`, `cuda`, `cuda:N`; a consumer's also `auto`). An argument
    is checked where it is used (tensorsocket.validation.parse_device, which names it)."""

    auto: bool = False

    def parse(self, text: str) -> Any:
        """The device of a variable's text (None for `auto`)."""
        if self.auto and text == "auto":
            return None
        try:
            kind, index = parse_device(text)
        except (TypeError, ValueError):
            raise ValueError("not a device") from None
        return kind if index is None else f"{kind}:{index}"


@dataclass(frozen=True)
class Setting:
    """One setting: its argument, environment variable, kind of value, default and
    meaning. Both an argument and the variable's text are checked by its kind, and a
    bad one of either raises an error naming the setting.

    key: unique name in :data:`SETTINGS` (the argument's name, prefixed with
    the side where the two sides have an argument of the same name).
    argument: the keyword argument (None: the environment only).
    env: the environment variable. sides: "producer", "consumer", "both" or
    "share()" (the producer that share() starts).
    default: the value used when neither is given; default_text shows it in
    the table. accepts: what the environment variable accepts. meaning: one
    line. kind: the values it takes (a Kind). secret: its value is never shown (logs,
    errors, `tensorsocket config`), only that it is set and how long it is.
    """

    key: str
    argument: str | None
    env: str
    sides: str
    default: Any
    default_text: str
    accepts: str
    meaning: str
    kind: Kind
    secret: bool = False

    @property
    def none_is_value(self) -> bool:
        """An explicit ``None`` argument is a choice of its own (forever, lossless), not
        "not given"."""
        return self.kind.none is not None

    def shown(self, value: Any) -> str:
        """value as logs, errors and `tensorsocket config` may show it."""
        if self.secret:
            return f"<hidden, {len(str(value))} characters>"
        return repr(value) if isinstance(value, str) else str(value)

    def parse(self, text: str) -> Any:
        """The value of the variable's text; ValueError with a short reason."""
        return self.kind.parse(text)

    def from_env(self, environ: Mapping[str, str] | None = None) -> Any:
        """The environment's value, parsed; UNSET if the variable is unset or empty."""
        text = (os.environ if environ is None else environ).get(self.env)
        if text is None or not text.strip():
            return UNSET
        try:
            return self.kind.parse(text.strip())
        except ValueError as e:
            raise ValueError(
                f"environment variable {self.env}={self.shown(text)} is not valid: it takes "
                f"{self.accepts} ({e}); fix or unset it (see docs/configuration.md)"
            ) from None

    def from_argument(self, value: Any) -> Any:
        """A given argument, checked by its kind (an infinite timeout comes back as None,
        forever); an error names the argument and its variable."""
        try:
            return self.kind.check(value)
        except ArgumentTypeError as e:
            raise ArgumentTypeError(f"{self.argument}= {e}") from None
        except ValueError as e:
            raise ValueError(
                f"{self.argument}={self.shown(value)} is not valid: it takes "
                f"{self.kind.takes} ({e}), as its variable {self.env} does") from None

    def given(self, value: Any) -> bool:
        """True if an argument value counts as given (it wins over the environment)."""
        return value is not UNSET and (value is not None or self.none_is_value)


# -- kinds of the settings' values ----------------------------------------------------


def _parse_dir(text: str) -> str:
    if not os.path.isabs(text):
        raise ValueError("not an absolute path")
    return os.path.normpath(text)


_TIMEOUT = Seconds(none="wait forever")
_TIMEOUT_ACCEPTS = "seconds >= 0, or `none` (wait forever)"
_SIZE_ACCEPTS = ("bytes > 0, a whole number, optionally with a suffix `K`, `M`, `G`, `T` "
                 "or `KiB` .. `TiB` (powers of 1024), e.g. `64M`")

SETTINGS: dict[str, Setting] = {s.key: s for s in (
    # -- both sides --------------------------------------------------------------------
    Setting("name", "name", "TENSORSOCKET_NAME", "both", "default", "`default`",
            "1-64 letters, digits, `_`, `.`, `-`",
            "rendezvous name: a consumer finds the producer of the same name; one live "
            "producer per name (with `port=` and no name: `port<N>`)",
            Text(check_name)),
    Setting("address", "address", "TENSORSOCKET_ADDRESS", "both", None,
            "ipc socket `<runtime dir>/<name>.sock`",
            "`ipc://PATH` or `tcp://HOST:PORT`",
            "control-plane address; an explicit `port=` or `address=` argument overrides the "
            "variable; a non-loopback TCP address makes the producer and `tensorsocket "
            "config` warn",
            Text(check_address)),
    Setting("runtime_dir", None, "TENSORSOCKET_RUNTIME_DIR", "both", None,
            "`$XDG_RUNTIME_DIR/tensorsocket` if `XDG_RUNTIME_DIR` is a directory of this "
            "user, else `/tmp/tensorsocket-<uid>`",
            "an absolute path; created mode 0700 if missing, else it must be a directory of "
            "this user with mode 0700",
            "directory of the ipc sockets and name locks; producer and consumers must agree",
            Text(_parse_dir)),
    Setting("auth_token", "auth_token", "TENSORSOCKET_AUTH_TOKEN", "both", None,
            "producer: a random one; consumer: read from `<runtime dir>/<name>.secret`",
            "16-1024 printable ASCII characters, no spaces",
            "the secret a consumer must prove it knows to a producer on a TCP address (and the "
            "producer to it, first; the secret never crosses the socket): the producer writes "
            "it to `<runtime dir>/<name>.secret` (mode 0600) for consumers of its user; give "
            "both sides the same value where a consumer cannot read that file "
            "(another runtime directory, another container)",
            Text(check_token), secret=True),
    # -- consumer ----------------------------------------------------------------------
    Setting("timeout", "timeout", "TENSORSOCKET_TIMEOUT", "consumer", 60.0, "60",
            _TIMEOUT_ACCEPTS,
            "seconds a consumer waits for its producer to answer, then `ProducerNotFound`",
            _TIMEOUT),
    Setting("batch_timeout", "batch_timeout", "TENSORSOCKET_BATCH_TIMEOUT", "consumer", None,
            "none (as long as the producer lives)", _TIMEOUT_ACCEPTS,
            "seconds a consumer waits for one batch, then `TimeoutError`",
            _TIMEOUT),
    Setting("consumer_device", "device", "TENSORSOCKET_CONSUMER_DEVICE", "consumer", None,
            "`auto`: where the producer put them",
            "`auto`, `cpu`, `cuda`, `cuda:N`",
            "where a consumer's tensors are delivered (see docs/gpu.md)",
            Device(auto=True)),
    # -- producer ----------------------------------------------------------------------
    Setting("min_consumers", "min_consumers", "TENSORSOCKET_MIN_CONSUMERS", "producer", 1,
            "1", f"an integer in 0..{MAX_CONSUMERS}",
            "consumers attached before the first batch is published",
            Integer(0, MAX_CONSUMERS)),
    Setting("start_timeout", "start_timeout", "TENSORSOCKET_START_TIMEOUT", "producer", None,
            "none (forever)", _TIMEOUT_ACCEPTS,
            "seconds the producer waits for `min_consumers` (and for one consumer while none "
            "is attached), then `TimeoutError`",
            _TIMEOUT),
    Setting("start_grace", "start_grace", "TENSORSOCKET_START_GRACE", "producer", 3.0, "3",
            "a number of seconds >= 0",
            "seconds the producer waits, once `min_consumers` are attached, before its first "
            "batch, so that jobs started together all begin at the same batch",
            Seconds()),
    Setting("park_hold", "park_hold", "TENSORSOCKET_PARK_HOLD", "producer", 10.0, "10",
            "a number of seconds >= 0",
            "seconds a consumer that stopped between epochs (its job runs another loader, "
            "e.g. validation) keeps its place in the ring while other consumers read, so "
            "that jobs alternating loaders read the same epochs; 0 keeps no place",
            Seconds()),
    Setting("heartbeat_timeout", "heartbeat_timeout", "TENSORSOCKET_HEARTBEAT_TIMEOUT",
            "producer", 30.0, "30",
            f"seconds >= {MIN_HEARTBEAT_TIMEOUT:g}, or `none` (never evict)",
            "seconds without a heartbeat after which the producer takes off a consumer whose "
            "process lives on (stopped, or a step holding the GIL), so that the others go on "
            "(the batches it holds stay intact); consumers send one every second from a "
            "Python thread, through long training steps too unless one holds the GIL",
            Seconds(MIN_HEARTBEAT_TIMEOUT, none="never evict",
                    why_minimum="consumers heartbeat every second")),
    Setting("publish_timeout", "publish_timeout", "TENSORSOCKET_PUBLISH_TIMEOUT", "producer",
            None, "none (forever)", _TIMEOUT_ACCEPTS,
            "seconds the producer waits for a free slot, then `TimeoutError`",
            _TIMEOUT),
    Setting("ring_slots", "ring_slots", "TENSORSOCKET_RING_SLOTS", "producer", None,
            f"max(4, window + {RESERVE_SLOTS}, max_lag + {RESERVE_SLOTS})",
            f"an integer in {MIN_SLOTS}..{MAX_SLOTS}",
            "slots in the ring (`consumer_max_buffer_size=` is the same argument)",
            Integer(MIN_SLOTS, MAX_SLOTS)),
    Setting("slot_bytes", "slot_bytes", "TENSORSOCKET_SLOT_BYTES", "producer", None,
            "first batch x 1.5", _SIZE_ACCEPTS,
            "capacity of one slot; a larger batch raises `BatchTooLarge`",
            Size()),
    Setting("ring_bytes", "ring_bytes", "TENSORSOCKET_RING_BYTES", "producer", None,
            "none", _SIZE_ACCEPTS,
            "total slot memory: sets the slot count from `slot_bytes` (unless `ring_slots` "
            "is set)",
            Size()),
    Setting("max_lag", "max_lag", "TENSORSOCKET_MAX_LAG", "producer", None,
            "none (lossless)",
            f"an integer in 1..{MAX_SLOTS - RESERVE_SLOTS}, or `none` (lossless)",
            "detach a consumer more than this many batches behind the fastest one",
            Integer(1, MAX_SLOTS - RESERVE_SLOTS, none="lossless")),
    Setting("lag_policy", "lag_policy", "TENSORSOCKET_LAG_POLICY", "producer", "raise",
            "`raise`", "`raise` or `rejoin`",
            "what a detached laggard does: raise `ConsumerDetached`, or warn and attach "
            "again as a late joiner",
            Choice(("raise", "rejoin"))),
    Setting("producer_device", "device", "TENSORSOCKET_PRODUCER_DEVICE", "producer", None,
            "`cpu` (host memory only)", "`cpu`, `cuda`, `cuda:N`",
            "`cuda:N`: the ring's slots also live in GPU memory, one copy per batch for all "
            "consumers",
            Device()),
    Setting("device_fallback", "device_fallback", "TENSORSOCKET_DEVICE_FALLBACK", "producer",
            True, "true", "`1`, `true`, `yes`, `on` or `0`, `false`, `no`, `off`",
            "where the GPU ring cannot work: warn and use the host ring (false: raise "
            "`GPUUnavailable`)",
            Boolean()),
    Setting("release_timeout", "release_timeout", "TENSORSOCKET_RELEASE_TIMEOUT", "producer",
            30.0, "30", _TIMEOUT_ACCEPTS,
            "seconds `close()` waits for consumers to unmap a GPU ring; then it returns and a "
            "keeper thread frees the device memory once the last consumer closed or died",
            _TIMEOUT),
    Setting("worker_heap_pad", "worker_heap_pad", "TENSORSOCKET_WORKER_HEAP_PAD", "producer",
            16 << 20, "16M", _SIZE_ACCEPTS.replace("bytes > 0", "bytes >= 0") +
            "; `0` or `off` turns it off",
            "bytes each DataLoader worker of the producer keeps at the top of its malloc "
            "heap (glibc), so that decoding does not fault memory in again for every sample "
            "(docs/usage.md, \"The loader's workers\")",
            Size(off=True)),
    Setting("cache_bytes", "cache_bytes", "TENSORSOCKET_CACHE_BYTES", "producer", 0,
            "0 (off)", _SIZE_ACCEPTS.replace("bytes > 0", "bytes >= 0") +
            "; `0` or `off` turns it off; the argument takes the same text",
            "shared memory the producer may keep a torch DataLoader's decoded samples in: "
            "when the whole dataset fits, they are kept during the first epoch and every "
            "later epoch is built from them in its sampler's order, without running the "
            "loader; when it does not fit, nothing is cached and a warning says how much "
            "it needs",
            Size(off=True, text=True)),
    # -- share() -----------------------------------------------------------------------
    Setting("idle_timeout", "idle_timeout", "TENSORSOCKET_IDLE_TIMEOUT", "share()", 60.0,
            "60", "seconds > 0, or `none` (never)",
            "seconds a producer started by `share()` keeps running with no consumer "
            "attached before it ends (0 is refused: it would end even before its first "
            "consumer attaches)",
            Seconds(none="never", above=True, at_minimum=(
                "0 is refused: the producer would end whenever no consumer is attached, "
                "even before the first one attaches"))),
)}

OTHER_VARIABLES: dict[str, str] = {
    "XDG_RUNTIME_DIR": "the base of the default runtime directory (see "
                       "`TENSORSOCKET_RUNTIME_DIR`)",
    "TENSORSOCKET_LIBCUDA": "the CUDA driver library the core loads instead of "
                            "`libcuda.so.1` (tests point it at the driver test double)",
    "TENSORSOCKET_WERROR": "`1` at build time (`pip install`): compile the core with "
                           "`-Wall -Wextra -Werror`",
    "TENSORSOCKET_SANITIZE": "`1` at build time: compile the core with ASan and UBSan",
}


# -- lookup ---------------------------------------------------------------------------


def lookup(key: str, value: Any = UNSET,
           environ: Mapping[str, str] | None = None) -> tuple[Any, str]:
    """(value, source) of setting `key` for argument `value`.

    source is "argument", "environment" or "default"; see the module
    docstring for the rule. Raises KeyError for an unknown key, ValueError
    for a bad environment value or argument, ArgumentTypeError (a TypeError
    and a ValueError) for an argument of a type the setting does not take;
    an infinite timeout argument comes back as None (forever).
    """
    setting = SETTINGS[key]
    if setting.given(value):
        return setting.from_argument(value), "argument"
    env = setting.from_env(environ)
    if env is not UNSET:
        return env, "environment"
    return setting.default, "default"


def get(key: str, value: Any = UNSET, environ: Mapping[str, str] | None = None) -> Any:
    """The value of setting `key`: the argument if given, else the environment
    variable's, else the default (see :func:`lookup`)."""
    return lookup(key, value, environ)[0]


class Resolver:
    """The settings of one object (a producer, a consumer), each looked up by the rule
    above, remembering which came from the environment: they are logged, and errors
    about a value name its variable (``max_lag=3 (from TENSORSOCKET_MAX_LAG)``)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        """No setting looked up yet; environ: the environment (default os.environ)."""
        self._environ = environ
        self.origins: dict[str, str] = {}  # setting key -> the variable it came from

    def get(self, key: str, value: Any = UNSET) -> Any:
        """The value of setting `key` for argument `value` (see :func:`lookup`)."""
        value, source = lookup(key, value, self._environ)
        if source == "environment":
            self.origins[key] = SETTINGS[key].env
        return value

    def show(self, key: str, value: Any) -> str:
        """``argument=value`` for messages, naming the variable it came from."""
        text = f"{SETTINGS[key].argument}={value}"
        env = self.origins.get(key)
        return f"{text} (from {env})" if env else text

    def describe(self) -> str:
        """``VAR=value, ...`` of the settings that came from the environment."""
        return describe_origins(self.origins, self._environ)


def describe_origins(origins: Mapping[str, str],
                     environ: Mapping[str, str] | None = None) -> str:
    """``VAR=value, ...`` of the environment variables in `origins` (setting key ->
    variable), for logs."""
    env = os.environ if environ is None else environ
    return ", ".join(f"{SETTINGS[key].env}={SETTINGS[key].shown(env.get(SETTINGS[key].env, ''))}"
                     for key in origins)


def check_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """Problems with the ``TENSORSOCKET_*`` variables of an environment: values that
    do not parse, and names that are no setting (a typo is otherwise ignored)."""
    env = os.environ if environ is None else environ
    known = {s.env for s in SETTINGS.values()} | set(OTHER_VARIABLES)
    problems = []
    for setting in SETTINGS.values():
        try:
            setting.from_env(env)
        except ValueError as e:
            problems.append(str(e))
    for var in sorted(env):
        if var.startswith(ENV_PREFIX) and var not in known:
            problems.append(f"{var} is not a tensorsocket setting (a typo?); it is ignored")
    return problems


def environment_warnings(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of the ``TENSORSOCKET_*`` variables that work but are likely a mistake: a
    control-plane address reachable from other machines (a producer warns about it too)."""
    env = os.environ if environ is None else environ
    setting = SETTINGS["address"]
    try:
        address = setting.from_env(env)
    except ValueError:  # check_environment reports it
        return []
    text = None if address is UNSET else exposed_address_warning(address)
    return [] if text is None else [f"{setting.env}={address}: {text}"]
