"""What the producers of this user are doing, read from their ring segments.

Every producer keeps its ring in a POSIX shared-memory segment named
``tensorsocket-<uid>-<name>-<pid>``; its header holds the producer's pid and
counters, and its consumer table holds each consumer's pid, cursor and
counters. ``survey()`` maps every such segment read-only in spirit (it only
reads), so no daemon and no extra socket are needed, and looking never
disturbs a producer. Rates come from two readings ``interval`` seconds apart.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass, field

from . import _core
from .endpoints import segment_prefix

SHM_DIR = "/dev/shm"
_CONSUMER_STATES = {
    _core.CONSUMER_PENDING: "joining",
    _core.CONSUMER_ACTIVE: "active",
    _core.CONSUMER_LEAVING: "left",
    _core.CONSUMER_DETACHED: "detached",
}
_REASONS = {_core.REASON_LEFT: "left", _core.REASON_LAGGED: "lagged",
            _core.REASON_DIED: "died"}
DL_CUDA = 2


@dataclass
class ConsumerStatus:
    """One consumer table entry of a ring."""

    index: int
    pid: int
    alive: bool
    state: str  # joining / active / left / detached
    reason: str  # why it stopped receiving ("" while it receives)
    batch_size: int | None  # samples per batch it asked for (None: the loader's)
    cursor: int | None  # next ring entry it reads
    lag: int  # entries published that it has not taken yet
    delivered: int  # ring entries it took
    delivered_bytes: int
    rate: float | None = None  # ring entries per second over the interval
    waiting: float | None = None  # fraction of the interval spent waiting for batches
    idle_seconds: float | None = None  # since it last took an entry


@dataclass
class ProducerStatus:
    """One producer's ring, as its segment shows it."""

    name: str
    segment: str  # /dev/shm name, without the leading '/'
    pid: int
    alive: bool
    state: str  # running / finished / dead / unreadable
    error: str = ""  # why the segment could not be read (state "unreadable")
    epoch: int | None = None  # epoch of the newest published batch
    batch_index: int | None = None  # its index in that epoch
    published: int = 0  # ring entries published (batches and epoch ends)
    rate: float | None = None  # entries per second over the interval
    slot_count: int = 0
    occupied: int = 0  # slots some consumer still holds
    slot_bytes: int = 0
    batch_bytes: int | None = None  # bytes of the newest batch in its slot
    segment_bytes: int = 0
    device: str = "cpu"
    window: int = 0
    max_lag: int = 0
    lag_detached: int = 0
    publish_wait_fraction: float | None = None  # of the interval, waiting for a free slot
    cpu_seconds: float | None = None  # producer and its child processes (loader workers)
    cpu_rate: float | None = None  # cores the producer's process tree uses now
    consumers: list[ConsumerStatus] = field(default_factory=list)

    @property
    def active_consumers(self) -> int:
        """Consumers that receive new batches."""
        return sum(1 for c in self.consumers if c.state == "active" and c.alive)

    @property
    def cpu_saved_rate(self) -> float | None:
        """Cores sharing saves now: the loader's cores times (active consumers - 1),
        i.e. what each consumer running its own copy of this loader would add."""
        if self.cpu_rate is None or self.active_consumers < 2:
            return None if self.cpu_rate is None else 0.0
        return self.cpu_rate * (self.active_consumers - 1)


def _segment_pattern() -> re.Pattern[str]:
    """Matches this user's segment names; groups: producer name, pid."""
    prefix = segment_prefix("")  # "tensorsocket-<uid>--"
    return re.compile(re.escape(prefix[:-1]) + r"(?P<name>.+)-(?P<pid>\d+)$")


def segments() -> list[tuple[str, str, int]]:
    """(segment, producer name, pid) of every tensorsocket segment of this user."""
    pattern = _segment_pattern()
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except OSError:
        return []
    out = []
    for entry in entries:
        m = pattern.match(entry)
        if m:
            out.append((entry, m.group("name"), int(m.group("pid"))))
    return out


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (it may be another program after reuse)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_tree_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) of pid and every live descendant, None if pid is gone.

    DataLoader workers are children of the producer, so this is what running
    the loader costs."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        p = int(entry)
        parents[p] = int(fields[1])
        cpu[p] = (int(fields[11]) + int(fields[12])) / tick
    if pid not in cpu:
        return None
    children: dict[int, list[int]] = {}
    for p, parent in parents.items():
        children.setdefault(parent, []).append(p)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        todo.extend(children.get(p, ()))
    return total


