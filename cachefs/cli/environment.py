"""``CACHEFS_*`` environment variables for the options of a command, derived from its parser.

Every long option of ``cachefs mount`` has a variable: ``--ram-cache`` is ``CACHEFS_RAM_CACHE``,
``--read-only`` is ``CACHEFS_READ_ONLY`` (as rclone's ``RCLONE_*``). The names come from the
argparse actions themselves, so an option added later gets its variable with no extra code.

How flags win over the environment: before parsing, ``defer_defaults`` replaces the default of every
such option with a sentinel, so after parsing a sentinel means "not on the command line"; then
``apply_environment`` fills each of those from its variable (converted by the option's own ``type``
and checked against its ``choices``), or puts the original default back. A bad value is a one-line
``UsageError`` naming the variable. Flags (``store_true``) take ``1/true/yes/on`` or
``0/false/no/off``; an empty variable counts as unset (systemd's ``Environment=X=`` clears one).

Variables that name no option are not used by ``cachefs mount``; those that cachefs knows for other
purposes (``OTHER_VARIABLES``: the FlexVolume shim's, the test suite's) are left alone, and any other
``CACHEFS_*`` name is a misspelling: ``unknown_variables`` names it in a warning, with the nearest
known name (``CACHEFS_RAM_CACH``: did you mean ``CACHEFS_RAM_CACHE``?), rather than ignoring it in
silence. There are no credential options, so credentials never travel this way: they keep the AWS chain.
"""

from __future__ import annotations

import argparse
import difflib
from typing import Mapping

from cachefs.client import UsageError

ENV_PREFIX = "CACHEFS_"
# Options that are plumbing between two cachefs processes, not settings: the pipe a spawned daemon
# reports on is never taken from the environment (a stray variable would point it at a random fd).
INTERNAL_DESTS = frozenset({"ready_fd"})
# CACHEFS_* variables that are not mount options but are read elsewhere, so never "unknown".
OTHER_VARIABLES = frozenset({
    "CACHEFS_FLEX_LOG", "CACHEFS_FLEX_CACHE_ROOT",  # the FlexVolume shim (csi_driver.flex)
    # the test suite (tests/): skip-or-fail switches and the replay seeds of the randomised tests
    "CACHEFS_REQUIRE_FUSE", "CACHEFS_REQUIRE_KUBECTL", "CACHEFS_WB_STEPS", "CACHEFS_WB_EAGER_STEPS",
    "CACHEFS_WB_SEED", "CACHEFS_WB_CRASH_TRIALS", "CACHEFS_WB_CRASH_SEED",
})
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


class _Unset:
    """The default of an option while parsing: seen afterwards, the option was not on the command line."""

    def __repr__(self) -> str:
        return "<unset>"


UNSET = _Unset()


def long_option(action: argparse.Action) -> str | None:
    """The first ``--long`` option string of ``action`` (None for positionals and short-only options)."""
    return next((s for s in action.option_strings if s.startswith("--")), None)


def env_name(action: argparse.Action) -> str | None:
    """``CACHEFS_RAM_CACHE`` for ``--ram-cache``; None for actions that get none (help, internal)."""
    option = long_option(action)
    if option is None or isinstance(action, argparse._HelpAction | argparse._VersionAction):
        return None
    if action.dest in INTERNAL_DESTS:
        return None
    return ENV_PREFIX + option[2:].upper().replace("-", "_")


def options_with_env(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    """``(variable, action)`` for every option of ``parser`` that a variable may set."""
    return [(name, action) for action in parser._actions if (name := env_name(action)) is not None]


def defer_defaults(parser: argparse.ArgumentParser) -> dict[str, object]:
    """Replace the defaults of ``parser``'s options with ``UNSET``; returns the originals by dest."""
    originals: dict[str, object] = {}
    for _name, action in options_with_env(parser):
        originals[action.dest] = action.default
        action.default = UNSET
    return originals


def _convert(name: str, action: argparse.Action, text: str) -> object:
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        word = text.strip().lower()
        if word not in TRUE_WORDS | FALSE_WORDS:
            raise UsageError(f"{name}={text!r}: expected 1, true, yes, on or 0, false, no, off")
        on = word in TRUE_WORDS
        return on if isinstance(action, argparse._StoreTrueAction) else not on
    if action.nargs not in (None, "?"):
        raise UsageError(f"{name} cannot be set from the environment")  # no such option today
    try:
        value = action.type(text) if callable(action.type) else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        reason = str(exc) or f"invalid value {text!r}"
        raise UsageError(f"{name}: {reason}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(str(c) for c in action.choices)
        raise UsageError(f"{name}={text!r}: expected one of {choices}")
    return value


def apply_environment(args: argparse.Namespace, parser: argparse.ArgumentParser,
                      originals: Mapping[str, object], environ: Mapping[str, str]) -> None:
    """Fill the options left ``UNSET`` in ``args`` from ``CACHEFS_*`` variables, else their defaults."""
    for name, action in options_with_env(parser):
        if getattr(args, action.dest, None) is not UNSET:
            continue  # given on the command line: flags win
        text = environ.get(name, "")
        value = _convert(name, action, text) if text != "" else originals.get(action.dest)
        setattr(args, action.dest, value)


def unknown_variables(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> list[str]:
    """One warning line for each ``CACHEFS_*`` variable in ``environ`` that cachefs does not know."""
    known = {name for name, _action in options_with_env(parser)} | OTHER_VARIABLES
    lines = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known:
            continue
        # Compared without the shared prefix, which would make every name look close to every other.
        close = difflib.get_close_matches(name.removeprefix(ENV_PREFIX),
                                          sorted(k.removeprefix(ENV_PREFIX) for k in known), n=1)
        hint = (f"; did you mean {ENV_PREFIX}{close[0]}?" if close
                else " (the mount options' variables: cachefs mount --help)")
        lines.append(f"{name} is not a cachefs variable and is ignored{hint}")
    return lines
