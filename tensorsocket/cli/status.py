"""What the producers of this user are doing, read from their ring segments.

Every producer keeps its ring in a POSIX shared-memory segment named
``tensorsocket-<uid>-<name>-<pid>`` (with ``.<tag>`` appended where a file already had
that name); its header holds the producer's pid and counters, and its consumer table
holds each consumer's pid, cursor and counters. ``survey()`` maps every such segment
read-only in spirit (it only reads), so no daemon and no extra socket are needed, and
looking never disturbs a producer. Rates come from two readings ``interval`` seconds
apart. Anything else in /dev/shm (where anyone may create files) is passed by.

Ring entries are loader batches plus one end-of-epoch marker per epoch; the
``batch_rate`` fields leave the markers out. What sharing does for a producer (its
loader's CPU, the loading CPU saved, the bottleneck) is derived in sharing_report.py.
Segments of other users (mode 0600, so not readable) are listed by ``other_users()`` from
their names alone.
"""

from __future__ import annotations

import os
import pwd
import textwrap
import time
from dataclasses import asdict, dataclass, field

from ..store.survey import StoreStatus
from ..data.segments import SHM_DIR, all_segments, pid_alive, segment_producer, segments
from ..ring import ConsumerState, DeviceType, Ring, RingInfo, RingState, StopReason, \
    process_alive, process_stat
from . import sharing_report
from .sharing_report import ConsumerWait

_CONSUMER_STATES = {
    ConsumerState.PENDING: "joining",
    ConsumerState.ACTIVE: "active",
    ConsumerState.LEAVING: "left",
    ConsumerState.DETACHED: "detached",
}
_REASONS = {StopReason.LEFT: "left", StopReason.LAGGED: "lagged",
            StopReason.DIED: "died", StopReason.SILENT: "silent",
            StopReason.UNREAD: "unread"}


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
    delivered: int  # ring entries it took (loader batches and end-of-epoch markers)
    delivered_bytes: int
    rate: float | None = None  # ring entries per second over the interval
    batch_rate: float | None = None  # loader batches per second (markers left out)
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
    batches_published: int | None = None  # loader batches among them (None: unknown)
    epochs_ended: int | None = None  # end-of-epoch markers among them (None: unknown)
    rate: float | None = None  # entries per second over the interval
    batch_rate: float | None = None  # loader batches per second (markers left out)
    slot_count: int = 0
    occupied: int = 0  # slots some consumer still holds
    slot_bytes: int = 0
    batch_bytes: int | None = None  # bytes of the newest batch in its slot
    segment_bytes: int = 0
    device: str = "cpu"
    window: int = 0
    max_lag: int | None = None  # detach consumers further behind (None: never, lossless)
    lag_detached: int = 0
    publish_wait_fraction: float | None = None  # of the interval, waiting for a free slot
    cpu_seconds: float | None = None  # producer and its child processes (loader workers)
    cpu_rate: float | None = None  # cores the producer's process tree uses now
    publish_cpu_seconds: float | None = None  # of cpu_seconds: the producer's publishing
    setup_cpu_seconds: float | None = None  # of cpu_seconds: before its loader began
    loader_cpu_seconds: float | None = None  # of cpu_seconds: the loader (the rest)
    loader_cpu_rate: float | None = None  # cores the loader uses now
    batches_delivered: int | None = None  # batches handed to consumers, once per consumer
    loader_cpu_saved_seconds: float | None = None  # loading CPU the consumers did not spend
    cpu_saved_rate: float | None = None  # cores of loading saved now (loader_cpu_rate based)
    # The bottleneck over the interval, with the waits it was judged from (not in the
    # JSON document as such: its keys bottleneck and bottleneck_consumer come from it).
    bottleneck_detail: sharing_report.Bottleneck | None = field(default=None, repr=False)
    # The producer's decoded-sample cache (cache_bytes=) as it noted it in its ring: budget
    # (0: none asked for), bytes, samples (filled), epochs (served from it), off (why
    # there is none: None while there is one, or before the producer decided); None: the
    # note could not be read whole.
    cache: dict | None = None
    consumers: list[ConsumerStatus] = field(default_factory=list)

    @property
    def active_consumers(self) -> int:
        """Consumers that receive new batches."""
        return sum(1 for c in self.consumers if c.state == "active" and c.alive)

    @property
    def bottleneck(self) -> str | None:
        """loader / consumer / balanced over the interval (None: not measured)."""
        return None if self.bottleneck_detail is None else self.bottleneck_detail.side

    @property
    def bottleneck_consumer(self) -> dict | None:
        """The consumer everyone waits for ({"index", "pid"}) where bottleneck is
        "consumer", else None."""
        c = None if self.bottleneck_detail is None else self.bottleneck_detail.consumer
        return None if c is None else {"index": c.index, "pid": c.pid}


