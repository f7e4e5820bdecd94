"""Command line of tensorsocket: ``tensorsocket SUBCOMMAND`` or ``python -m tensorsocket``."""

from __future__ import annotations

import argparse
import signal
import sys
import traceback
from typing import Any, Sequence

PROG = "tensorsocket"


class UsageError(Exception):
    """A bad combination of arguments that argparse cannot check; ``hint`` says what to do."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


class _Terminated(BaseException):
    """Raised in the main thread by SIGTERM, so that commands clean up as on Ctrl-C."""


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM handler: unwind the command."""
    raise _Terminated()


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _cmd_demo(args: argparse.Namespace) -> int:
    """Run the demo: one producer, N training consumers, one shared loader."""
    from . import _core
    from .demo import run

    if args.consumers > _core.MAX_CONSUMERS:
        raise UsageError(f"--consumers {args.consumers} is more than a ring supports",
                         f"use at most {_core.MAX_CONSUMERS}")
    run(consumers=args.consumers, epochs=args.epochs, images=args.images, timeout=args.timeout)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one subparser per subcommand."""
    from . import __version__

    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks and the output of child processes on errors")

    parser = argparse.ArgumentParser(
        prog=PROG, parents=[debug],
        description="tensorsocket: shared data loading for collocated PyTorch training jobs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    demo = sub.add_parser(
        "demo", parents=[debug], help="run one producer and several training consumers",
        description="Start one producer process that runs a DataLoader with a CPU transform "
                    "over synthetic images, and N consumer processes that each train a tiny "
                    "CNN on the shared batches; print their throughput and the CPU time that "
                    "sharing the loader saved.")
    demo.add_argument("--consumers", type=_positive_int, default=3, metavar="N",
                      help="consumer processes (default: 3)")
    demo.add_argument("--epochs", type=_positive_int, default=2, metavar="N",
                      help="epochs to run (default: 2)")
    demo.add_argument("--images", type=_positive_int, default=1024, metavar="N",
                      help="synthetic images in the dataset (default: 1024)")
    demo.add_argument("--timeout", type=_positive_float, default=120.0, metavar="SECONDS",
                      help="stop every process and fail after this long (default: 120)")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version and usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    debug = getattr(args, "debug", False)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    prefix = f"{PROG} {args.command}"
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: leave signals alone
        previous = None
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"\n{prefix}: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print(f"{prefix}: terminated", file=sys.stderr)
        return 143
    except Exception as e:
        # Errors that carry a hint (DemoError, UsageError) are expected failures: their
        # message is for the user. Anything else is shown with its type.
        hint = getattr(e, "hint", None)
        if debug:
            traceback.print_exc()
            details = getattr(e, "details", "")
            if details:
                print(details, file=sys.stderr)
        message = str(e) if hint is not None else f"{type(e).__name__}: {e}"
        print(f"{prefix}: error: {message}", file=sys.stderr)
        if hint:
            print(f"hint: {hint}", file=sys.stderr)
        if not debug and getattr(e, "details", ""):
            print("hint: run again with --debug to see the output of the child processes",
                  file=sys.stderr)
        elif not debug and hint is None:
            print("hint: run again with --debug to see the full traceback", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
