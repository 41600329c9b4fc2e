"""The type check in ``make test`` catches what the tier Protocols declare.

A caller that misspells a tier member, or asks the RAM tier for what only the disk tier has, must
fail the build rather than silently turn a feature off (as ``getattr(tier, "pinned_bytes", None)``
did). This runs mypy, with the project's configuration, on a small module that uses the engine's
tiers correctly and wrongly, and checks that exactly the wrong lines are reported.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from mypy import api

ROOT = Path(__file__).resolve().parents[2]

SNIPPET = textwrap.dedent(
    """\
    from tiering.engine.blockcache import BlockCache


    def report(cache: BlockCache) -> dict[str, object]:
        out: dict[str, object] = {"ram_blocks": len(cache.ram.keys())}
        disk = cache.disk
        if disk is not None:
            out["pinned"] = disk.pinned_bytes()
            out["state"] = disk.health.state
            out["room"] = disk.capacity_bytes * disk.low_watermark - disk.reserved_space()
            out["typo"] = disk.pinned_byte()  # line 11: misspelt
            out["low"] = disk.low_watermak  # line 12: misspelt attribute
        out["ram_pins"] = cache.ram.pinned_bytes()  # line 13: only the disk tier pins
        out["maybe_none"] = cache.disk.touch  # line 14: the disk tier may be absent
        return out
    """
)


def test_mypy_reports_misspelt_and_undeclared_tier_members(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # mypy finds the packages from the working directory, as make test runs it
    module = tmp_path / "uses_tiers.py"
    module.write_text(SNIPPET)
    stdout, stderr, status = api.run(
        [
            "--config-file", str(ROOT / "pyproject.toml"),
            "--cache-dir", str(tmp_path / "mypy-cache"),
            "--follow-imports", "silent",  # the product packages are checked by make test itself
            "--no-error-summary",
            str(module),
        ]
    )
    assert stderr == ""
    lines = sorted(int(n) for n in re.findall(r"^.*?:(\d+): error:", stdout, re.MULTILINE))
    assert lines == [11, 12, 13, 14], stdout
    assert status == 1
    assert '"DiskBlockTier" has no attribute "pinned_byte"' in stdout
    assert '"DiskBlockTier" has no attribute "low_watermak"' in stdout
    assert '"BlockTier" has no attribute "pinned_bytes"' in stdout
    assert 'Item "None" of "DiskBlockTier | None" has no attribute "touch"' in stdout
