"""``FsspecObjectStore`` over stand-ins for the backends not installed here (gcsfs, huggingface_hub).

These check cachefs's side only: which ``info()`` field is read as the version, that a GCS read
names the generation it wants (``path#generation``, gcsfs ``version_aware``) and tells a changed
object from a deleted one, that a Hub read re-reads the hash after the bytes, and that a listing
takes the version from the listing entry when it is there (no HEAD per file). The stand-ins model
the fields the real backends document; that the real ones behave so is not tested here (their
packages are optional extras). The http(s) and memory paths run against real parts in
``tests/contract`` and ``tests/integration``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from fsspec.asyn import AsyncFileSystem
from fsspec.spec import AbstractFileSystem

from tiering.errors import ObjectChangedError, ObjectNotFoundError
from tiering.objectstore import FsspecObjectStore, parse_source
from tiering.objectstore.fsspec_store import _version


@pytest.mark.parametrize(("protocol", "info", "expected"), [
    ("gs", {"generation": 1712345678901234}, "1712345678901234"),
    ("gs", {"generation": "17"}, "17"),
    ("gs", {}, None),
    ("az", {"etag": "0x8DC0FFEE"}, "0x8DC0FFEE"),
    ("az", {"etag": ""}, None),
    ("hf", {"lfs": {"sha256": "ab" * 32, "size": 5}, "blob_id": "c" * 40}, "ab" * 32),
    ("hf", {"lfs": None, "blob_id": "c" * 40}, "c" * 40),
    ("http", {"ETag": '"abc"'}, '"abc"'),
    ("https", {"ETag": 'W/"abc"'}, None),  # a weak tag: If-Match never matches it
    ("http", {}, None),
    ("memory", {"md5": '"0cc175b9c0f1b6a831c399e269772661"'}, '"0cc175b9c0f1b6a831c399e269772661"'),
])
def test_version_identity_per_protocol(protocol: str, info: dict[str, Any], expected: str | None) -> None:
    assert _version(protocol, info) == expected


class FakeGcs(AsyncFileSystem):
    """Objects with generations; ``path#generation`` reads only that generation (as version_aware gcsfs)."""

    protocol = "gs"

    def __init__(self) -> None:
        super().__init__(asynchronous=True, skip_instance_cache=True)
        self.objects: dict[str, tuple[bytes, int]] = {}
        self.reads: list[str] = []
        self.infos = 0
        self._next = 1000

    def write(self, path: str, data: bytes) -> None:
        self._next += 1
        self.objects[path] = (data, self._next)

    def _entry(self, path: str) -> dict[str, Any]:
        data, generation = self.objects[path]
        return {"name": path, "size": len(data), "type": "file", "generation": str(generation),
                "updated": "2026-01-02T03:04:05.000Z"}

    async def _info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self.infos += 1
        if path not in self.objects:
            raise FileNotFoundError(path)
        return self._entry(path)

    async def _ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[dict[str, Any]]:
        base = path.rstrip("/") + "/"
        out: dict[str, dict[str, Any]] = {}
        for name in self.objects:
            if name.startswith(base):
                rest = name[len(base):]
                if "/" in rest:
                    out[base + rest.split("/")[0]] = {"name": base + rest.split("/")[0], "type": "directory", "size": 0}
                else:
                    out[name] = self._entry(name)
        return list(out.values())

    async def _cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> bytes:
        self.reads.append(path)
        name, _, generation = path.partition("#")
        if name not in self.objects or (generation and str(self.objects[name][1]) != generation):
            raise FileNotFoundError(path)
        return self.objects[name][0][start:end]


async def test_gcs_reads_name_the_generation() -> None:
    fs = FakeGcs()
    fs.write("bkt/ds/a/f", b"0123456789")
    store = FsspecObjectStore(parse_source("gs://bkt/ds"), filesystem=fs)
    listing = await store.list_dir("a/")
    info = listing.files["f"]
    assert fs.infos == 0, "the listing entry carries the generation: no HEAD per file"
    assert (info.key, info.size) == ("a/f", 10) and info.mtime > 0
    assert await store.get_range("a/f", info.etag, 2, 5) == b"234"
    assert fs.reads == [f"bkt/ds/a/f#{info.etag}"]

    fs.write("bkt/ds/a/f", b"ABCDEFGHIJ")  # a new generation
    with pytest.raises(ObjectChangedError):
        await store.get_range("a/f", info.etag, 2, 5)
    new = await store.head("a/f")
    assert new.etag != info.etag and await store.get_range("a/f", new.etag, 0, 3) == b"ABC"
    del fs.objects["bkt/ds/a/f"]
    with pytest.raises(ObjectNotFoundError):
        await store.get_range("a/f", new.etag, 0, 3)


class FakeHub(AbstractFileSystem):
    """A synchronous filesystem whose files carry an LFS hash (as HfFileSystem's info)."""

    protocol = "hf"

    def __init__(self) -> None:
        super().__init__(skip_instance_cache=True)
        self.files: dict[str, bytes] = {}
        self.on_cat: Any = None

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        if path not in self.files:
            raise FileNotFoundError(path)
        digest = hashlib.sha256(self.files[path]).hexdigest()
        return {"name": path, "size": len(self.files[path]), "type": "file", "lfs": {"sha256": digest}}

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> bytes:
        data = self.files[path][start:end]
        if self.on_cat is not None:
            self.on_cat()
        return data


async def test_hub_reads_check_the_hash_after_the_bytes() -> None:
    fs = FakeHub()
    fs.files["datasets/org/name/train/x"] = b"first version"
    store = FsspecObjectStore(parse_source("hf://datasets/org/name/train"), filesystem=fs)
    info = await store.head("x")
    assert await store.get_range("x", info.etag, 0, 5) == b"first"

    def rewrite() -> None:  # a new commit lands while the bytes are on their way
        fs.files["datasets/org/name/train/x"] = b"second version"

    fs.on_cat = rewrite
    with pytest.raises(ObjectChangedError):
        await store.get_range("x", info.etag, 0, 5)
