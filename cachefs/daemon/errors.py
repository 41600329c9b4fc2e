"""Why a mount cannot start. Raised by the daemon and its features, reported by the CLI in one line."""

from __future__ import annotations


class SetupError(Exception):
    """A mount cannot start: bad settings, unreachable store, unusable mountpoint or cache dir.

    Its message is one line, shown to the user as is.
    """