@dataclass
class OtherUserSegment:
    """A producer segment of another user: only what its name and file say."""

    user: str  # owner's user name (``uid N`` if the uid has no name here)
    uid: int
    name: str  # producer name
    pid: int
    alive: bool  # a process with that pid exists (it may be another after pid reuse)
    segment: str
    note: str  # why it is not shown in full


def _user_name(uid: int) -> str:
    """The user name of uid, else ``uid N``."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def other_users(name: str | None = None) -> list[OtherUserSegment]:
    """Segments of other users' producers (of producer `name` if given). They are never
    opened: their mode is 0600, and another user's ring is not ours to read."""
    out = []
    for entry, uid, producer, pid, _ in all_segments():
        if uid == os.getuid() or (name is not None and producer != name):
            continue
        readable = os.access(f"{SHM_DIR}/{entry}", os.R_OK)
        note = "another user's producer (not read)" if readable else \
            "not readable: another user's producer"
        out.append(OtherUserSegment(user=_user_name(uid), uid=uid, name=producer, pid=pid,
                                    alive=pid_alive(pid), segment=entry, note=note))
    return out


def live_producer_names() -> list[str]:
    """Names of this user's producers whose process is alive (for hints)."""
    return sorted({name for segment, name, pid in segments()
                   if segment_producer(segment, pid)[0]})


def process_tree_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) of pid and every live descendant, with the children
    each of them reaped (cutime, cstime); None if pid is gone.

    DataLoader workers are children of the producer, so this is what running the loader
    costs, the workers of past epochs (a DataLoader without persistent_workers starts new
    ones each epoch) included: a process counts once, live or in its reaper's total. A
    child reaped during the walk, after its parent was read and before it was, would be
    in neither: the walk is taken again (at most 3 times) while a parent's reaped total
    moved under it."""
    total = None
    for _ in range(3):
        walk = _tree_walk(pid)
        if walk is None:
            return None
        total, reaped = walk
        if all(_reaped_ticks(p) == ticks for p, ticks in reaped.items()):
            break
    return total


def _reaped_ticks(pid: int) -> int | None:
    """cutime + cstime of pid, None if it is gone."""
    stat = process_stat(pid)
    return None if stat is None else stat["cutime"] + stat["cstime"]


def _tree_walk(pid: int) -> tuple[float, dict[int, int]] | None:
    """One walk of /proc: the CPU seconds of pid's tree (as process_tree_cpu counts it),
    and the reaped ticks (cutime + cstime) of each process of the tree with children."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    reaped: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        stat = process_stat(int(entry)) if entry.isdigit() else None
        if stat is None:
            continue  # not a process, or gone meanwhile
        p = int(entry)
        parents[p] = stat["ppid"]
        reaped[p] = stat["cutime"] + stat["cstime"]
        cpu[p] = (stat["utime"] + stat["stime"] + reaped[p]) / tick
    if pid not in cpu:
        return None
    children: dict[int, list[int]] = {}
    for p, parent in parents.items():
        children.setdefault(parent, []).append(p)
    total, todo, in_tree = 0.0, [pid], {}
    while todo:
        p = todo.pop()
        total += cpu.get(p, 0.0)
        if p in children:
            in_tree[p] = reaped.get(p, 0)
        todo.extend(children.get(p, ()))
    return total, in_tree


