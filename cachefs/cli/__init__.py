"""The CLI floor: ``cachefs`` commands (``cachefs.cli.main`` parses and dispatches).

``main`` is re-exported here because it is the console script's entry point (``cachefs.cli:main``).
"""

from cachefs.cli.main import main

__all__ = ["main"]
