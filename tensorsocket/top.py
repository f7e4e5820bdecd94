"""``tensorsocket top``: the status of every producer, refreshed live.

Drawn with curses from the standard library: tensorsocket is installed into
training environments, where a terminal UI dependency (rich, textual) would be
one more package to resolve against torch's pins for one command, and curses
does what this view needs (full-screen redraw, colours, key presses) on every
terminal, over ssh and inside tmux. When standard output is not a terminal,
``top`` prints a time-stamped snapshot per refresh instead.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from .status import ProducerStatus, Survey, render

KEYS = "q quit   + / - refresh slower / faster"
MIN_INTERVAL = 0.2


def _header(producers: list[ProducerStatus], interval: float) -> str:
    """First line of every refresh."""
    live = sum(1 for p in producers if p.alive)
    return (f"tensorsocket top  {time.strftime('%H:%M:%S')}  {live} live producer(s)  "
            f"refresh {interval:g} s")


def _attention(line: str) -> bool:
    """Lines worth a colour: dead processes, detached consumers, stale segments."""
    return any(word in line for word in (" dead", "detached", "lagged", "gone", "unreadable"))


def plain(interval: float, name: str | None, iterations: int | None,
          out: IO[str] = sys.stdout) -> int:
    """Print a snapshot every interval (for pipes and logs)."""
    survey = Survey()
    survey.take(0.0, name)
    n = 0
    while iterations is None or n < iterations:
        time.sleep(interval)
        producers = survey.take(0.0, name)
        print(_header(producers, interval), file=out)
        for line in render(producers):
            print(line, file=out)
        print(file=out, flush=True)
        n += 1
    return 0


def _draw(screen: Any, curses: Any, lines: list[str]) -> None:
    """Redraw the whole screen; lines beyond its size are cut."""
    screen.erase()
    height, width = screen.getmaxyx()
    for y, line in enumerate(lines[:height]):
        attr = 0
        if y == 0:
            attr = curses.A_REVERSE
        elif y == 1:
            attr = curses.A_DIM
        elif _attention(line):
            attr = curses.A_BOLD | (curses.color_pair(1) if curses.has_colors() else 0)
        elif line.startswith("producer "):
            attr = curses.A_BOLD
        try:
            screen.addnstr(y, 0, line, max(0, width - 1), attr)
        except curses.error:  # the last cell of the screen
            pass
    screen.refresh()


def interactive(interval: float, name: str | None, iterations: int | None) -> int:
    """Full-screen view until q (or `iterations` refreshes)."""
    import curses

    def loop(screen: Any) -> int:
        nonlocal interval
        curses.curs_set(0)
        if curses.has_colors():
            curses.start_color()
            curses.use_default_colors()
            curses.init_pair(1, curses.COLOR_RED, -1)
        survey = Survey()
        survey.take(0.0, name)
        n = 0
        deadline = time.monotonic() + interval
        while iterations is None or n < iterations:
            screen.timeout(max(1, int((deadline - time.monotonic()) * 1000)))
            key = screen.getch()
            if key in (ord("q"), ord("Q"), 27):
                return 0
            if key in (ord("+"), ord("=")):
                interval = min(60.0, interval * 2)
            elif key == ord("-"):
                interval = max(MIN_INTERVAL, interval / 2)
            if time.monotonic() < deadline and key != curses.KEY_RESIZE:
                continue
            deadline = time.monotonic() + interval
            producers = survey.take(0.0, name)
            _draw(screen, curses, [_header(producers, interval), KEYS, ""] + render(producers))
            n += 1
        return 0

    return curses.wrapper(loop)


def run(interval: float = 1.0, name: str | None = None, iterations: int | None = None,
        force_plain: bool = False) -> int:
    """``tensorsocket top``: curses on a terminal, snapshots otherwise."""
    interval = max(MIN_INTERVAL, interval)
    if force_plain or not (sys.stdout.isatty() and sys.stdin.isatty()):
        return plain(interval, name, iterations)
    return interactive(interval, name, iterations)
