"""The cluster key: what authenticates every object cachefs reads back from a shared cluster store.

Why. The cluster store (``--cluster-cache``) is shared: every node writes blocks there, and with
``--write-durability cluster`` journals, data pieces and leases. Whoever can write to the store
could otherwise plant a block that another volume serves as its data, a journal record that
``cachefs recover`` uploads into a bucket, or a lease that fences a live writer. A checksum only
catches accidents. So every object cachefs writes there carries a MAC under a secret that only the
driver (the mounts sharing the store, and the recoverer) holds, never a tenant, and a reader
trusts nothing that fails it (docs/security.md, "Multi-tenant clusters").

Keys. The secret is a file (``--cluster-key-file``, ``CACHEFS_CLUSTER_KEY_FILE``) of at least
``KEY_MIN_BYTES`` bytes: ``head -c 32 /dev/urandom``, or text such as ``openssl rand -hex 32``
(a trailing newline is not part of it). One key per purpose is derived from it with HKDF-SHA256
(RFC 5869, extract then expand, through ``hmac``), so a block's MAC can never be replayed as a
journal record's or a lease's, and rotating the secret rotates them all.

The MACs. Block frames, hashed whole on every cluster-tier hit and write-behind (gigabytes a
minute), use BLAKE3's keyed mode (the ``blake3`` package, the reference Rust implementation, the GIL
released for large buffers): measured on this project's machine (8 MiB buffers, one thread, x86-64
with SHA extensions and AVX-512) at 0.17 CPU-s/GiB against HMAC-SHA256's 0.79, keyed BLAKE2b 1.09
and BLAKE2s 1.78 (``benchmarks/block_mac.py``; docs/security.md has the load). On 2 cores shared
with the store, HMAC over every cluster hit was a third of the cluster-tier node's CPU. Journal
records, data pieces and leases (small, or hashed once per write) keep HMAC-SHA256 (``hmac``), as
do block frames written by the previous release, which a node still reads (``clusterframe``).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import blake3

# 256 bits: the HMAC-SHA256 key size; a shorter secret is refused, not stretched.
KEY_MIN_BYTES = 32
# A key file larger than this is not a key (a path given by mistake): refused before it is read whole.
KEY_MAX_BYTES = 4096
MAC_SIZE = 32  # HMAC-SHA256, and BLAKE3's default output
_HASH = "sha256"
# The HKDF salt: fixed, names the scheme; the secret is already uniformly random.
_SALT = b"cachefs cluster key v1"

# The purposes a key is derived for (the HKDF "info"): one each, never shared.
BLOCKS = "cluster blocks v1"  # HMAC-SHA256 frames of the previous release: read, never written
BLOCKS_BLAKE3 = "cluster blocks v2 blake3"
JOURNAL = "write-back journal v1"
DATA = "write-back data v1"
LEASE = "write-back lease v1"


class ClusterKeyError(ValueError):
    """The cluster key file is missing, unreadable or too short (a start-up error, one line)."""


class MacKey:
    """One derived key: HMAC-SHA256 tags over byte strings, compared in constant time."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def tag(self, *parts: bytes | memoryview) -> bytes:
        """The MAC of the concatenation of ``parts`` (each large one hashed with the GIL released)."""
        if len(parts) == 1:
            return hmac.digest(self._key, parts[0], _HASH)
        mac = hmac.new(self._key, digestmod=_HASH)
        for part in parts:
            mac.update(part)
        return mac.digest()

    def running(self, *parts: bytes) -> "hmac.HMAC":
        """A MAC to feed piece by piece (``update``), starting with ``parts``."""
        mac = hmac.new(self._key, digestmod=_HASH)
        for part in parts:
            mac.update(part)
        return mac

    def check(self, tag: bytes | memoryview, *parts: bytes | memoryview) -> bool:
        """Whether ``tag`` is the MAC of ``parts``."""
        return hmac.compare_digest(bytes(tag), self.tag(*parts))

    def __repr__(self) -> str:  # never the key
        return "MacKey(<secret>)"


class Blake3Key:
    """One derived key: keyed BLAKE3 tags over byte strings (the same interface as ``MacKey``)."""

    def __init__(self, key: bytes) -> None:
        if len(key) != blake3.blake3.key_size:
            raise ValueError(f"a BLAKE3 key is {blake3.blake3.key_size} bytes")
        self._key = key

    def tag(self, *parts: bytes | memoryview) -> bytes:
        """The MAC of the concatenation of ``parts`` (large ones hashed with the GIL released)."""
        mac = blake3.blake3(key=self._key, max_threads=1)
        for part in parts:
            mac.update(part)
        return mac.digest()

    def check(self, tag: bytes | memoryview, *parts: bytes | memoryview) -> bool:
        """Whether ``tag`` is the MAC of ``parts`` (compared in constant time)."""
        return hmac.compare_digest(bytes(tag), self.tag(*parts))

    def __repr__(self) -> str:  # never the key
        return "Blake3Key(<secret>)"


class ClusterKey:
    """The secret of a cluster store's writers and readers, and the keys derived from it."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < KEY_MIN_BYTES:
            raise ClusterKeyError(f"the cluster key is {len(secret)} bytes; it must be at least {KEY_MIN_BYTES} "
                                  "random bytes (e.g. `head -c 32 /dev/urandom > FILE`)")
        self._prk = hmac.digest(_SALT, secret, _HASH)  # HKDF-Extract

    @classmethod
    def from_file(cls, path: Path) -> "ClusterKey":
        """The key in ``path``; ``ClusterKeyError`` names the file. A trailing newline is dropped from a
        text key only (printable ASCII: typed, or ``openssl rand -hex 32``): random bytes (``head -c 32
        /dev/urandom``) are the key whole, even when their last byte happens to be a newline."""
        try:
            with open(path, "rb") as f:
                raw = f.read(KEY_MAX_BYTES + 1)
        except OSError as exc:
            raise ClusterKeyError(f"cannot read the cluster key file {path}: {exc.strerror or exc}") from None
        if len(raw) > KEY_MAX_BYTES:
            raise ClusterKeyError(f"the cluster key file {path} is larger than {KEY_MAX_BYTES} bytes: not a key")
        secret = raw
        text = raw.rstrip(b"\r\n")
        if text != raw and text.isascii() and all(32 <= c < 127 for c in text):
            secret = text
        try:
            return cls(secret)
        except ClusterKeyError as exc:
            raise ClusterKeyError(f"{path}: {exc}") from None

    def derive(self, purpose: str) -> MacKey:
        """The key for one purpose (HKDF-Expand: one block of SHA-256 output is the 32-byte key)."""
        return MacKey(hmac.digest(self._prk, purpose.encode("ascii") + b"\x01", _HASH))

    def derive_blake3(self, purpose: str) -> Blake3Key:
        """The keyed-BLAKE3 key for one purpose, derived as ``derive``'s (a purpose of its own)."""
        return Blake3Key(hmac.digest(self._prk, purpose.encode("ascii") + b"\x01", _HASH))

    def fingerprint(self) -> str:
        """A short public name of this key (for logs and /stats: which key a node holds, not the key)."""
        return hashlib.sha256(self.derive("fingerprint v1").tag(b"")).hexdigest()[:12]

    def __repr__(self) -> str:
        return f"ClusterKey(fingerprint={self.fingerprint()})"


__all__ = ["BLOCKS", "BLOCKS_BLAKE3", "DATA", "JOURNAL", "KEY_MIN_BYTES", "LEASE", "MAC_SIZE", "Blake3Key", "ClusterKey", "ClusterKeyError", "MacKey"]
