"""python3 -m tools.torchvision_cpu ensure [--dir D] | env [--dir D]: see the package."""

from __future__ import annotations

import argparse
import sys

from tools import torchvision_cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tools.torchvision_cpu",
                                     description=torchvision_cpu.__doc__.splitlines()[0]
                                     if torchvision_cpu.__doc__ else None)
    parser.add_argument("command", choices=("ensure", "env"),
                        help="ensure: install and check (idempotent); env: print the "
                             "environment to use, or why there is none")
    parser.add_argument("--dir", default=None,
                        help=f"where to install (default {torchvision_cpu.DEFAULT_DIR})")
    parser.add_argument("--timeout", type=float, default=600, help="seconds (ensure)")
    args = parser.parse_args(argv)
    if args.command == "ensure":
        try:
            torchvision_cpu.ensure(args.dir, timeout=args.timeout)
        except torchvision_cpu.Unavailable as e:
            print(f"torchvision-cpu: unavailable: {e}", file=sys.stderr)
            return 1
        return 0
    env = torchvision_cpu.environment(args.dir)
    if env is None:
        print(torchvision_cpu.why_not(args.dir), file=sys.stderr)
        return 1
    for key, value in env.items():
        print(f"export {key}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
