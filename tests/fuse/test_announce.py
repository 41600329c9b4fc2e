"""Announced read orders on a real mount over SeaweedFS: fetched ahead, followed, bounded, refused.

Assertions use the daemon's counters (``/stats``: GETs, the ``announce`` section), never timings;
the one wait (for the prefetcher to fetch the announced window) polls ``/stats`` with a bound.
"""

from __future__ import annotations

import os
import random
import time
import uuid

import pytest

from cachefs import loader
from cachefs.client import ControlError, request_json
from tests.fuse.conftest import Mount, run_cli

KiB = 1024
FILES = 300
SIZE = 20 * KiB
# The prefetcher fetches 300 small files in well under a second on loopback; the bound is for a
# loaded CI machine, and the loop ends as soon as the counter is reached.
WARM_UP_BOUND_S = 60.0


def payload(key: str, size: int = SIZE) -> bytes:
    return random.Random(key).randbytes(size)


@pytest.fixture
def dataset(seaweed) -> tuple[str, dict[str, bytes]]:
    bucket = f"an-{uuid.uuid4().hex[:12]}"
    seaweed.make_bucket(bucket)
    data = {f"train/{i:04d}.jpg": payload(f"{bucket}/{i}") for i in range(FILES)}
    seaweed.put_many(bucket, [(f"ds/{k}", v) for k, v in data.items()])
    return bucket, data


def mount(seaweed, mounter, bucket: str) -> Mount:
    env = {**seaweed.env(), "AWS_ENDPOINT_URL": seaweed.endpoint_url}
    return mounter.mount(f"s3://{bucket}/ds", "--block-size", "64KiB", env=env)


def stats(m: Mount) -> dict:
    return request_json(os.getxattr(m.path, "user.cachefs.control").decode(), "/stats")


def wait_for(m: Mount, ready, what: str) -> dict:
    deadline = time.monotonic() + WARM_UP_BOUND_S
    while True:
        doc = stats(m)
        if ready(doc):
            return doc
        assert time.monotonic() < deadline, f"{what} not reached within {WARM_UP_BOUND_S} s: {doc['announce']}"
        time.sleep(0.05)


def test_an_announced_shuffled_epoch_reads_without_stalls(seaweed, mounter, dataset) -> None:
    bucket, data = dataset
    m = mount(seaweed, mounter, bucket)
    order = list(data)
    random.Random(7).shuffle(order)
    result = loader.announce(m.path, [m.path / k for k in order], stream="epoch0")
    assert result.ok and (result.files, result.bytes) == (FILES, FILES * SIZE)

    before = wait_for(m, lambda d: d["announce"]["prefetched_blocks"] >= FILES, "warm-up")
    assert before["announce"]["window_bytes"] <= before["announce"]["window_limit_bytes"]
    for key in order:
        assert (m.path / key).read_bytes() == data[key]
    after = stats(m)["announce"]
    assert after["stalls"] == 0 and after["order_hits"] == FILES
    # Every block came from the prefetcher: reading the epoch cost no GET of its own.
    assert stats(m)["object_store"]["get_requests"] == before["object_store"]["get_requests"]


def test_a_reader_that_diverges_reads_correct_bytes(seaweed, mounter, dataset) -> None:
    bucket, data = dataset
    m = mount(seaweed, mounter, bucket)
    keys = list(data)
    announced = keys[:200]
    loader.announce(m.path, [m.path / k for k in announced], stream="s")
    # Skips, repeats, a file never announced, backwards, then the reader stops.
    for i in [0, 1, 1, 50, 2, 299, 120, 120, 3, 199, 0]:
        assert (m.path / keys[i]).read_bytes() == data[keys[i]]
    doc = stats(m)["announce"]
    assert doc["window_bytes"] <= doc["window_limit_bytes"]
    assert doc["unmatched_opens"] >= 1  # the file never announced
    # A new epoch replaces the order; an empty one ends the stream.
    loader.announce(m.path, [m.path / k for k in reversed(announced)], stream="s")
    assert request_json(os.getxattr(m.path, "user.cachefs.control").decode(), "/announce")[0]["held"] == 200
    loader.announce(m.path, [], stream="s")
    assert stats(m)["announce"]["streams"] == 0 and stats(m)["announce"]["held_entries"] == 0


def test_bad_announcements_are_reported_or_refused_in_one_line(seaweed, mounter, dataset, tmp_path) -> None:
    bucket, data = dataset
    m = mount(seaweed, mounter, bucket)
    sock = os.getxattr(m.path, "user.cachefs.control").decode()
    first = next(iter(data))
    result = loader.announce(m.path, [m.path / first, m.path / "train/nope.jpg", "/etc/passwd", m.path / "train"],
                             stream="bad")
    assert (result.files, result.missing, result.invalid, result.directories) == (
        1, ["train/nope.jpg"], ["/etc/passwd"], ["train"])
    answer = request_json(sock, "/announce", method="POST",
                          body={"stream": "raw", "paths": ["/abs", "a/../b", first]})
    assert (answer["files"], answer["invalid_count"]) == (1, 2)
    # Over the per-request bound: refused whole, before anything is resolved, in one line.
    with pytest.raises(ControlError, match="announcement of 100001 files is over the limit of 100000 per request"):
        request_json(sock, "/announce", method="POST", body={"stream": "big", "paths": ["x"] * 100_001})
    for body, message in [({"paths": []}, "'stream' must be a non-empty string"),
                          ({"stream": "s", "paths": "x"}, "'paths' must be a list of strings")]:
        with pytest.raises(ControlError, match=message):
            request_json(sock, "/announce", method="POST", body=body)
    assert {s["stream"] for s in request_json(sock, "/announce")} == {"bad", "raw"}

    # The CLI: missing and outside paths listed on stderr, exit 1; --order with PATHs refused.
    order = tmp_path / "order.txt"
    order.write_text(f"{first}\ntrain/nope.jpg\n\n/etc/passwd\n")
    cli = run_cli("prefetch", str(m.path), "--order", str(order), env=m.env)
    assert cli.returncode == 1, cli
    assert cli.stdout.startswith("announced 1 files") and "stream 'cli'" in cli.stdout
    assert "missing: train/nope.jpg" in cli.stderr and "not a path in the mount: /etc/passwd" in cli.stderr
    refused = run_cli("prefetch", str(m.path), "x", "--order", str(order), env=m.env)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "--order does not go with PATH" in refused.stderr
