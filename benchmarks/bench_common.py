"""What every benchmark script here shares, written once: child processes (the harness of
this checkout, a child's role entry, its JSON report line, stopping a run's children and
removing a producer's leftovers, free ports), timing (CPU seconds of this process and of
its reaped children), medians and ratios, machine information, writing a result document,
and the argument sets (comma-separated lists, repeats, --json).

Only the standard library is imported at the top: the children of collocated.py import
this module, some of them in the original TensorSocket's venv, and none of them may import
tensorsocket unless it uses it (importing the package changes what sits at the top of the
heap of a DataLoader's forked workers, benchmarks/README.md "The allocator").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import statistics
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KILL_GRACE = 5.0  # seconds between SIGTERM and SIGKILL when a run's children are stopped


# -- child processes ---------------------------------------------------------------------


def harness():
    """tools.harness of this checkout (child processes, machine information), for the
    orchestrators only: tools/ is not installed, so the checkout root is appended to
    sys.path (appended: whatever tensorsocket sys.path already finds stays the one the
    orchestrator imports, as its children do)."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from tools import harness as module

    return module


def import_tensorsocket():
    """tensorsocket, from the installed package or else from this checkout."""
    try:
        import tensorsocket
    except ImportError:
        sys.path.insert(0, str(ROOT))
        import tensorsocket
    return tensorsocket


def report(obj: dict) -> None:
    """A child's report: `obj` as one JSON line on stdout, flushed."""
    print(json.dumps(obj), flush=True)


def json_reports(text: str, role: str | None = None) -> list[dict]:
    """The JSON lines of a child's stdout that are reports (a "role", not "ready"), of
    `role` if given."""
    return [r for r in harness().json_lines(text)
            if r.get("role") and not r.get("ready") and role in (None, r["role"])]


def unwind_on_sigterm() -> None:
    """On SIGTERM from the orchestrator, unwind normally (sys.exit), so that finally blocks
    run: a producer unlinks its segment, a consumer says bye."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def start_watchdog(seconds: float, who: str) -> None:
    """Exit this process (status 124) if it still runs after `seconds`."""
    def fire() -> None:
        sys.stderr.write(f"{who}: watchdog: still running after {seconds:.0f} s, exiting\n")
        sys.stderr.flush()
        os._exit(124)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def child_role(argv: Sequence[str], roles: Iterable[str]) -> str | None:
    """The hidden role this script was started in (argv[1]), or None for the user's run."""
    return argv[1] if len(argv) > 1 and argv[1] in roles else None


def tail(text: str, lines: int = 8, chars: int = 2000) -> str:
    """The last lines of a child's stderr, for an error message."""
    return "\n".join((text or "").strip().splitlines()[-lines:])[-chars:]


def read_text(path: Path, last: int | None = None) -> str:
    """A child's output file ("" if it is gone), its last `last` characters if given."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text if last is None else text[-last:].strip()


def stop_all(procs: list, grace: float = KILL_GRACE) -> None:
    """SIGTERM every child's process tree, SIGKILL what is left after `grace`; reap."""
    children = harness().Children()
    children.procs = list(procs)
    children.stop_all(grace)


def remove_leftovers(name: str) -> None:
    """Remove what a tensorsocket producer of this (unique, ours only) name may leave: its
    segment if it was killed, and the lock and socket files (tensorsocket.cli.clean; an
    older tree measured beside this one through PYTHONPATH has it as tensorsocket.clean)."""
    try:
        from tensorsocket.cli.clean import remove_leftovers as remove
    except ImportError:
        from tensorsocket.clean import remove_leftovers as remove  # type: ignore
    remove(name)


def free_ports(n: int) -> list[int]:
    """`n` TCP ports free at this moment (for the original TensorSocket, which binds
    tcp://*)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# -- timing ------------------------------------------------------------------------------


def cpu_seconds() -> float:
    """User + system CPU time of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def vm_kb(pid: int | str = "self") -> dict:
    """VmHWM and VmRSS (kB) of a process, from /proc/<pid>/status ({} if it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmHWM:", "VmRSS:")):
                    out[line.split(":")[0]] = int(line.split()[1])
    except OSError:
        pass
    return out


def children_cpu_seconds() -> float:
    """User + system CPU time of this process's reaped children (and theirs) so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


# -- medians and ratios ------------------------------------------------------------------


def median(xs: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None if there are none."""
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def div(a: float | None, b: float | None) -> float | None:
    """a / b, or None where either is missing or b is 0."""
    return a / b if a is not None and b else None


def fmt(x: float | None, spec: str, width: int = 0) -> str:
    """`x` formatted by `spec`, "-" where it is None, right-aligned to `width`."""
    return f"{'-' if x is None else format(x, spec):>{width}}"


# -- machine information and results -----------------------------------------------------


def machine_info(packages: Iterable[str] = ("torch", "numpy", "zmq")) -> dict:
    """This machine and the versions of Python and `packages` (tools.harness)."""
    return harness().machine_info(packages=packages)


def loadavg() -> list[float] | None:
    return harness().loadavg()


def write_json(path: str | os.PathLike, doc: Any, indent: int = 2, say: bool = True) -> None:
    """Write a result document and (with `say`) say where."""
    Path(path).write_text(json.dumps(doc, indent=indent) + "\n")
    if say:
        print(f"wrote {path}")


def log(msg: str) -> None:
    """A progress line, on stderr."""
    print(msg, file=sys.stderr, flush=True)


# -- argument sets -----------------------------------------------------------------------


def add_run_options(parser: argparse.ArgumentParser, quick_help: str,
                    counts: Sequence[int]) -> None:
    """--quick, --repeats, --json and --consumers, as every suite script takes them."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--repeats", type=int, default=None,
                        help="repeats per configuration (default 3, 1 with --quick)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    parser.add_argument("--consumers", default=",".join(map(str, counts)),
                        help=f"comma-separated consumer counts (default "
                             f"{','.join(map(str, counts))})")


def repeats(args: argparse.Namespace) -> int:
    """--repeats, or its default: 3, 1 with --quick."""
    return args.repeats if args.repeats is not None else (1 if args.quick else 3)


def name_list(parser: argparse.ArgumentParser, text: str, choices: Sequence[str],
          what: str) -> list[str]:
    """A comma-separated subset of `choices` (parser.error on an unknown one)."""
    out = [x for x in text.split(",") if x]
    for x in out:
        if x not in choices:
            parser.error(f"unknown {what} {x!r}")
    return out


def count_list(parser: argparse.ArgumentParser, text: str, option: str = "--consumers"
           ) -> list[int]:
    """A comma-separated list of counts."""
    try:
        return [int(c) for c in text.split(",") if c]
    except ValueError:
        parser.error(f"bad {option} {text!r}")
        raise  # parser.error exits


def dispatch(roles: dict[str, Callable[[list[str]], int]], main: Callable[[], int]) -> None:
    """The entry of a script that runs itself for its children: sys.argv[1] a hidden role
    of `roles` (called with the argv from the role on), else the user's `main()`."""
    role = child_role(sys.argv, roles)
    sys.exit(roles[role](sys.argv[1:]) if role else main())
