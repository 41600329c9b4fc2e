"""The prefetch/snapshot/unpin/evict commands refuse bad input with one line, before asking a daemon."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cachefs.cli import prefetch as cli_prefetch
from cachefs.cli.main import build_parser, main
from cachefs.cli.mount import mount_settings
from cachefs.cli.prefetch import prefetch_body, report
from cachefs.client import UsageError


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def body(*argv: str, cwd: str = "/mnt/x") -> dict:
    args = parse("prefetch", "/mnt/x", *argv)
    return prefetch_body(args, "/mnt/x", cwd)


def test_paths_become_mount_relative() -> None:
    got = body("train", "/mnt/x/val/", "./a/../b")
    assert got["paths"] == ["train", "val", "b"]
    assert got["lease_s"] == cli_prefetch.JOB_LEASE_S and got["manifest"] == []
    assert body()["paths"] == [""]  # the whole mount


def test_paths_are_relative_to_the_working_directory() -> None:
    assert body("a.bin", "../val", cwd="/mnt/x/train")["paths"] == ["train/a.bin", "val"]
    assert body("x/train", cwd="/mnt")["paths"] == ["x/train"]  # from outside the mount: from its root
    # Typed in one's home, `cachefs prefetch /mnt/x train` means /mnt/x/train (issue 37, item 2).
    assert body("train", cwd="/home/u")["paths"] == ["train"]
    with pytest.raises(UsageError, match=r"^\.\./train is outside the mount /mnt/x$"):
        body("../train", cwd="/home/u")


def test_a_first_argument_inside_the_mount_is_warmed_with_everything_below_it() -> None:
    """`cachefs prefetch /mnt/x/train` (the README's example): the mount is found by walking up, and the
    directory named is warmed recursively, as a bare prefetch of the mountpoint warms the whole mount."""
    args = parse("prefetch", "/mnt/x/train")
    args.target = "/mnt/x/train"  # what _mountpoint sets once the mount is found
    got = prefetch_body(args, "/mnt/x", "/home/u")
    assert got["paths"] == ["train"] and got["recursive"] is True
    args = parse("prefetch", "/mnt/x/train", "/mnt/x/val")
    args.target = "/mnt/x/train"
    got = prefetch_body(args, "/mnt/x", "/home/u")
    assert got["paths"] == ["train", "val"] and got["recursive"] is False  # PATHs named: directories need -r


def test_a_bare_prefetch_warms_the_whole_mount_recursively() -> None:
    """``--help`` says "default: the whole mount"; without -r that used to be refused as a directory."""
    whole = body()
    assert whole["paths"] == [""] and whole["recursive"] is True
    assert body("train")["recursive"] is False  # a named directory still needs -r

def test_prefetch_help_says_what_a_bare_prefetch_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["prefetch", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: TARGET, recursively: the whole mount, recursively, for the mountpoint)" in text


@pytest.mark.parametrize("path", ["../../etc", "/etc/passwd", "/mnt/xy"])
def test_paths_outside_the_mount_are_refused(path: str) -> None:
    with pytest.raises(UsageError, match=r"is outside the mount /mnt/x$"):
        body(path)


def test_manifest_errors_name_the_file_and_line(tmp_path: Path) -> None:
    missing = tmp_path / "none.jsonl"
    with pytest.raises(UsageError, match=rf"^manifest {missing} does not exist$"):
        body("--manifest", str(missing))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"path": "a", "etag": "e", "size": 1}\n\n{"path": "b",\n')
    with pytest.raises(UsageError, match=rf"^manifest {bad} line 3: invalid JSON"):
        body("--manifest", str(bad))
    outside = tmp_path / "out.txt"
    outside.write_text("a\n../../etc/passwd\n")
    with pytest.raises(UsageError, match=rf"^manifest {outside} line 2: .* is outside the mount"):
        body("--manifest", str(outside))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(UsageError, match="lists no files"):
        body("--manifest", str(empty))
    good = tmp_path / "good.jsonl"
    good.write_text('{"path": "a/b", "etag": "\\"e\\"", "size": 3}\nplain/path\n')
    got = body("--manifest", str(good))
    assert got["manifest"] == [{"path": "a/b", "line": 1, "etag": '"e"', "size": 3}, {"path": "plain/path", "line": 2}]
    assert got["paths"] == []


def test_check_and_pin_together_are_refused() -> None:
    with pytest.raises(UsageError, match="do not go together"):
        body("--check", "--pin", "a")


def test_a_directory_that_is_not_a_mount(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["prefetch", str(tmp_path), "x"], ["snapshot", str(tmp_path)], ["unpin", str(tmp_path)],
                 ["evict", str(tmp_path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == f"cachefs: error: {tmp_path} is not inside a cachefs mount\n"
    missing = tmp_path / "nope"
    for argv in (["prefetch", str(missing)], ["stats", str(missing)], ["flush", str(missing)], ["evict", str(missing)]):
        assert main(argv) == 2
        assert capsys.readouterr().err == f"cachefs: error: {missing}: no such file or directory\n"


def test_parallel_is_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("0", "2000", "x"):
        with pytest.raises(SystemExit) as info:
            parse("prefetch", "/mnt/x", "--parallel", bad)
        assert info.value.code == 2
        assert capsys.readouterr().err.count("\n") == 1


def test_max_pinned_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def settings(value: str | None):
        extra = ["--max-pinned", value] if value is not None else []
        args = parse("mount", "s3://b-1/p", str(tmp_path), "--disk-cache", "10GiB", *extra)
        return mount_settings(args, {}).cache

    gib = 1024**3
    assert settings(None).pin_limit_bytes == 5 * gib
    assert settings("0.25").pin_limit_bytes == int(2.5 * gib)
    assert settings("30%").pin_limit_bytes == 3 * gib
    assert settings("2GiB").pin_limit_bytes == 2 * gib
    assert settings("0").pin_limit_bytes == 0
    with pytest.raises(UsageError, match="exceeds 85% of --disk-cache"):
        settings("0.9")
    for bad in ("7", "1.5", "-1", "lots"):
        with pytest.raises(SystemExit):
            parse("mount", "s3://b-1/p", str(tmp_path), "--max-pinned", bad)
        assert capsys.readouterr().err.startswith("cachefs: error: argument --max-pinned")


def doc(**fields) -> dict:
    base = {"state": "done", "error": None, "ok": True, "check": False, "pin": False, "files_total": 2,
            "files_done": 2, "files_cached": 2, "bytes_total": 10, "bytes_done": 10, "bytes_cached": 10,
            "bytes_fetched": 6, "bytes_skipped": 4, "failures": [], "failures_count": 0, "changed": [],
            "changed_count": 0, "not_cached": [], "not_cached_count": 0, "elapsed_s": 1.0, "rate_bytes_per_s": 6.0}
    return {**base, **fields}


def test_report_exit_codes_and_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert report(doc()) == 0
    out, err = capsys.readouterr()
    assert out.startswith("cachefs: prefetched 2 of 2 files") and out.count("\n") == 1 and err == ""
    assert report(doc(state="rejected", error="no such file or directory in the mount: x", ok=False)) == 2
    assert capsys.readouterr().err == "cachefs: error: no such file or directory in the mount: x\n"
    changed = [{"path": "a", "line": 4, "reason": "ETag differs", "expected_etag": '"1"', "etag": '"2"',
                "expected_size": 1, "size": 1}]
    assert report(doc(ok=False, changed=changed, changed_count=1, files_total=1, files_cached=1)) == 1
    err = capsys.readouterr().err
    assert 'changed since the manifest: a (manifest line 4: ETag differs, ETag was "1", now "2")' in err
    assert report(doc(check=True, ok=False, bytes_cached=5, files_cached=1, not_cached=["b"], not_cached_count=1)) == 1
    out, err = capsys.readouterr()
    assert out == "cachefs: 50.0% cached: 5 B of 10 B, 1 of 2 files complete\n"
    assert err == "cachefs: not cached: b\n"
    assert report(doc(state="failed", error="disk tier is down", ok=False)) == 1


def test_json_progress_prints_one_document_per_interval_then_the_caller_prints_the_last(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    states = iter([doc(state="running", bytes_done=i) for i in range(1, 6)] + [doc()])
    monkeypatch.setattr(cli_prefetch, "_request", lambda socket, route: next(states))
    monkeypatch.setattr(cli_prefetch.time, "sleep", lambda s: None)
    ticks = iter([0.0, 1.0, 2.0, 6.0, 7.0, 12.0, 13.0, 14.0])  # virtual clock: a line at 0, 6 and 12
    final = cli_prefetch._follow("sock", "j1", False, doc(state="resolving", bytes_done=0), lines=True,
                                 clock=lambda: next(ticks))
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["state"] for line in lines] == ["resolving", "running", "running"]
    assert final["state"] == "done"


def test_json_and_json_progress_together_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prefetch", str(tmp_path), "--json", "--json-progress"]) == 2
    assert "--json and --json-progress do not go together" in capsys.readouterr().err


def test_json_progress_report_prints_no_summary_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert report(doc(), quiet=True) == 0
    assert capsys.readouterr().out == ""
