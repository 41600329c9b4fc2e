"""The ``cachefs`` command line: parsing and dispatch; each command lives in its own module.

Only this package (and the CSI entry points) reads argv and the environment; everything below it
receives frozen settings objects. Every user error ends in one line on stderr naming the problem and
a non-zero exit, never a traceback. Commands that act on a running mount talk to its daemon only
through ``cachefs.client`` (HTTP over the mount's control socket); ``cachefs mount --foreground``
is the one command that runs the daemon itself (``cachefs.cli.mount``).

Commands: ``mount`` and ``unmount`` (``cachefs.cli.mount``), ``stats`` (``cachefs.cli.stats``),
``prefetch``/``snapshot``/``unpin``/``evict`` (``cachefs.cli.prefetch``), ``flush``/``status``
(``cachefs.cli.writeback``). Each module's ``register(subparsers)`` adds its parsers.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn, Sequence

from cachefs.cli import mount, prefetch, stats, writeback
from cachefs.client import UsageError

# Modules that add subcommands, in the order ``cachefs --help`` lists them: each has
# ``register(subparsers)``. ``prefetch`` and ``writeback`` set ``handler=fn`` with
# ``fn(args, environ) -> int``; ``mount``, ``unmount`` and ``stats`` are dispatched below.
COMMANDS = (mount, stats, prefetch, writeback)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(2, f"cachefs: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cachefs", description="A tiered RAM -> disk -> object store cache, mounted with FUSE.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = dict(os.environ if environ is None else environ)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "mount":
            return mount.cmd_mount(args, argv, environ)
        if args.command in ("unmount", "umount"):
            return mount.cmd_unmount(args)
        if args.command == "stats":
            return stats.cmd_stats(args)
        handler = getattr(args, "handler", None)
        if handler is not None:
            return handler(args, environ)
    except UsageError as exc:
        print(f"cachefs: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `cachefs stats --json | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    raise AssertionError(f"unhandled command {args.command}")
