"""What the consumers are told of the error that ended the producer (the ring header and
the control plane carry it to them as ProducerFailed's cause)."""

from __future__ import annotations

import os
import signal
import traceback

FAILURE_CHARS = 800  # the text of a failure the consumers are told (ring header, control)

# This package's files (frames of ours are not where the user's error was raised).
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def failure_text(exc: BaseException) -> str | None:
    """What the consumers are told of the error that ended the producer: its type, its
    message and where it was raised, at most FAILURE_CHARS characters (the end of a long
    message, where a DataLoader worker's traceback names the error, is kept). None for
    an exit that is no failure (sys.exit(0))."""
    if isinstance(exc, GeneratorExit) or (isinstance(exc, SystemExit) and
                                          exc.code in (None, 0)):
        return None
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    where = raised_at(exc)
    if where is not None:
        text += f" (raised at {os.path.basename(where.filename)}:{where.lineno} in " \
                f"{where.name})"
    text = text.replace("\0", "?")
    if len(text) > FAILURE_CHARS:
        head = FAILURE_CHARS // 4
        text = text[:head] + " [...] " + text[-(FAILURE_CHARS - head - 7):]
    return text


def signal_failure(signum: int) -> str:
    """What the consumers are told of a producer that a signal (SIGTERM) ends before it
    finished: the process removes its files and writes this in the ring's header as it
    dies of the signal (tensorsocket.control.producer_files.on_sigterm)."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return (f"stopped by {name} before it finished (sent by kill, a job scheduler or a "
            "container's stop; the process removed its files and died of it)")


def raised_at(exc: BaseException) -> traceback.FrameSummary | None:
    """The frame that raised exc, for the user: its traceback's last frame, unless that
    one is this package's and exc was raised from a cause that reaches further (Python
    turns a StopIteration leaking out of the loader's generator into a RuntimeError
    raised at our loop over the loader, "from" the user's StopIteration)."""
    frames = traceback.extract_tb(exc.__traceback__)
    cause = exc.__cause__
    if cause is not None and cause.__traceback__ is not None and \
            (not frames or _ours(frames[-1].filename)):
        return raised_at(cause)
    return frames[-1] if frames else None


def _ours(filename: str) -> bool:
    """Whether `filename` is a file of this package."""
    return os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)
