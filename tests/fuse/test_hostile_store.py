"""A real mount of a store that lists without end (issue 34): ``ls`` gets EIO, the daemon logs one line
naming the directory, and the mount stays usable. The server is ``tests/support/hostile_s3.py``.

Before the listing was bounded, the same ``ls`` sat in uninterruptible sleep while the daemon grew
(100 -> 340 MB in 4 minutes) for as long as the server kept answering.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest

from tests.support.hostile_s3 import ENVIRON, HostileS3

pytestmark = [pytest.mark.fuse, pytest.mark.timeout(120)]

LS_BOUND_S = 30.0  # the error comes at the second page, in milliseconds; the bound is for a loaded machine


def test_a_listing_with_the_same_token_forever_is_eio_with_one_log_line(mounter) -> None:
    with HostileS3("same-token") as server:
        m = mounter.mount("s3://hostile/", "--endpoint-url", server.endpoint_url, "--read-only",
                          env={**os.environ, **ENVIRON})
        started = time.monotonic()
        for _attempt in range(2):  # nothing of a failed listing is cached: the second ls lists again
            with pytest.raises(OSError) as caught:
                os.listdir(m.path)
            assert caught.value.errno == errno.EIO
        assert time.monotonic() - started < LS_BOUND_S
        assert server.pages <= 2 * 2 + 2  # two pages per listing (and the mount's own first LIST)
        log = next(Path(m.cache_dir).glob("*/daemon.log")).read_text()
        lines = [line for line in log.splitlines() if "continuation token a second time" in line]
        assert len(lines) == 2 and all("LIST s3://hostile/:" in line for line in lines), lines
        assert m.mounted
