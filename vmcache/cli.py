"""The ``vmcache`` command.

Each subcommand lives in its own module under ``vmcache.commands`` and
exposes ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``;
this module finds them, parses the command line and turns vmcache's errors
into one-line messages and exit codes.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType

from . import __version__, commands
from .errors import ConfigError, VmcacheError

__all__ = ["main", "build_parser"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def _command_modules() -> list[ModuleType]:
    found = []
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        if hasattr(module, "NAME") and hasattr(module, "run"):
            found.append(module)
    return found


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, one subparser per command module."""
    parser = argparse.ArgumentParser(
        prog="vmcache",
        description="Keep the hot regions of virtual disks resident in the host page cache.",
    )
    parser.add_argument("--version", action="version", version=f"vmcache {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in _command_modules():
        cmd = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(func=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or EXIT_OK)
    except ConfigError as err:
        print(f"vmcache {args.command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except VmcacheError as err:
        print(f"vmcache {args.command}: {err}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