def _read(segment: str, name: str, pid: int) -> tuple[ProducerStatus, dict | None]:
    """One reading of a segment: the status without rates, and the raw counters."""
    try:
        ring = _core.Ring.open("/" + segment)
    except Exception as e:  # another version, being created, torn down meanwhile
        alive = pid_alive(pid)
        return ProducerStatus(name=name, segment=segment, pid=pid, alive=alive,
                              state="unreadable", error=str(e)), None
    try:
        info = ring.info()
        entries = ring.consumers()
    finally:
        ring.close()
    alive = _core.process_alive(info["producer_pid"], info["producer_start_time"])
    if not alive:
        state = "dead"
    elif info["state"] == _core.RING_FINISHED:
        state = "finished"
    else:
        state = "running"
    consumers = []
    for c in entries:
        st = _CONSUMER_STATES.get(c["state"], f"state {c['state']}")
        consumers.append(ConsumerStatus(
            index=c["index"], pid=c["pid"],
            alive=_core.process_alive(c["pid"], c["start_time"]),
            state=st, reason=_REASONS.get(c["reason"], ""),
            batch_size=c["batch_size"] or None,
            cursor=None if c["cursor"] >= 2**63 else c["cursor"],
            lag=max(0, c["lag"]), delivered=c["delivered"],
            delivered_bytes=c["delivered_bytes"],
            idle_seconds=max(0.0, (time.monotonic_ns() - c["progress_ns"]) / 1e9),
        ))
    device = "cpu" if info["device_type"] != DL_CUDA else f"cuda:{info['device_ordinal']}"
    status = ProducerStatus(
        name=name, segment=segment, pid=info["producer_pid"], alive=alive, state=state,
        epoch=info["newest_epoch"] if info["newest_valid"] else None,
        batch_index=info["newest_index"] if info["newest_valid"] else None,
        published=info["published"], slot_count=info["slot_count"],
        occupied=info["occupied"], slot_bytes=info["slot_bytes"],
        batch_bytes=info["newest_bytes"] if info["newest_valid"] and info["newest_bytes"]
        else None,
        segment_bytes=info["segment_bytes"], device=device, window=info["window"],
        max_lag=info["max_lag"], lag_detached=info["lag_detached"],
        cpu_seconds=process_tree_cpu(info["producer_pid"]) if alive else None,
        consumers=consumers,
    )
    raw = {"t": time.monotonic(), "published": info["published"],
           "publish_wait_ns": info["publish_wait_ns"],
           "consumers": {c["index"]: (c["token"], c["delivered"], c["wait_ns"])
                         for c in entries}}
    return status, raw


def _add_rates(now: ProducerStatus, raw: dict, before: dict) -> None:
    """Fill the rates of a reading from the difference with an earlier one."""
    dt = raw["t"] - before["t"]
    if dt <= 0:
        return
    now.rate = max(0, raw["published"] - before["published"]) / dt
    now.publish_wait_fraction = min(
        1.0, max(0, raw["publish_wait_ns"] - before["publish_wait_ns"]) / 1e9 / dt)
    for c in now.consumers:
        earlier, later = before["consumers"].get(c.index), raw["consumers"].get(c.index)
        if earlier is not None and later is not None and earlier[0] == later[0]:  # same token
            _, d0, w0 = earlier
            _, d1, w1 = later
            c.rate = max(0, d1 - d0) / dt
            c.waiting = min(1.0, max(0, w1 - w0) / 1e9 / dt)


