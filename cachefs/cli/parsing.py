"""The argument parser every cachefs command line uses: exact option names, one-line errors, suggestions.

Why a class of our own. Plain argparse takes any unambiguous prefix of a long option, so
``--ram 1G`` becomes ``--ram-cache``, mount-s3's ``--cache /tmp/x`` silently becomes
``--cache-dir``, and an option added later can turn a prefix that worked yesterday into an error.
``CliParser`` turns that off (``allow_abbrev=False``, for the subcommands' parsers too, since
``add_subparsers`` hands them this class), prints every error as one line ``PROG: error: ...`` with
exit status 2, and follows an unknown option with the nearest real ones: the options that start
with what was typed, else ``difflib``'s close matches, from the option strings of the parsers that
took part in the parse (the command's and its subcommand's). Options hidden from ``--help``
(``--ready-fd``, plumbing between two cachefs processes) are never suggested.

Other helpers add their options to the parsers as usual: nothing here names an option.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

# At most this many suggestions after an unknown option: more is a list to read, not a hint.
MAX_SUGGESTIONS = 3
# difflib's similarity cutoff: 0.6 (its default) pairs "--ram" with "--ram-cache" and "--cache"
# with "--cache-dir" without pairing unrelated options.
SUGGESTION_CUTOFF = 0.6


def visible_options(parser: argparse.ArgumentParser) -> list[str]:
    """The option strings of ``parser`` that ``--help`` shows (hidden ones are not for users)."""
    return [option for action in parser._actions if action.help is not argparse.SUPPRESS
            for option in action.option_strings]


def suggestions(word: str, options: Iterable[str]) -> list[str]:
    """The options a mistyped ``word`` most likely meant: those it is a prefix of, else close matches."""
    name = word.split("=", 1)[0]
    known = list(dict.fromkeys(options))
    if not name.startswith("-") or name in known:
        return []
    prefixed = [option for option in known if option.startswith(name) and len(name) > 2]
    if prefixed:
        return prefixed[:MAX_SUGGESTIONS]
    return difflib.get_close_matches(name, known, n=MAX_SUGGESTIONS, cutoff=SUGGESTION_CUTOFF)


def unknown_message(extras: Sequence[str], options: Iterable[str]) -> str:
    """``unrecognized arguments: --ram 1G (did you mean --ram-cache?)``."""
    options = list(options)
    hints = [hint for word in extras for hint in suggestions(word, options)]
    message = f"unrecognized arguments: {' '.join(extras)}"
    if hints:
        message += f" (did you mean {' or '.join(dict.fromkeys(hints))}?)"
    return message


class CliParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with exact option names, one-line errors and suggestions."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # one line, exit 2
        command = self.prog.split()[0] if self.prog else "cachefs"
        self.exit(2, f"{command}: error: {message}\n")

    def add_subparsers(self, **kwargs: Any) -> Any:
        kwargs.setdefault("parser_class", CliParser)
        return super().add_subparsers(**kwargs)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            options = [option for parser in self._parsers_used(parsed) for option in visible_options(parser)]
            self.error(unknown_message(extras, options))
        return parsed

    def _parsers_used(self, parsed: argparse.Namespace) -> list[argparse.ArgumentParser]:
        """This parser and the subcommand parsers the parse went through (the innermost first)."""
        chain: list[argparse.ArgumentParser] = [self]
        parser: argparse.ArgumentParser = self
        while True:
            sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
            name = getattr(parsed, sub.dest, None) if sub is not None and sub.dest else None
            if sub is None or name not in sub.choices:
                return chain[::-1]
            parser = sub.choices[name]
            chain.append(parser)