def _read(segment: str, name: str, pid: int) -> tuple[ProducerStatus, dict | None]:
    """One reading of a segment: the status without rates, and the raw counters."""
    try:
        ring = Ring.open("/" + segment)
    except Exception as e:  # another version, being created, torn down meanwhile
        alive = pid_alive(pid)
        return ProducerStatus(name=name, segment=segment, pid=pid, alive=alive,
                              state="unreadable", error=str(e)), None
    try:
        info, steady = _steady_info(ring)
        entries = ring.consumers()
        next_readers = ring.next_slot()["readers"]
        cache = ring.cache()
    finally:
        ring.close()
    alive = process_alive(info.producer_pid, info.producer_start_time)
    if not alive:
        state = "dead"
    elif info.state == RingState.FINISHED:
        state = "finished"
    else:
        state = "running"
    consumers = []
    for c in entries:
        st = _CONSUMER_STATES.get(c["state"], f"state {c['state']}")
        consumers.append(ConsumerStatus(
            index=c["index"], pid=c["pid"],
            alive=process_alive(c["pid"], c["start_time"]),
            state=st, reason=_REASONS.get(c["reason"], ""),
            batch_size=c["batch_size"] or None,
            cursor=c["cursor"],
            lag=max(0, c["lag"]), delivered=c["delivered"],
            delivered_bytes=c["delivered_bytes"],
            idle_seconds=max(0.0, (time.monotonic_ns() - c["progress_ns"]) / 1e9),
        ))
    device = "cpu" if info.device_type != DeviceType.CUDA else f"cuda:{info.device_ordinal}"
    ended = _epochs_ended(info) if steady else None
    # Holes take a seq each too (ts_ring.h, Holes), but carry no batch.
    batches = None if ended is None else max(0, info.published - ended - info.holes)
    cpu = process_tree_cpu(info.producer_pid) if alive else None
    publish_cpu, setup_cpu = info.publish_cpu_ns / 1e9, info.setup_cpu_ns / 1e9
    loader_cpu = sharing_report.loader_cpu_seconds(cpu, setup_cpu, publish_cpu)
    status = ProducerStatus(
        name=name, segment=segment, pid=info.producer_pid, alive=alive, state=state,
        epoch=info.newest_epoch if info.newest_valid else None,
        batch_index=info.newest_index if info.newest_valid else None,
        published=info.published,
        batches_published=batches,
        epochs_ended=ended, slot_count=info.slot_count,
        occupied=info.occupied, slot_bytes=info.slot_bytes,
        batch_bytes=info.newest_bytes if info.newest_valid and info.newest_bytes
        else None,
        segment_bytes=info.segment_bytes, device=device, window=info.window,
        max_lag=info.max_lag or None, lag_detached=info.lag_detached,
        cpu_seconds=cpu, publish_cpu_seconds=publish_cpu, setup_cpu_seconds=setup_cpu,
        loader_cpu_seconds=loader_cpu,
        batches_delivered=info.batches_delivered,
        loader_cpu_saved_seconds=sharing_report.loader_cpu_saved_seconds(
            loader_cpu, info.batches_delivered, batches),
        cache=cache, consumers=consumers,
    )
    first = info.epoch_first_seq
    raw = {"t": time.monotonic(), "published": info.published, "epochs_ended": ended,
           "last_marker": first - 1 if first > 0 else None,
           "publish_wait_ns": info.publish_wait_ns,
           "batches": batches, "batches_delivered": info.batches_delivered,
           "cpu_seconds": cpu, "loader_cpu": loader_cpu, "next_readers": next_readers,
           "consumers": {c["index"]: (c["token"], c["delivered"], c["wait_ns"], c["cursor"])
                         for c in entries}}
    return status, raw


def _steady_info(ring: Ring) -> tuple[dict, bool]:
    """ring.info(), and whether its newest entry is the one before its `published` count
    (info() loads the count twice; an entry published in between makes them disagree,
    which a second info() with the same count rules out)."""
    info = RingInfo.of(ring)
    for _ in range(3):
        again = RingInfo.of(ring)
        if again.published == info.published:
            return info, True
        info = again
    return info, False


def _epochs_ended(info: dict) -> int | None:
    """End-of-epoch markers among the published entries, None if unknown.

    A producer numbers its epochs from 0 and ends each with one marker carrying the
    epoch's number, so the newest entry tells: a batch of epoch e follows e markers, the
    marker of epoch e is the (e + 1)-th. A marker has no bytes, a batch always has some."""
    if info.published == 0:
        return 0
    if not info.newest_valid:  # overwritten while read
        return None
    return info.newest_epoch + (0 if info.newest_bytes else 1)


