"""The ``cachefs`` command line: parsing and dispatch; each command lives in its own module.

Only this package (and the CSI entry points) reads argv and the environment; everything below it
receives frozen settings objects. Every user error ends in one line on stderr naming the problem and
a non-zero exit, never a traceback. Commands that act on a running mount talk to its daemon only
through ``cachefs.client`` (HTTP over the mount's control socket); ``cachefs mount --foreground``
is the one command that runs the daemon itself (``cachefs.cli.mount``).

Commands: ``mount`` and ``unmount`` (``cachefs.cli.mount``), ``stats`` (``cachefs.cli.stats``),
``prefetch``/``snapshot``/``unpin``/``evict`` (``cachefs.cli.prefetch``), ``flush``/``status``
(``cachefs.cli.writeback``), ``recover`` (``cachefs.cli.recover``), ``cluster gc`` (``cachefs.cli.cluster``). Each module's
``register(subparsers)`` adds its parsers.

Conventions: ``cachefs --version``; a bare ``cachefs`` prints the help on stderr and exits 2, as
argparse does for a missing argument; every ``cachefs mount`` option may also come from a
``CACHEFS_*`` environment variable, and a flag on the command line wins (``cachefs.cli.environment``).
The ``mount.cachefs`` helper for /etc/fstab is ``cachefs.cli.fstab``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from cachefs import package_version
from cachefs.cli import cluster, mount, prefetch, recover, stats, writeback
from cachefs.cli.environment import apply_environment, defer_defaults, unknown_variables
from cachefs.cli.parsing import CliParser
from cachefs.client import UsageError

# Modules that add subcommands, in the order ``cachefs --help`` lists them: each has
# ``register(subparsers)``. ``prefetch`` and ``writeback`` set ``handler=fn`` with
# ``fn(args, environ) -> int``; ``mount``, ``unmount`` and ``stats`` are dispatched below.
COMMANDS = (mount, stats, prefetch, writeback, recover, cluster)


EPILOG = """\
examples:
  cachefs mount s3://my-bucket/train /mnt/train --read-only     # a bucket prefix as a directory
  cachefs mount s3://data /mnt/data --endpoint-url http://127.0.0.1:8333   # an S3-compatible server
  cachefs prefetch /mnt/train --recursive                       # warm the disk cache ahead of a job
  cachefs stats /mnt/train --watch 2                            # hit ratio and traffic every 2 s
  cachefs unmount /mnt/train                                    # flush written data, then unmount

Every 'cachefs mount' option may also be set by a CACHEFS_* environment variable (--ram-cache is
CACHEFS_RAM_CACHE, --read-only is CACHEFS_READ_ONLY=1); a flag on the command line wins. Credentials
come from the standard AWS chain (AWS_ACCESS_KEY_ID, AWS_PROFILE, ...), never from options.
'cachefs COMMAND --help' describes each command.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="cachefs", description="A tiered RAM -> disk -> object store cache, mounted with FUSE.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"cachefs {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` (argparse keeps them in its subparsers action)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise KeyError(name)


def main(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = dict(os.environ if environ is None else environ)
    parser = build_parser()
    if not argv:
        sys.stderr.write(parser.format_help())
        return 2
    mount_parser = subcommand_parser(parser, "mount")
    mount_defaults = defer_defaults(mount_parser)
    args = parser.parse_args(argv)
    try:
        if args.command == "mount":
            if args.ready_fd is None:  # the terminal's process (a spawned daemon re-reads the same environment)
                for line in unknown_variables(mount_parser, environ):
                    print(f"cachefs: warning: {line}", file=sys.stderr)
            apply_environment(args, mount_parser, mount_defaults, environ)
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
