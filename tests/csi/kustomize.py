"""Real kustomize for the manifest tests: ``kubectl kustomize DIR``, parsed into objects.

The manifests are rendered by kustomize itself, never by a re-implementation: a home-made renderer
once accepted an overlay whose ``images:`` entry matched nothing, because it did not know that the
base had already renamed the image. ``kubectl`` (which embeds kustomize) is looked up on PATH and
beside the test interpreter (a venv may carry it as a wheel).

Where kubectl is missing the tests that need it skip with the reason, except in CI (``CI=true``) or
with ``CACHEFS_REQUIRE_KUBECTL=1``: there they fail instead, so a runner without kubectl cannot pass
by silently skipping them (as ``tests/fuse/conftest.py`` does for FUSE).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

# Rendering the base takes well under a second; a hung kubectl must not hang the run.
KUSTOMIZE_TIMEOUT_S = 60


def kubectl_path() -> str | None:
    beside_python = Path(sys.executable).with_name("kubectl")
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    return shutil.which("kubectl")


def kubectl_required() -> bool:
    return os.environ.get("CI", "").lower() == "true" or os.environ.get("CACHEFS_REQUIRE_KUBECTL") == "1"


def require_kubectl(what: str = "kustomize tests") -> str:
    """The kubectl executable; skip the calling test without one, or fail it in CI."""
    path = kubectl_path()
    if path is not None:
        return path
    reason = "kubectl is not installed (it renders the kustomize manifests: `kubectl kustomize DIR`)"
    if kubectl_required():
        pytest.fail(f"{what} cannot run: {reason} (CI=true or CACHEFS_REQUIRE_KUBECTL=1)")
    pytest.skip(f"{what} need kubectl: {reason}")


def kustomize_build(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k DIRECTORY`` would apply, in kustomize's order."""
    kubectl = require_kubectl()
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True,
                            timeout=KUSTOMIZE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]
