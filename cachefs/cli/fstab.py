"""``mount.cachefs``: the mount(8) helper, so a line in /etc/fstab (or a systemd mount unit) mounts a bucket.

mount(8) runs ``mount.<type> SOURCE MOUNTPOINT [-sfnv] [-o OPTIONS]`` (for type ``cachefs``, or
``fuse.cachefs`` through a ``mount.fuse.cachefs`` link). This turns that into ``cachefs mount``:
``-o`` options are the ``cachefs mount`` long options with ``_`` or ``-``
(``ram_cache=2GiB`` is ``--ram-cache 2GiB``, ``allow_other`` is ``--allow-other``), plus ``ro`` for
``--read-only``. The names come from the ``cachefs mount`` parser itself, so options added later
work here too. Options that belong to mount(8) or systemd, not to the filesystem (``_netdev``,
``nofail``, ``noauto``, ``auto``, ``x-systemd.*`` and other ``x-*``, ``rw``, ``defaults``, and
``nosuid``/``nodev``, which FUSE applies anyway), are ignored; anything else is a one-line error.
``-f`` (fake) prints the ``cachefs`` command instead of running it; ``-s``, ``-n``, ``-v`` are
accepted and ignored. Credentials keep the AWS chain (``/root/.aws``, an instance role, or the
``Environment=`` of a systemd unit): never options, since mount options show in /proc/mounts.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Sequence

from cachefs.cli.environment import long_option
from cachefs.cli.parsing import CliParser
from cachefs.client import UsageError

PROG = "mount.cachefs"
# Options of mount(8) and systemd that the filesystem does not see (see the module docstring).
IGNORED_OPTIONS = frozenset({"_netdev", "nofail", "noauto", "auto", "rw", "defaults", "nosuid", "nodev"})
IGNORED_PREFIXES = ("x-",)  # x-systemd.automount, x-systemd.requires=..., x-mount.mkdir, ...
# fstab spellings that are not the name of a cachefs mount option.
ALIASES = {"ro": "read-only"}
# Options mount(8) must never pass through: running in the foreground would hang mount(8), and the
# log file and ready pipe belong to the spawned daemon.
REFUSED = frozenset({"foreground", "ready-fd", "help"})


def translate(source: str, mountpoint: str, options: Sequence[str]) -> list[str]:
    """``cachefs`` argv for ``mount.cachefs SOURCE MOUNTPOINT -o OPTIONS``; UsageError for a bad option."""
    from cachefs.cli.main import build_parser, subcommand_parser

    by_name: dict[str, argparse.Action] = {}
    for action in subcommand_parser(build_parser(), "mount")._actions:
        option = long_option(action)
        if option is not None:
            by_name[option[2:]] = action
    argv = ["mount", source, mountpoint]
    for item in options:
        item = item.strip()
        if not item or item in IGNORED_OPTIONS or item.startswith(IGNORED_PREFIXES):
            continue
        key, has_value, value = item.partition("=")
        name = ALIASES.get(key, key.replace("_", "-"))
        found = by_name.get(name)
        if found is None or name in REFUSED:
            raise UsageError(f"unknown mount option {key!r} (see 'cachefs mount --help'; write ram_cache=2GiB "
                             f"for --ram-cache 2GiB)")
        if found.nargs == 0:
            if has_value:
                raise UsageError(f"mount option {key!r} takes no value")
            argv.append(f"--{name}")
        else:
            if not has_value or value == "":
                raise UsageError(f"mount option {key!r} needs a value: {key}=VALUE")
            argv += [f"--{name}", value]
    return argv


def _parser() -> argparse.ArgumentParser:
    p = CliParser(prog=PROG, description="mount(8) helper for cachefs (fstab type cachefs)")
    p.add_argument("source")
    p.add_argument("mountpoint")
    p.add_argument("-o", dest="options", action="append", default=[], metavar="OPTIONS")
    p.add_argument("-f", dest="fake", action="store_true", help="print the cachefs command, do not run it")
    for flag in ("-s", "-n", "-v"):
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-t", dest="type", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> int:
    from cachefs.cli.main import main as cachefs_main

    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    options = [o for group in args.options for o in group.split(",")]
    try:
        command = translate(args.source, args.mountpoint, options)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if args.fake:
        print(shlex.join(["cachefs", *command]))
        return 0
    return cachefs_main(command, environ)


if __name__ == "__main__":
    raise SystemExit(main())
