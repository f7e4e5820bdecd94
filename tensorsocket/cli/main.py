"""Command line of tensorsocket: ``tensorsocket SUBCOMMAND`` or ``python -m tensorsocket``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from typing import Any, Callable, NoReturn, Sequence

from ..config import Integer, Kind, Seconds

PROG = "tensorsocket"


class UsageError(Exception):
    """A bad combination of arguments that argparse cannot check; ``hint`` says what to do."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


class CommandError(Exception):
    """An expected failure whose message says what to do (a bad runtime directory, a
    bad TENSORSOCKET_* value): shown as one line, with ``hint`` if given; exit 1."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line and a hint with the usage of
    the (sub)command they belong to."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        """Parse; an argument this (sub)command does not know is its usage error (argparse
        would leave it to the top-level parser, which shows the top-level usage)."""
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def error(self, message: str) -> NoReturn:
        """Print `prog: error: message` and the usage on one line; exit 2."""
        usage = " ".join(self.format_usage().split())
        self.exit(2, f"{self.prog}: error: {message}\n"
                     f"hint: {usage} (`{self.prog} --help` explains each option)\n")


class _Terminated(BaseException):
    """Raised in the main thread by SIGTERM, so that commands clean up as on Ctrl-C."""


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM handler: unwind the command."""
    raise _Terminated()


def _option(kind: Kind) -> Callable[[str], Any]:
    """argparse type of an option that takes a value of a setting's kind (config.Kind):
    its text is parsed as a TENSORSOCKET_* variable's is, and refused in the same words."""

    def parse(text: str) -> Any:
        try:
            return kind.parse(text.strip())
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                f"{text} is not valid: it takes {kind.takes} ({e})") from None

    return parse


def _runtime_dir() -> Any:
    """The runtime directory for sockets and locks; CommandError if it cannot be used."""
    from .. import config
    from ..control.endpoints import runtime_dir

    var = config.SETTINGS["runtime_dir"].env
    try:
        return runtime_dir()
    except (OSError, ValueError) as e:
        if var in str(e):  # the message names the variable and what to do
            raise CommandError(str(e)) from None
        raise CommandError(f"cannot use the runtime directory for sockets and locks: {e}",
                           f"set {var} to a directory of your own (created mode 0700 if "
                           "missing)") from None


def _width() -> int:
    """Columns to wrap text at: $COLUMNS if set, else the terminal's, else 80."""
    import shutil

    return shutil.get_terminal_size((80, 24)).columns


def _check_name(name: str | None) -> None:
    """A --name must be a valid producer name."""
    from ..control.endpoints import check_name

    if name is not None:
        try:
            check_name(name)
        except ValueError as e:
            raise UsageError(str(e), "producer names are the name= given to TensorProducer; "
                             "`tensorsocket status` lists them") from None


def _cmd_status(args: argparse.Namespace) -> int:
    """Print every producer of this user and its consumers, or a JSON document."""
    import json

    from ..store.survey import survey_stores
    from .status import as_json, no_producer_named, other_users, render, survey

    _check_name(args.name)
    producers = survey(args.interval, args.name)
    others = other_users(args.name)
    stores = survey_stores() if args.name is None else []
    missing = args.name is not None and not producers
    line, hint = no_producer_named(args.name) if missing else ("", "")
    if args.json:
        json.dump(as_json(producers, args.interval, others, stores), sys.stdout, indent=2)
        print()
    elif missing:
        print(line)
        if others:  # another user's producer of that name
            print("\n".join(render([], _width(), others)[1:]))
    else:
        print("\n".join(render(producers, _width(), others, stores)))
    if hint:
        print(f"hint: {hint}", file=sys.stderr)
    return 1 if missing else 0


def _cmd_top(args: argparse.Namespace) -> int:
    """Show the status live until q."""
    from .top import run

    _check_name(args.name)
    return run(args.interval, args.name, args.iterations, force_plain=args.plain)


def _cmd_clean(args: argparse.Namespace) -> int:
    """Remove what dead producers left; --dry-run only lists it."""
    from .clean import leftovers, remove

    _check_name(args.name)
    rdir = _runtime_dir()
    found = [item for item in leftovers(rdir) if args.name is None or item.name == args.name]
    if not found:
        print("nothing to clean: no segment, socket, lock or log of a dead producer, no "
              "store of decoded samples that no job uses")
        return 0
    failed = 0
    verb = "would remove" if args.dry_run else "removed"
    for item in found:
        problem = None if args.dry_run else remove(item)
        if problem is None:
            print(f"{verb} {item.describe()}")
        else:
            failed += 1
            print(f"kept    {item.path}: {problem}")
    done = len(found) - failed
    summary = f"{done} item(s) {'to remove' if args.dry_run else 'removed'}"
    if failed:
        summary += f", {failed} kept"
    if args.dry_run:
        summary += "; run without --dry-run to remove them"
    print(summary)
    return 1 if failed else 0


