"""docs/configuration.md, billed as every option, has every option of every ``--help`` (issue 37, item
10), and ``cachefs mount --help`` names every source scheme the mount accepts."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Iterator

from cachefs.cli.main import build_parser
from tiering.objectstore import SUPPORTED_SCHEMES

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _options(parser: argparse.ArgumentParser, command: str, seen: set[int]) -> Iterator[tuple[str, str]]:
    """``(command, --option)`` for every long option a ``--help`` shows, through every subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if id(sub) not in seen:  # an alias (umount) is the same parser
                    seen.add(id(sub))
                    yield from _options(sub, f"{command} {name}".strip(), seen)
        elif action.help != argparse.SUPPRESS:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    yield command or "cachefs", option


def test_every_option_of_every_help_is_in_the_configuration_page() -> None:
    text = CONFIGURATION.read_text()
    options = list(_options(build_parser(), "", set()))
    assert len(options) > 60 and ("unmount", "--lazy") in options  # the walk reaches every command
    missing = [f"cachefs {command} {option}" for command, option in options
               if not re.search(re.escape(option) + r"(?![\w-])", text)]
    assert not missing, f"docs/configuration.md lacks: {', '.join(missing)}"


def test_mount_help_names_every_source_scheme() -> None:
    mount = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["mount"]
    text = " ".join(mount.format_help().split())
    missing = [scheme for scheme in SUPPORTED_SCHEMES if f"{scheme}://" not in text]
    assert not missing, f"cachefs mount --help does not name: {missing}"
