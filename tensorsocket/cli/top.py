"""``tensorsocket top``: the status of every producer, refreshed live.

Drawn with curses from the standard library: tensorsocket is installed into
training environments, where a terminal UI dependency (rich, textual) would be
one more package to resolve against torch's pins for one command, and curses
does what this view needs (full-screen redraw, colours, key presses) on every
terminal, over ssh and inside tmux. When standard output is not a terminal,
``top`` prints a time-stamped snapshot per refresh instead.
"""

from __future__ import annotations

import shutil
import sys
import textwrap
import time
from typing import IO, Any

from .status import ProducerStatus, Survey, no_producer_named, other_users, render, segments

KEYS = "q quit   + / - refresh slower / faster"
MIN_INTERVAL = 0.2


def _header(producers: list[ProducerStatus], interval: float) -> str:
    """First line of every refresh."""
    live = sum(1 for p in producers if p.alive)
    return (f"tensorsocket top  {time.strftime('%H:%M:%S')}  {live} live producer(s)  "
            f"refresh {interval:g} s")


def _attention(line: str) -> bool:
    """Lines worth a colour: dead processes, detached consumers, stale segments."""
    return any(word in line for word in (" dead", "detached", "lagged", "gone", "unreadable",
                                         "waiting for it"))


def _body(producers: list[ProducerStatus], name: str | None, width: int | None) -> list[str]:
    """The lines under the header: the producers, or that producer `name` is awaited."""
    if name is not None and not producers:
        line, hint = no_producer_named(name)
        lines: list[str] = []
        for text in [f"{line}; waiting for it to appear"] + ([hint] if hint else []):
            lines.extend(textwrap.wrap(text, width or len(text), subsequent_indent="    "))
        others = other_users(name)
        return lines + (render([], width, others)[1:] if others else [])
    return render(producers, width, other_users(name))


def _exists(name: str) -> bool:
    """True if this user has a segment of producer `name` (live or not)."""
    return any(seg_name == name for _, seg_name, _ in segments())


def plain(interval: float, name: str | None, iterations: int | None,
          out: IO[str] = sys.stdout, width: int | None = None) -> int:
    """Print a snapshot every interval (for pipes and logs), wrapped at `width` columns
    (default: the terminal's, else 80)."""
    if width is None:
        width = shutil.get_terminal_size((80, 24)).columns
    survey = Survey()
    survey.take(0.0, name)
    n = 0
    while iterations is None or n < iterations:
        time.sleep(interval)
        producers = survey.take(0.0, name)
        print(_header(producers, interval), file=out)
        for line in _body(producers, name, width):
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
            width = screen.getmaxyx()[1] - 1  # _draw leaves the last column free
            _draw(screen, curses,
                  [_header(producers, interval), KEYS, ""] + _body(producers, name, width))
            n += 1
        return 0

    return curses.wrapper(loop)


def run(interval: float = 1.0, name: str | None = None, iterations: int | None = None,
        force_plain: bool = False) -> int:
    """``tensorsocket top``: curses on a terminal, snapshots otherwise. With `name`: exit 1
    at once if there is no such producer, as ``status --name`` does, unless the view is
    interactive and open-ended (then it waits for the producer, saying so)."""
    interval = max(MIN_INTERVAL, interval)
    on_terminal = not force_plain and sys.stdout.isatty() and sys.stdin.isatty()
    if name is not None and (not on_terminal or iterations is not None) and not _exists(name):
        line, hint = no_producer_named(name)
        print(line, flush=True)
        if hint:
            print(f"hint: {hint}", file=sys.stderr)
        return 1
    if not on_terminal:
        return plain(interval, name, iterations)
    return interactive(interval, name, iterations)