def _add_rates(now: ProducerStatus, raw: dict, before: dict) -> None:
    """Fill the rates of a reading from the difference with an earlier one."""
    dt = raw["t"] - before["t"]
    if dt <= 0:
        return
    entries = max(0, raw["published"] - before["published"])
    now.rate = entries / dt
    ends: int | None = None  # markers published in the interval
    if raw["epochs_ended"] is not None and before["epochs_ended"] is not None:
        ends = max(0, raw["epochs_ended"] - before["epochs_ended"])
        now.batch_rate = max(0, entries - ends) / dt
    now.publish_wait_fraction = min(
        1.0, max(0, raw["publish_wait_ns"] - before["publish_wait_ns"]) / 1e9 / dt)
    # The markers a consumer took: with at most one published in the interval, the newest
    # marker at each reading are all it can have passed (unless an epoch is shorter than
    # its lag), so they are counted where they lie; with more, the producer's share of
    # markers is applied to the consumer's entries.
    markers = {m for m in (before["last_marker"], raw["last_marker"]) if m is not None}
    for c in now.consumers:
        earlier, later = before["consumers"].get(c.index), raw["consumers"].get(c.index)
        if earlier is not None and later is not None and earlier[0] == later[0]:  # same token
            _, d0, w0, _ = earlier
            _, d1, w1, cursor = later
            taken = max(0, d1 - d0)
            c.rate = taken / dt
            c.waiting = min(1.0, max(0, w1 - w0) / 1e9 / dt)
            if ends is not None and ends > 1:
                c.batch_rate = c.rate * (entries - ends) / entries
            elif ends is not None and cursor is not None:  # it took cursor - taken .. cursor - 1
                passed = sum(1 for m in markers if cursor - taken <= m < cursor)
                c.batch_rate = max(0, taken - passed) / dt
    _add_sharing_rates(now, raw, before, dt)


def _add_sharing_rates(now: ProducerStatus, raw: dict, before: dict, dt: float) -> None:
    """Fill the CPU rates and the bottleneck of a reading from the difference with an
    earlier one (dt seconds before)."""
    if raw["cpu_seconds"] is not None and before["cpu_seconds"] is not None:
        now.cpu_rate = max(0.0, raw["cpu_seconds"] - before["cpu_seconds"]) / dt
    if raw["loader_cpu"] is not None and before["loader_cpu"] is not None:
        now.loader_cpu_rate = max(0.0, raw["loader_cpu"] - before["loader_cpu"]) / dt
    if raw["batches"] is not None and before["batches"] is not None:
        now.cpu_saved_rate = sharing_report.loader_cpu_saved_seconds(
            now.loader_cpu_rate, raw["batches_delivered"] - before["batches_delivered"],
            raw["batches"] - before["batches"])
    waits = [ConsumerWait(index=c.index, pid=c.pid, waiting=c.waiting,
                          holds_next=bool(raw["next_readers"] >> c.index & 1))
             for c in now.consumers if c.state == "active" and c.alive and c.waiting is not None]
    published = None if raw["batches"] is None or before["batches"] is None else \
        raw["batches"] - before["batches"]
    now.bottleneck_detail = sharing_report.bottleneck(now.publish_wait_fraction, waits,
                                                      published)


class Survey:
    """Successive readings of every producer; each ``take()`` returns the producers
    with rates measured since the previous reading (the first has none, unless
    ``interval`` > 0, which takes two readings that far apart)."""

    def __init__(self) -> None:
        self._previous: dict[str, dict] = {}

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
                    _add_rates(status, raw, previous)
                seen[segment] = raw
            out.append(status)
        self._previous = seen
        return out


def survey(interval: float = 0.5, name: str | None = None) -> list[ProducerStatus]:
    """Every producer of this user, with rates over `interval` seconds (0: no rates)."""
    return Survey().take(interval, name)


def as_json(producers: list[ProducerStatus], interval: float,
            others: list[OtherUserSegment] | None = None,
            stores: list[StoreStatus] | None = None) -> dict:
    """A JSON-ready document of a survey (the ``status --json`` format, version 1;
    docs/cli.md describes every key)."""
    docs = []
    for p in producers:
        d = asdict(p)
        del d["bottleneck_detail"]
        d["active_consumers"] = p.active_consumers
        d["bottleneck"] = p.bottleneck
        d["bottleneck_consumer"] = p.bottleneck_consumer
        docs.append(d)
    return {"format": 1, "interval": interval, "time": time.time(), "producers": docs,
            "other_users": [asdict(o) for o in others or []],
            "stores": [{**asdict(s), "hit_rate": s.hit_rate} for s in stores or []]}


