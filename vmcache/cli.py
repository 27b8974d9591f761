"""The ``vmcache`` command.

Each subcommand lives in its own module under ``vmcache.commands`` and
exposes ``NAME``, ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``;
this module finds them, parses the command line and turns vmcache's errors
into one-line messages and exit codes.

Only the module of the command being run is imported (``vmcache.commands.<NAME>``);
all of them only for ``vmcache --help``, an unknown command or a module whose
``NAME`` differs from its file name. A command that needs heavy libraries
(numpy, libvirt, ...) for only some of its work imports them inside ``run``,
so ``vmcache scan IMAGE`` does not pay for them. A module that never logs
may set ``LOGS = False``: logging (~6 ms of imports) is then configured only
with ``-v``.

Every command exits quietly (status 141, as if killed by SIGPIPE) when the
reader of its output goes away: ``vmcache status --json | head -c 10``.
"""

from __future__ import annotations

import argparse
import importlib
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
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a command killed by a closed pipe exits with


def _command_modules() -> list[ModuleType]:
    """Every command module, sorted by file name."""
    import pkgutil  # 3-4 ms of imports (importlib.util and friends): only when listing them all

    found = []
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        if hasattr(module, "NAME") and hasattr(module, "run"):
            found.append(module)
    return found


def _command_module(name: str) -> ModuleType | None:
    """The module ``vmcache.commands.<name>`` if it is the command ``name``, else None."""
    if not name.isidentifier() or name.startswith("_"):
        return None
    qualified = f"{commands.__name__}.{name}"
    try:
        module = importlib.import_module(qualified)
    except ModuleNotFoundError as err:
        if err.name == qualified:
            return None
        raise
    if getattr(module, "NAME", None) == name and hasattr(module, "run"):
        return module
    return None


def _command_name(argv: Sequence[str]) -> str | None:
    """The command named in ``argv``: its first argument that is not an option.

    Right as long as vmcache's own options (before the command) take no value.
    """
    for arg in argv:
        if arg == "--":
            return None
        if not arg.startswith("-"):
            return arg
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser, one subparser per command module.

    ``command``: the command about to run; when it names a command module,
    only that module is imported and given a subparser.
    """
    parser = argparse.ArgumentParser(
        prog="vmcache",
        description="Keep the hot regions of virtual disks resident in the host page cache.",
    )
    parser.add_argument("--version", action="version", version=f"vmcache {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    selected = _command_module(command) if command else None
    for module in [selected] if selected else _command_modules():
        cmd = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(func=module.run)
    return parser


def _configure_logging(verbose: int) -> None:
    """Log lines to stderr: warnings, with -v info, with -vv debug."""
    import logging

    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit status."""
    try:
        try:
            return _run(sys.argv[1:] if argv is None else list(argv))
        finally:
            sys.stdout.flush()  # here, not at exit: a reader that went away is a BrokenPipeError to handle
    except BrokenPipeError:
        return _closed_pipe()


def _run(argv: list[str]) -> int:
    parser = build_parser(_command_name(argv))
    args = parser.parse_args(argv)
    if args.verbose or getattr(sys.modules.get(args.func.__module__), "LOGS", True):
        _configure_logging(args.verbose)
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


def _closed_pipe() -> int:
    """The reader of stdout went away (``vmcache status --json | head -c 10``): stop quietly.

    What is still buffered cannot be written, and Python would try again
    (and print a traceback) as it exits: stdout is pointed at /dev/null.
    """
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (a test's capture): nothing to flush at exit either
        pass
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