def _cmd_config(args: argparse.Namespace) -> int:
    """Show the settings environment variables give here, or docs/configuration.md."""
    from . import config_command

    return config_command.run(markdown_page=args.markdown)


def _command(sub: Any, debug: argparse.ArgumentParser, name: str,
             run: Callable[[argparse.Namespace], int], *, summary: str, description: str,
             by_name: bool = False) -> argparse.ArgumentParser:
    """The subparser of command `name`, which `run` carries out (by_name: with --name,
    which picks one producer)."""
    command = sub.add_parser(name, parents=[debug], help=summary, description=description)
    if by_name:
        command.add_argument(
            "--name", metavar="NAME",
            help="only the producer of this name= (default: every producer of this user)")
    command.set_defaults(func=run)
    return command


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one subparser per subcommand."""
    from .. import __version__

    debug = _Parser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks on errors")

    parser = _Parser(
        prog=PROG, parents=[debug],
        description="tensorsocket: shared data loading for collocated PyTorch training jobs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands",
                                parser_class=_Parser)

    status = _command(
        sub, debug, "status", _cmd_status, by_name=True,
        summary="show every producer on this machine and its consumers",
        description="Read every tensorsocket ring segment of this user (no daemon needed) and "
                    "show each producer (pid, epoch, batch rate, ring occupancy, bytes per "
                    "batch, loader CPU) and its consumers (pid, batch size, cursor, lag, rate). "
                    "Rates are measured over --interval seconds.")
    status.add_argument("--json", action="store_true",
                        help="print a JSON document (format 1, see docs/cli.md) for scripts")
    status.add_argument("--interval", type=_option(Seconds()), default=0.5, metavar="SECONDS",
                        help="measure rates over this long (default: 0.5; 0: no rates)")

    top = _command(
        sub, debug, "top", _cmd_top, by_name=True,
        summary="the status, refreshed live (q quits)",
        description="Show `tensorsocket status` full-screen, refreshed every --interval "
                    "seconds (curses). Keys: q quits, + and - change the refresh. When "
                    "standard output is not a terminal, print a snapshot per refresh.")
    refresh = Seconds(above=True, at_minimum="0 is refused: the view would be redrawn "
                                             "without pause")
    top.add_argument("--interval", type=_option(refresh), default=1.0, metavar="SECONDS",
                     help="seconds between refreshes (default: 1)")
    top.add_argument("--iterations", type=_option(Integer(1)), default=None, metavar="N",
                     help="stop after N refreshes (default: run until q or Ctrl-C)")
    top.add_argument("--plain", action="store_true",
                     help="print snapshots instead of the full-screen view")

    clean = _command(
        sub, debug, "clean", _cmd_clean, by_name=True,
        summary="remove segments, sockets and logs left by dead producers",
        description="Remove the shared-memory segments, sockets and lock files that producers "
                    "killed without cleaning up left behind, and the logs that share()'s "
                    "producers that failed or were killed left for reading. Never touches a "
                    "live producer's: a segment is removed only when the process recorded in "
                    "it is gone, a socket or lock only when no producer holds the name's lock, "
                    "a log only when besides no share() is starting or ending a producer of "
                    "the name.")
    clean.add_argument("--dry-run", action="store_true",
                       help="list what would be removed, remove nothing")

    config = _command(
        sub, debug, "config", _cmd_config,
        summary="the settings environment variables give here",
        description="List every TENSORSOCKET_* setting, its value in this environment (or "
                    "its default) and the argument that overrides it; exit 1 if a variable "
                    "does not parse or is no setting (a typo). A value that is likely a "
                    "mistake (an address other machines reach) gets a warning.")
    config.add_argument("--markdown", action="store_true",
                        help="print docs/configuration.md (the one table of settings)")
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
    except BrokenPipeError:  # `tensorsocket status | head`: the reader left, not an error
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the exit flush quiet
        except OSError:
            pass
        return 141
    except _Terminated:
        print(f"{prefix}: terminated", file=sys.stderr)
        return 143
    except Exception as e:
        # Errors that carry a hint (UsageError, CommandError; "" for none) are
        # expected failures: their message is for the user and says what to do. Anything
        # else is unexpected: shown with its type and the --debug hint.
        hint = getattr(e, "hint", None)
        if debug:
            traceback.print_exc()
        message = str(e) if hint is not None else f"{type(e).__name__}: {e}"
        print(f"{prefix}: error: {message}", file=sys.stderr)
        if hint:
            print(f"hint: {hint}", file=sys.stderr)
        if not debug and hint is None:
            print("hint: run again with --debug to see the full traceback", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
