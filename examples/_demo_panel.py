"""The live panel of examples/demo.py: a few lines at the bottom of a terminal,
redrawn in place under the demo's event log, showing the ring and each consumer's
progress as ``tensorsocket status`` reads them from the ring segment."""

from __future__ import annotations

import time
from typing import TextIO

BAR_WIDTH = 24


class LivePanel:
    """The panel of one demo run, whose epochs have `batches_per_epoch` batches each."""

    REFRESH_S = 0.25

    def __init__(self, name: str, batches_per_epoch: int, epochs: int, out: TextIO) -> None:
        from tensorsocket.cli.status import Survey

        self.name = name
        self.batches_per_epoch = batches_per_epoch
        self.total = epochs * batches_per_epoch  # loader batches each consumer trains on
        self.out = out
        self.survey = Survey()
        self.lines: list[str] = []
        self.next_at = 0.0
        self.ring_line = ""
        # pid -> (loader batches taken, lag, loader batches/s), kept once a consumer left
        self.progress: dict[int, tuple[int, int, float | None]] = {}

    def batches_taken(self, entries: int) -> int:
        """Loader batches among the first `entries` ring entries a consumer took: every
        epoch is batches_per_epoch batches and one end-of-epoch marker (the demo's
        consumers are all attached before the first batch)."""
        return min(self.total, entries - entries // (self.batches_per_epoch + 1))

    def clear(self) -> None:
        """Erase the panel (before an event line is printed)."""
        if self.lines:
            self.out.write(f"\x1b[{len(self.lines)}F\x1b[J")
            self.lines = []

    def draw(self) -> None:
        """Print the panel again (after an event line)."""
        if self.lines:
            self.out.write("\n".join(self.lines) + "\n")
            self.out.flush()

    def refresh(self, labels: dict[int, str]) -> None:
        """Take a new reading if it is time, and redraw."""
        if time.monotonic() < self.next_at:
            return
        self.next_at = time.monotonic() + self.REFRESH_S
        producers = [p for p in self.survey.take(0.0, self.name) if p.state != "unreadable"]
        if producers:
            p = producers[0]
            cpu = "-" if p.cpu_rate is None else f"{p.cpu_rate:.2f}"
            rate = "-" if p.batch_rate is None else f"{p.batch_rate:.0f}"
            self.ring_line = (f"  live: ring {p.occupied}/{p.slot_count} slots held, producer "
                              f"{rate} batches/s, loader {cpu} cores")
            for c in p.consumers:
                done = self.batches_taken(c.delivered)
                if done >= self.progress.get(c.pid, (0, 0, None))[0]:  # never backwards
                    self.progress[c.pid] = (done, c.lag, c.batch_rate)
        self.redraw(labels)

    def finished(self, pid: int, batches: int, labels: dict[int, str]) -> None:
        """A consumer reported that it trained on `batches` batches: show it complete."""
        self.progress[pid] = (batches, 0, None)
        self.redraw(labels)

    def redraw(self, labels: dict[int, str]) -> None:
        """Draw the last reading again."""
        lines = [self.ring_line] if self.ring_line else []
        order = {pid: i for i, pid in enumerate(labels)}  # the order the demo started them
        for pid in sorted(self.progress, key=lambda pid: (order.get(pid, len(order)), pid)):
            done, lag, crate = self.progress[pid]
            filled = BAR_WIDTH * min(done, self.total) // max(1, self.total)
            rate = "-" if crate is None else f"{crate:.0f}"
            lines.append(f"  {labels.get(pid, f'pid {pid}'):<11} "
                         f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done:4d}/{self.total} "
                         f"batches  lag {lag}  {rate} batches/s")
        self.clear()
        self.lines = lines
        self.draw()
