"""Key and range checks shared by every object-store implementation.

They are the store-side half of the contract in ``tiering.protocols.ObjectStore``: a listing prefix is
``""`` or ends in ``/``; a byte range is ``0 <= start <= end``; a range past the object's end is
clamped to it (a read at or past EOF answers ``b""``), never an error. Every implementation calls
these before doing any I/O, so all of them refuse the same malformed calls in the same way.

Key length. S3 refuses a key longer than ``MAX_KEY_BYTES`` (``KeyTooLongError``, HTTP 400), and
retrying never helps, so a name whose key would be longer must be refused when it is made, not
acknowledged and then never uploaded. Each store says how many bytes of key are left below its root
(``ObjectStore.max_key_bytes``: the limit less the bucket prefix), and the filesystem checks every
name it makes against that (``cachefs.names.key_length_problem``).
"""

from __future__ import annotations

from tiering.errors import InvalidRangeError, ObjectNotFoundError

_DOT_COMPONENTS = frozenset({".", ".."})

# S3's limit on an object key: 1,024 bytes of UTF-8, the prefix included (the S3 user guide, "Naming
# Amazon S3 objects"). The in-memory double keeps it too, so unit tests see what S3 would refuse.
MAX_KEY_BYTES = 1024
# A local store's keys become paths below its root: Linux refuses a path over PATH_MAX (4,096
# bytes with its NUL) in any system call (ENAMETOOLONG).
LOCAL_MAX_PATH_BYTES = 4095


def key_room(prefix: str, limit: int = MAX_KEY_BYTES) -> int:
    """Bytes of key left below ``prefix`` (``limit`` less the prefix's UTF-8 length; may be <= 0)."""
    return limit - len(prefix.encode("utf-8", "surrogateescape"))


def check_list_prefix(prefix: str) -> None:
    """A listing prefix is ``""`` (the root) or a ``/``-terminated directory path without a leading ``/``.

    ``.`` and ``..`` components are refused too: see ``check_key``.
    """
    if prefix and (not prefix.endswith("/") or prefix.startswith("/")):
        raise ValueError(f"listing prefix {prefix!r} must be empty or end in '/' (and not start with '/')")
    if _DOT_COMPONENTS.intersection(prefix.split("/")) or "\x00" in prefix:
        raise ValueError(f"listing prefix {prefix!r} has a '.' or '..' component or a NUL")


def check_key(key: str) -> None:
    """Refuse keys that could name something outside the store's root: ``ObjectNotFoundError``.

    A ``.`` or ``..`` component is legal in an S3 key, but HTTP stacks normalise such paths (yarl
    resolves ``a/../b`` to ``b``; SeaweedFS answers 400), so a request for ``root/../x`` could read
    ``x`` beside the root. No store serves such a key: from the reader's side it does not exist.
    """
    if not key or "\x00" in key or _DOT_COMPONENTS.intersection(key.split("/")):
        raise ObjectNotFoundError(f"no such object: {key!r}")


def check_write_key(key: str) -> None:
    """A key to write: what ``check_key`` allows, plus no empty component and no leading ``/``.

    A trailing ``/`` is allowed (a directory marker ``a/b/``). Refusals are ``ValueError``: the
    filesystem never asks for such a key, so one reaching a store is a bug, not a missing object.
    """
    body = key[:-1] if key.endswith("/") else key
    if not body or "\x00" in key or key.startswith("/"):
        raise ValueError(f"cannot write object key {key!r}")
    if any(part in ("", ".", "..") for part in body.split("/")):
        raise ValueError(f"cannot write object key {key!r}: empty, '.' or '..' component")


def check_range(start: int, end: int) -> None:
    """A byte range ``[start, end)`` must be non-negative and not reversed."""
    if start < 0 or end < start:
        raise InvalidRangeError(f"invalid byte range [{start}, {end})")


def clamp_range(start: int, end: int, size: int) -> tuple[int, int]:
    """Clamp ``[start, end)`` to an object of ``size`` bytes; an empty range stays empty."""
    end = min(end, size)
    start = min(start, end)
    return start, end


def split_listing_key(prefix: str, key: str) -> tuple[str, bool] | None:
    """Classify ``key`` (which starts with ``prefix``) for a one-level listing of ``prefix``.

    Returns ``(name, is_dir)``: a file directly under the prefix, or the first path component of a
    deeper key (including a directory marker ``name/``). Returns None for the marker of ``prefix``
    itself, which is not listed.
    """
    rest = key[len(prefix):]
    if not rest:
        return None
    head, sep, _ = rest.partition("/")
    return head, bool(sep)
