"""Cluster keys for tests (``tiering.clusterkey``): a fixed one, another one, and a key file on disk."""

from __future__ import annotations

from pathlib import Path

from tiering.clusterkey import ClusterKey

# Fixed, so the golden-bytes tests of the formats keyed by it stay stable.
TEST_SECRET = bytes(range(32))
TEST_KEY = ClusterKey(TEST_SECRET)
# Another deployment's key (or a forger's guess): everything written with it must be refused.
OTHER_KEY = ClusterKey(b"another cluster, another key....")


def write_key_file(directory: Path, secret: bytes = TEST_SECRET) -> Path:
    """A key file readable by its owner only, as a Secret volume would mount it."""
    path = directory / "cluster.key"
    path.write_bytes(secret)
    path.chmod(0o600)
    return path
