"""Issue 24, item 7: options are matched by their full names only, an unknown one gets a "did you
mean", and a misspelt ``CACHEFS_*`` variable is named in a warning. No daemon is started."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cachefs.cli import fstab
from cachefs.cli import mount as cli_mount
from cachefs.cli.main import build_parser, main
from cachefs.cli.parsing import suggestions, unknown_message


@pytest.fixture(autouse=True)
def no_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the CLI tried to start a daemon or run a command")

    monkeypatch.setattr(cli_mount, "spawn_daemon", forbidden)
    monkeypatch.setattr(cli_mount, "run_foreground", forbidden)
    monkeypatch.setattr(subprocess, "Popen", forbidden)
    monkeypatch.setattr(subprocess, "run", forbidden)


def run(argv: list[str], capsys: pytest.CaptureFixture[str], environ: dict[str, str] | None = None) -> tuple[int, str]:
    try:
        code = main(argv, environ=environ or {})
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("extra", "meant"), [
    (["--ram", "1G"], "--ram-cache"),  # a prefix argparse used to complete
    (["--cache", "/tmp/x"], "--cache-dir"),  # mount-s3's option, silently --cache-dir before
    (["--ram-cahce", "1G"], "--ram-cache"),  # a typo
    (["--read"], "--read-only"),
])
def test_a_prefix_or_typo_of_a_mount_option_is_refused_with_a_suggestion(
        extra: list[str], meant: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["mount", "s3://bucket-b/p", str(tmp_path), *extra], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("cachefs: error: unrecognized arguments:"), err
    assert "did you mean" in err and meant in err, err
    assert "--ready-fd" not in err and "--read-timeout" not in err  # hidden options are never offered


def test_the_hidden_ready_fd_is_not_matched_by_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["mount", "s3://bucket-b/p", str(tmp_path), "--ready", "3"], capsys)
    assert code == 2 and "unrecognized arguments: --ready 3" in err and "--ready-fd" not in err, err


def test_subcommands_match_exactly_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["unmount", str(tmp_path), "--forc"], capsys)
    assert code == 2 and "did you mean --force" in err, err
    code, err = run(["cluster", "gc", "--cluster-cache", "s3://bucket-b", "--max-size", "1G", "--dry"], capsys)
    assert code == 2 and "did you mean --dry-run" in err and err.count("\n") == 1, err
    code, err = run(["stats", str(tmp_path), "--jsn"], capsys)
    assert code == 2 and "did you mean --json" in err, err


def test_every_parser_refuses_abbreviations() -> None:
    def walk(parser):  # noqa: ANN001, ANN202
        yield parser
        for action in parser._actions:
            for sub in getattr(action, "choices", None) or {}:
                if hasattr(action, "_name_parser_map"):
                    yield from walk(action.choices[sub])

    parsers = list(walk(build_parser()))
    assert len(parsers) > 8 and all(not p.allow_abbrev for p in parsers)
    assert not fstab._parser().allow_abbrev
    from csi_driver.main import build_parser as csi_parser

    assert not csi_parser().allow_abbrev


def test_suggestions_prefer_options_the_word_begins() -> None:
    options = ["--ram-cache", "--read-only", "--disk-cache", "--cache-dir"]
    assert suggestions("--ram", options) == ["--ram-cache"]
    assert suggestions("--ram-cache=1G", options) == []  # a known option is no typo
    assert suggestions("--dsik-cache=2G", options)[0] == "--disk-cache"
    assert suggestions("value", options) == []
    assert unknown_message(["--zzz"], options) == "unrecognized arguments: --zzz"


def test_a_misspelt_variable_is_named_in_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = {"CACHEFS_RAM_CACH": "1G", "CACHEFS_REQUIRE_FUSE": "1", "CACHEFS_LOG_LEVEL": "loud"}
    code, err = run(["mount", "s3://bucket-b/p", str(tmp_path)], capsys, env)
    lines = err.splitlines()
    assert lines[0] == ("cachefs: warning: CACHEFS_RAM_CACH is not a cachefs variable and is ignored; "
                        "did you mean CACHEFS_RAM_CACHE?"), err
    assert "CACHEFS_REQUIRE_FUSE" not in err  # known to the test suite
    assert code == 2 and lines[1].startswith("cachefs: error: CACHEFS_LOG_LEVEL")  # the bad value still refused
    code, err = run(["mount", "s3://bucket-b/p", str(tmp_path)], capsys, {"CACHEFS_XYZZY_PLUGH": "1",
                                                                          "CACHEFS_LOG_LEVEL": "loud"})
    assert "CACHEFS_XYZZY_PLUGH is not a cachefs variable" in err and "cachefs mount --help" in err, err


def test_help_has_examples_that_parse_and_names_the_variables() -> None:
    """Issue 24 (item 10): the help shows examples, each of which the parser accepts, and says
    that CACHEFS_* variables set the mount options."""
    import shlex

    from cachefs.cli.main import EPILOG
    from cachefs.cli.mount import MOUNT_EPILOG
    from cachefs.cli.main import subcommand_parser

    parser = build_parser()
    assert "CACHEFS_" in parser.format_help() and "examples:" in parser.format_help()
    mount_help = subcommand_parser(parser, "mount").format_help()
    assert "CACHEFS_" in mount_help and "examples:" in mount_help
    examples = [line.split("#")[0].strip() for text in (EPILOG, MOUNT_EPILOG)
                for line in text.splitlines() if "cachefs " in line and line.startswith("  ")]
    assert len(examples) >= 8
    for example in examples:
        words = [w for w in shlex.split(example) if not w.startswith("CACHEFS_")]
        assert words[0] == "cachefs"
        parser.parse_args(words[1:])  # exits 2 on an example that does not parse
