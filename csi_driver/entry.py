"""Console entry points of the Kubernetes parts, which live behind extras of the distribution.

``pip install .`` gives the tool (``cachefs``, ``mount.cachefs``, ``cachefs-flex``) without the
Kubernetes stack; ``cachefs-fuse[csi]`` adds what ``cachefs-csi`` needs (gRPC, protobuf, the
Kubernetes client for mount pods), ``cachefs-fuse[operator]`` what ``cachefs-operator`` needs
(kopf, the Kubernetes client). Each entry point checks for its modules before importing anything
that needs them, so a missing extra is one line naming the extra to install, not a traceback.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

DISTRIBUTION = "cachefs-fuse"
# The modules each extra provides, as the entry points import them.
EXTRA_MODULES = {
    "csi": ("grpc", "google.protobuf", "kubernetes"),
    "operator": ("kopf", "kubernetes", "croniter"),
}


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    missing = []
    for name in EXTRA_MODULES[extra]:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package missing ("google"), or a broken one
            found = False
        if not found:
            missing.append(name)
    return missing


def require_extra(prog: str, extra: str) -> None:
    """Exit with status 2 and one line if ``extra`` is not installed."""
    missing = missing_modules(extra)
    if missing:
        sys.stderr.write(f"{prog}: error: {prog} needs the [{extra}] extra (missing: {', '.join(missing)}): "
                         f"pip install '{DISTRIBUTION}[{extra}]'\n")
        raise SystemExit(2)


def csi(argv: Sequence[str] | None = None) -> int:
    """``cachefs-csi``."""
    require_extra("cachefs-csi", "csi")
    from csi_driver.main import main

    return main(argv)


def operator(argv: Sequence[str] | None = None) -> int:
    """``cachefs-operator``."""
    require_extra("cachefs-operator", "operator")
    from csi_driver.operator.main import main

    return main(argv)