def no_producer_named(name: str) -> tuple[str, str]:
    """The line for a --name that no producer of this user has, and a hint naming the
    live producers ("" if there is none)."""
    live = live_producer_names()
    hint = f"live producers: {', '.join(live)}" if live else ""
    return f"no producer named {name!r} on this machine (for this user)", hint


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


def _pack(fields: list[str], sep: str, width: int | None, indent: str = "",
          more: str = "    ") -> list[str]:
    """Fields joined by sep on as few lines of at most `width` columns as they fit
    (None: one line); lines after the first start with `more`. A field is never split."""
    lines: list[str] = []
    line = ""
    for f in fields:
        if not line:
            line = (indent if not lines else more) + f
        elif width is None or len(line) + len(sep) + len(f) <= width:
            line += sep + f
        else:
            lines.append(line + sep.rstrip())
            line = more + f
    if line:
        lines.append(line)
    return lines


# Column headers of the consumer table; wide headers take two rows on a narrow screen.
_HEADERS = [("consumer",), ("pid",), ("state",), ("batch",), ("cursor",), ("lag",),
            ("loader", "batches/s"), ("waiting",), ("entries", "delivered")]


def _table(rows: list[list[str]], indent: str = "", width: int | None = None) -> list[str]:
    """Left-aligned columns under _HEADERS, two spaces apart. Where one header row would
    make the table wider than `width`, headers of two words take two rows; where it is
    still too wide, the columns are split into tables that each repeat the first."""

    def lay_out(cols: list[int], two_rows: bool) -> list[str]:
        if two_rows:
            head = [[_HEADERS[i][0] for i in cols],
                    [_HEADERS[i][1] if len(_HEADERS[i]) > 1 else "" for i in cols]]
        else:
            head = [[" ".join(_HEADERS[i]) for i in cols]]
        body = head + [[r[i] for i in cols] for r in rows]
        widths = [max(len(r[k]) for r in body) for k in range(len(cols))]
        return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                for r in body]

    def fits(lines: list[str]) -> bool:
        return width is None or max(len(ln) for ln in lines) <= width

    def best(cols: list[int]) -> list[str]:
        one_row = lay_out(cols, False)
        return one_row if fits(one_row) else lay_out(cols, True)

    every = best(list(range(len(_HEADERS))))
    if fits(every):
        return every
    groups, group = [], [0]
    for i in range(1, len(_HEADERS)):
        if len(group) > 1 and not fits(best(group + [i])):
            groups.append(group)
            group = [0]
        group.append(i)
    groups.append(group)
    return [line for g in groups for line in best(g)]


def _sharing_lines(p: ProducerStatus, width: int | None) -> list[str]:
    """A producer's loader CPU, bottleneck and loading CPU saved, wrapped at width."""
    lines = []
    if p.loader_cpu_rate is not None:
        lines.extend(_pack(
            [f"loader CPU {p.loader_cpu_rate:.2f} cores now "
             f"({_num(p.loader_cpu_seconds)} s in all)",
             f"sharing it among {p.active_consumers} consumer(s) saves about "
             f"{_num(p.cpu_saved_rate, '{:.2f}')} cores"], "; ", width, "  "))
    elif p.loader_cpu_seconds is not None:
        lines.append(f"  loader CPU {p.loader_cpu_seconds:.1f} s in all")
    if not p.alive:
        return lines
    for text in (sharing_report.bottleneck_text(p.bottleneck_detail),
                 sharing_report.saved_text(p.loader_cpu_saved_seconds, p.loader_cpu_seconds,
                                           p.publish_cpu_seconds, p.batches_published,
                                           p.batches_delivered)):
        lines.extend(textwrap.wrap(text, width or 1000, initial_indent="  ",
                                   subsequent_indent="    "))
    return lines


def _cache_lines(p: ProducerStatus, width: int | None) -> list[str]:
    """The producer's decoded-sample cache, where one was asked for (cache_bytes=)."""
    cache = p.cache
    if not cache or not cache["budget"]:
        return []
    if cache["off"]:
        return textwrap.wrap(f"decoded cache off ({human_bytes(cache['budget'])} allowed): "
                             f"{cache['off']}", width or 1000, initial_indent="  ",
                             subsequent_indent="    ")
    if not cache["bytes"]:
        return [f"  decoded cache: {human_bytes(cache['budget'])} allowed, not decided yet "
                "(at the first batch)"]
    return _pack([f"decoded cache {human_bytes(cache['bytes'])} of "
                  f"{human_bytes(cache['budget'])} allowed",
                  f"{cache['samples']} samples filled",
                  f"{cache['epochs']} epochs served from it"], "; ", width, "  ")