class Survey:
    """Successive readings of every producer; each ``take()`` returns the producers
    with rates measured since the previous reading (the first has none, unless
    ``interval`` > 0, which takes two readings that far apart)."""

    def __init__(self) -> None:
        self._previous: dict[str, tuple[dict, float | None]] = {}

    def take(self, interval: float = 0.0, name: str | None = None) -> list[ProducerStatus]:
        """Read every segment (only producer `name`'s if given)."""
        if interval > 0 and not self._previous:
            self.take(0.0, name)
            time.sleep(interval)
        out = []
        seen = {}
        for segment, seg_name, pid in segments():
            if name is not None and seg_name != name:
                continue
            status, raw = _read(segment, seg_name, pid)
            if raw is not None and status.alive:
                previous = self._previous.get(segment)
                if previous is not None:
                    _add_rates(status, raw, previous[0])
                    if status.cpu_seconds is not None and previous[1] is not None:
                        dt = raw["t"] - previous[0]["t"]
                        if dt > 0:
                            status.cpu_rate = max(0.0, status.cpu_seconds - previous[1]) / dt
                seen[segment] = (raw, status.cpu_seconds)
            out.append(status)
        self._previous = seen
        return out


def survey(interval: float = 0.5, name: str | None = None) -> list[ProducerStatus]:
    """Every producer of this user, with rates over `interval` seconds (0: no rates)."""
    return Survey().take(interval, name)


def as_json(producers: list[ProducerStatus], interval: float) -> dict:
    """A JSON-ready document of a survey (the ``status --json`` format, version 1)."""
    docs = []
    for p in producers:
        d = asdict(p)
        d["active_consumers"] = p.active_consumers
        d["cpu_saved_rate"] = p.cpu_saved_rate
        docs.append(d)
    return {"format": 1, "interval": interval, "time": time.time(), "producers": docs}


# -- text ------------------------------------------------------------------------------


def human_bytes(n: float | None) -> str:
    """1.5 MiB style."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    """A number or '-'."""
    return "-" if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    """A fraction as a percentage or '-'."""
    return "-" if x is None else f"{100 * x:.0f}%"


def _table(rows: list[list[str]], indent: str = "") -> list[str]:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in rows]


def render(producers: list[ProducerStatus]) -> list[str]:
    """Lines of text showing a survey (``status`` and ``top``)."""
    if not producers:
        return ["no tensorsocket producer on this machine (for this user)"]
    lines: list[str] = []
    for p in producers:
        if lines:
            lines.append("")
        if p.state == "unreadable":
            alive = "alive" if p.alive else "dead"
            lines.append(f"producer {p.name!r}  pid {p.pid} ({alive})  segment unreadable: "
                         f"{p.error}")
            continue
        where = "-" if p.epoch is None else f"{p.epoch}:{p.batch_index}"
        saved = p.cpu_saved_rate
        lines.append(
            f"producer {p.name!r}  pid {p.pid}  {p.state}  device {p.device}  "
            f"epoch:batch {where}  {_num(p.rate)} batches/s")
        lines.append(
            f"  ring {p.occupied}/{p.slot_count} slots held, {human_bytes(p.slot_bytes)} each; "
            f"batch {human_bytes(p.batch_bytes)}; window {p.window}; "
            f"max_lag {p.max_lag or '-'}; lag detaches {p.lag_detached}; "
            f"waiting for slots {_pct(p.publish_wait_fraction)}")
        if p.cpu_rate is not None:
            lines.append(
                f"  loader CPU {p.cpu_rate:.2f} cores now ({_num(p.cpu_seconds)} s in all); "
                f"sharing it among {p.active_consumers} consumer(s) saves about "
                f"{_num(saved, '{:.2f}')} cores")
        elif p.cpu_seconds is not None:
            lines.append(f"  loader CPU {p.cpu_seconds:.1f} s in all")
        if p.state == "dead":
            lines.append("  the producer process is gone: `tensorsocket clean` removes what it "
                         "left (consumers that still hold batches keep them)")
        if not p.consumers:
            lines.append("  no consumer attached")
            continue
        rows = [["consumer", "pid", "state", "batch", "cursor", "lag", "batches/s", "waiting",
                 "delivered"]]
        for c in p.consumers:
            state = c.state if c.alive else "dead"
            if c.reason and c.state != "active":
                state += f" ({c.reason})"
            rows.append([str(c.index), str(c.pid), state,
                         str(c.batch_size) if c.batch_size else "loader",
                         "-" if c.cursor is None else str(c.cursor), str(c.lag),
                         _num(c.rate), _pct(c.waiting),
                         f"{c.delivered} ({human_bytes(c.delivered_bytes)})"])
        lines.extend(_table(rows, indent="  "))
    return lines