def _store_lines(s: StoreStatus, width: int | None) -> list[str]:
    """A store of decoded samples: its figures, then a row per job."""
    rate = "-" if s.hit_rate is None else f"{100 * s.hit_rate:.0f}%"
    lines = _pack([f"decoded-sample store {s.key}",
                   f"{s.stored}/{s.samples} samples, {human_bytes(s.used_bytes)} of "
                   f"{human_bytes(s.budget)}", f"hit rate {rate}",
                   f"decodes saved {s.hits}", f"decodes stored {s.commits}",
                   f"evictions {s.evictions}", f"races {s.races}", f"busy {s.busy}"], "  ",
                  width)
    if s.dropped is not None:
        lines.extend(textwrap.wrap(f"dropped: {s.dropped}", width or 1000,
                                   initial_indent="  ", subsequent_indent="    "))
    if not s.jobs:
        lines.append("  no job attached (`tensorsocket clean` removes it)")
    for j in s.jobs:
        lines.extend(_pack([f"job pid {j.pid}", f"epoch {j.epoch}",
                            f"batch {j.position}/{j.length}", f"{j.workers} workers"], "  ",
                           width, "  "))
    return lines


def render(producers: list[ProducerStatus], width: int | None = None,
           others: list[OtherUserSegment] | None = None,
           stores: list[StoreStatus] | None = None) -> list[str]:
    """Lines of text showing a survey (``status`` and ``top``); a producer's fields wrap
    onto more lines where one would be wider than `width` (None: never)."""
    lines: list[str] = []
    if not producers and not stores:
        lines.append("no tensorsocket producer on this machine (for this user)")
    for store in stores or []:
        if lines:
            lines.append("")
        lines.extend(_store_lines(store, width))
    for p in producers:
        if lines:
            lines.append("")
        if p.state == "unreadable":
            alive = "alive" if p.alive else "dead"
            lines.extend(_pack([f"producer {p.name!r}", f"pid {p.pid} ({alive})",
                                f"segment unreadable: {p.error}"], "  ", width))
            continue
        where = "-" if p.epoch is None else f"{p.epoch}:{p.batch_index}"
        lines.extend(_pack(
            [f"producer {p.name!r}", f"pid {p.pid}", p.state, f"device {p.device}",
             f"epoch:batch {where}", f"{_num(p.batch_rate)} loader batches/s"], "  ", width))
        lines.extend(_pack(
            [f"ring {p.occupied}/{p.slot_count} slots held, {human_bytes(p.slot_bytes)} each",
             f"batch {human_bytes(p.batch_bytes)}", f"window {p.window}",
             f"max_lag {p.max_lag or '-'}", f"lag detaches {p.lag_detached}",
             f"waiting for slots {_pct(p.publish_wait_fraction)}"], "; ", width, "  "))
        lines.extend(_sharing_lines(p, width))
        lines.extend(_cache_lines(p, width))
        if p.state == "dead":
            lines.extend(textwrap.wrap(
                "the producer process is gone: `tensorsocket clean` removes what it left "
                "(consumers that still hold batches keep them)", width or 1000,
                initial_indent="  ", subsequent_indent="    "))
        if not p.consumers:
            lines.append("  no consumer attached")
            continue
        rows = []
        for c in p.consumers:
            state = c.state if c.alive else "dead"
            if c.reason and c.state != "active":
                state += f" ({c.reason})"
            rows.append([str(c.index), str(c.pid), state,
                         str(c.batch_size) if c.batch_size else "loader",
                         "-" if c.cursor is None else str(c.cursor), str(c.lag),
                         _num(c.batch_rate), _pct(c.waiting),
                         f"{c.delivered} ({human_bytes(c.delivered_bytes)})"])
        lines.extend(_table(rows, indent="  ", width=width))
    if others:
        lines += ["", "other users' producers:"]
    for o in others or []:
        pid = f"pid {o.pid}" + ("" if o.alive else " (gone)")
        lines.extend(_pack([f"producer {o.name!r}", pid, f"user {o.user}", o.note], "  ",
                           width, "  "))
    return lines
