"""Issue 12's command-line conventions, without a mount: --version, usage on a bare command,
CACHEFS_* variables for every mount option, the mount.cachefs helper, stats --watch rates and
pipe-safe lines, the free-space and memory guard, --min-free-space in the disk tier, and the
cache-dir lock probe that keeps a refused second mount out of the live mount's log."""

from __future__ import annotations

import argparse
import fcntl
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cachefs import package_version
from cachefs.cli import environment, fstab
from cachefs.cli import mount as cli_mount
from cachefs.cli.main import build_parser, main, subcommand_parser
from cachefs.cli.resources import (
    DiskFit,
    check_resources,
    directory_bytes,
    disk_problem,
    fit_disk,
    mem_total_bytes,
    pending_writes,
    ram_problem,
)
from cachefs.cli.stats import plain_line, rates, watch_plain
from cachefs.client import UsageError
from cachefs.mounts import LOCK_FILENAME, cache_dir_holder
from tiering.blocks import BlockKey
from tiering.tiers.disk import DiskTier


KiB, MiB, GiB = 1024, 1024**2, 1024**3


@pytest.fixture(autouse=True)
def no_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the CLI tried to start a daemon or run a command")

    monkeypatch.setattr(cli_mount, "spawn_daemon", forbidden)
    monkeypatch.setattr(cli_mount, "run_foreground", forbidden)
    monkeypatch.setattr(subprocess, "Popen", forbidden)


# ---------------------------------------------------------------------------------------- basics
def test_version_and_bare_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"cachefs {package_version()}\n"
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: cachefs") and "mount" in err and "prefetch" in err


# ---------------------------------------------------------------------------------------- CACHEFS_*
def mount_args(argv: list[str], environ: dict[str, str]) -> argparse.Namespace:
    """What cachefs.cli.main does for `cachefs mount`: defaults deferred, parsed, environment applied."""
    parser = build_parser()
    mount_parser = subcommand_parser(parser, "mount")
    originals = environment.defer_defaults(mount_parser)
    args = parser.parse_args(["mount", "s3://bucket-b/p", "/mnt/x", *argv])
    environment.apply_environment(args, mount_parser, originals, environ)
    return args


def test_every_mount_option_has_a_variable_derived_from_its_name() -> None:
    mount_parser = subcommand_parser(build_parser(), "mount")
    names = dict(environment.options_with_env(mount_parser))
    options = {environment.long_option(a) for a in mount_parser._actions} - {None, "--help", "--ready-fd"}
    assert {environment.long_option(a) for a in names.values()} == options  # every one, generically
    assert {"CACHEFS_RAM_CACHE", "CACHEFS_READ_ONLY", "CACHEFS_MIN_FREE_SPACE", "CACHEFS_LOG_LEVEL"} <= set(names)
    assert "CACHEFS_READY_FD" not in names


def test_environment_sets_options_and_flags_win() -> None:
    env = {"CACHEFS_RAM_CACHE": "2GiB", "CACHEFS_READ_ONLY": "1", "CACHEFS_LOG_LEVEL": "debug",
           "CACHEFS_REQUIRE_FUSE": "1"}  # a variable naming no option is left alone
    args = mount_args([], env)
    assert args.ram_cache == 2 * GiB and args.read_only is True and args.log_level == "DEBUG"
    flagged = mount_args(["--ram-cache", "512MiB", "--log-level", "ERROR"], env)
    assert flagged.ram_cache == 512 * MiB and flagged.log_level == "ERROR"
    defaults = mount_args([], {"CACHEFS_READ_ONLY": "off", "CACHEFS_DISK_CACHE": ""})
    assert defaults.read_only is False and defaults.disk_cache == mount_args([], {}).disk_cache
    assert defaults.cache_dir is None and defaults.foreground is False


def test_direct_io_from_the_environment_and_from_fstab() -> None:
    assert mount_args([], {}).direct_io is False
    assert mount_args([], {"CACHEFS_DIRECT_IO": "true"}).direct_io is True
    assert mount_args([], {"CACHEFS_DIRECT_IO": "0"}).direct_io is False
    assert mount_args(["--direct-io"], {"CACHEFS_DIRECT_IO": "off"}).direct_io is True  # the flag wins
    # s3fs-fuse spells it -o direct_io; so does mount.cachefs.
    assert fstab.translate("s3://b/p", "/mnt/x", ["ro", "direct_io"]) == [
        "mount", "s3://b/p", "/mnt/x", "--read-only", "--direct-io"]


@pytest.mark.parametrize(("name", "value", "needle"), [
    ("CACHEFS_RAM_CACHE", "lots", "CACHEFS_RAM_CACHE: invalid size 'lots'"),
    ("CACHEFS_DIRECT_IO", "maybe", "CACHEFS_DIRECT_IO='maybe': expected 1, true"),
    ("CACHEFS_READ_ONLY", "maybe", "CACHEFS_READ_ONLY='maybe': expected 1, true"),
    ("CACHEFS_LOG_LEVEL", "loud", "CACHEFS_LOG_LEVEL='loud': expected one of DEBUG"),
    ("CACHEFS_FETCH_TIMEOUT", "-1", "CACHEFS_FETCH_TIMEOUT: invalid duration '-1'"),
])
def test_a_bad_variable_is_one_line_naming_it(name: str, value: str, needle: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["mount", "s3://bucket-b/p", str(tmp_path)], {name: value})
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("cachefs: error: ") and needle in err, err


def test_variables_of_other_commands_do_not_matter(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    main(["status", str(tmp_path / "x")], {"CACHEFS_RAM_CACHE": "lots"})
    assert "CACHEFS_RAM_CACHE" not in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- mount.cachefs
def test_fstab_options_become_mount_options() -> None:
    argv = fstab.translate("s3://bucket-b/p", "/mnt/x", ["_netdev", "nofail", "noauto", "x-systemd.automount",
                                                 "x-systemd.requires=network-online.target", "rw", "defaults",
                                                 "ro", "ram_cache=2GiB", "disk-cache=20GiB", "allow_other",
                                                 "log_level=DEBUG"])
    assert argv == ["mount", "s3://bucket-b/p", "/mnt/x", "--read-only", "--ram-cache", "2GiB", "--disk-cache", "20GiB",
                    "--allow-other", "--log-level", "DEBUG"]
    assert build_parser().parse_args(argv).ram_cache == 2 * GiB


@pytest.mark.parametrize(("option", "needle"), [
    ("bogus=1", "unknown mount option 'bogus'"),
    ("foreground", "unknown mount option 'foreground'"),
    ("ready_fd=3", "unknown mount option 'ready_fd'"),
    ("allow_other=yes", "'allow_other' takes no value"),
    ("ram_cache", "'ram_cache' needs a value"),
])
def test_fstab_bad_options_are_one_line(option: str, needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert fstab.main(["s3://bucket-b/p", "/mnt/x", "-o", f"_netdev,{option}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mount.cachefs: error: ") and needle in err, err


def test_fstab_fake_prints_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert fstab.main(["s3://bucket-b/p", "/mnt/x", "-n", "-f", "-o", "ro,_netdev", "-o", "max_fetches=8"]) == 0
    assert capsys.readouterr().out == "cachefs mount s3://bucket-b/p /mnt/x --read-only --max-fetches 8\n"


def test_fstab_runs_cachefs_mount(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[list[str]] = []
    monkeypatch.setattr(sys.modules["cachefs.cli.main"], "main", lambda argv, environ=None: seen.append(list(argv)) or 0)
    assert fstab.main(["s3://bucket-b/p", str(tmp_path), "-o", "ro"]) == 0
    assert seen == [["mount", "s3://bucket-b/p", str(tmp_path), "--read-only"]]


def test_the_helper_is_a_console_script() -> None:
    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert '"mount.cachefs" = "cachefs.cli.fstab:main"' in text


# ---------------------------------------------------------------------------------------- stats --watch
def doc(read: int, ram: int, disk: int, fetched: int, store_bytes: int) -> dict:
    return {"filesystem": {"read_bytes": read}, "blocks": {"ram_served": ram, "disk_served": disk, "fetched": fetched},
            "object_store": {"bytes_read": store_bytes}, "hit_ratio": 0.5,
            "tiers": {"ram": {"used_bytes": MiB, "capacity_bytes": GiB}}}


def test_rates_between_two_samples() -> None:
    r = rates(doc(0, 1, 1, 0, 0), doc(8 * MiB, 5, 3, 4, 4 * MiB), 2.0)
    assert r == {"read_bytes_per_s": 4 * MiB, "hits_per_s": 3.0, "misses_per_s": 2.0, "fetched_bytes_per_s": 2 * MiB}
    assert rates(doc(9, 9, 9, 9, 9), doc(0, 0, 0, 0, 0), 1.0)["hits_per_s"] == 0  # a restarted daemon
    assert rates(doc(0, 0, 0, 0, 0), doc(1, 1, 1, 1, 1), 0.0)["read_bytes_per_s"] == 0


class Pipe(io.StringIO):
    flushes = 0

    def flush(self) -> None:
        self.flushes += 1
        super().flush()


def test_watch_to_a_pipe_prints_plain_flushed_lines() -> None:
    samples = iter([doc(0, 0, 0, 0, 0), doc(4 * MiB, 2, 0, 1, MiB), doc(8 * MiB, 4, 0, 2, 2 * MiB)])
    ticks = iter([10.0, 11.0, 12.0])
    out = Pipe()
    watch_plain(lambda: next(samples), 1.0, out, as_json=False, clock=lambda: next(ticks), sleep=lambda s: None,
                samples=3)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and out.flushes == 3
    assert "\x1b" not in out.getvalue() and "\r" not in out.getvalue()
    assert "first sample" in lines[0]
    assert "read 4.0 MiB/s, hits 2.0/s, misses 1.0/s, fetched 1.0 MiB/s" in lines[1], lines[1]
    assert "ram 1.0 MiB/1.0 GiB" in lines[2] and "hit ratio 50.0%" in lines[2]
    assert plain_line(doc(0, 0, 0, 0, 0), None).endswith("hit ratio 50.0%")


def test_watch_json_is_one_document_per_line() -> None:
    samples = iter([doc(0, 0, 0, 0, 0), doc(MiB, 1, 0, 0, 0)])
    ticks = iter([0.0, 1.0])
    out = Pipe()
    watch_plain(lambda: next(samples), 1.0, out, as_json=True, clock=lambda: next(ticks), sleep=lambda s: None,
                samples=2)
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["rates"] is None and second["rates"]["read_bytes_per_s"] == MiB


# ---------------------------------------------------------------------------------------- resources
def test_a_disk_cache_that_cannot_fit_is_refused_with_both_figures(tmp_path: Path) -> None:
    used_calls: list[int] = []

    def used() -> int:
        used_calls.append(1)
        return 2 * GiB

    assert disk_problem(10 * GiB, 0, tmp_path, free_bytes=lambda p: 76 * GiB, used_bytes=used) is None
    assert used_calls == []  # plenty of room: the cache directory is not walked
    assert disk_problem(77 * GiB, 0, tmp_path, free_bytes=lambda p: 76 * GiB, used_bytes=used) is None  # 76 + 2
    problem = disk_problem(100 * 1024 * GiB, 0, tmp_path, free_bytes=lambda p: 76 * GiB, used_bytes=used)
    assert problem == (f"--disk-cache 100.0 TiB does not fit in {tmp_path}: its filesystem has 76.0 GiB free and "
                       f"the cache already holds 2.0 GiB there; give a smaller --disk-cache or another --cache-dir")
    kept = disk_problem(70 * GiB, 10 * GiB, tmp_path, free_bytes=lambda p: 76 * GiB, used_bytes=used)
    assert kept is not None and "--min-free-space keeps 10.0 GiB of it free" in kept
    assert disk_problem(0, 0, tmp_path, free_bytes=lambda p: 0, used_bytes=used) is None  # no disk tier


def test_a_ram_cache_beyond_memtotal_is_refused(tmp_path: Path) -> None:
    assert ram_problem(GiB, 24 * GiB) is None and ram_problem(100 * GiB, None) is None
    assert ram_problem(100 * 1024 * GiB, 24 * GiB) == ("--ram-cache 100.0 TiB is more than this machine's memory "
                                                       "(24.0 GiB MemTotal); give a smaller --ram-cache")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683656 kB\nMemFree:  1 kB\n")
    assert mem_total_bytes(meminfo) == 24683656 * 1024
    assert mem_total_bytes(tmp_path / "none") is None


def test_check_resources_measures_this_sources_cache_dir(tmp_path: Path) -> None:
    args = build_parser().parse_args(["mount", "s3://bucket-b/p", str(tmp_path / "mnt"), "--cache-dir", str(tmp_path / "c"),
                                      "--disk-cache", "8MiB", "--ram-cache", "8MiB"])
    settings = cli_mount.mount_settings(args, {})
    source_dir = settings.source_cache_dir()
    (source_dir / "blocks").mkdir(parents=True)
    (source_dir / "blocks" / "x.blk").write_bytes(b"x" * MiB)
    assert directory_bytes(source_dir) == MiB and directory_bytes(tmp_path / "missing") == 0
    free = lambda p: 7 * MiB  # noqa: E731
    assert check_resources(settings, free_bytes=free, mem_total=lambda: GiB) == DiskFit()  # 7 MiB free + 1 cached
    assert "does not fit" in (check_resources(settings, free_bytes=lambda p: 0, usage=lambda p: 0,
                                              mem_total=lambda: GiB).problem or "")
    assert "--ram-cache" in (check_resources(settings, free_bytes=free, mem_total=lambda: 4 * MiB).problem or "")


def test_a_disk_cache_that_does_not_fit_over_pending_writes_mounts_smaller_to_upload_them(tmp_path: Path) -> None:
    """Refused with nothing pending; with acknowledged writes waiting, the disk cache that fits (never
    below what is staged, nor below a block), and one line naming them (issue 38, finding 5)."""
    staging = tmp_path / "staging"
    (staging / "records").mkdir(parents=True)
    (staging / "data").mkdir()
    assert pending_writes(staging) == (0, 0) and pending_writes(tmp_path / "none") == (0, 0)
    refused = fit_disk(60 * MiB, 0, tmp_path, staging, block_size=MiB, free_bytes=lambda p: 0,
                       used_bytes=lambda: 24 * MiB)
    assert refused.problem and "does not fit" in refused.problem and refused.disk_bytes is None
    for i in range(3):
        (staging / "records" / f"{i}.rec").write_bytes(b"r")
        (staging / "data" / f"{i}.dat").write_bytes(b"d" * (8 * MiB))
    (staging / "records" / ".tmp-x").write_bytes(b"t")  # not a record
    assert pending_writes(staging) == (3, 24 * MiB)
    fit = fit_disk(60 * MiB, 0, tmp_path, staging, block_size=MiB, free_bytes=lambda p: 0,
                   used_bytes=lambda: 24 * MiB + 5)
    assert fit.problem is None and fit.disk_bytes == 24 * MiB
    assert fit.notice and "3 acknowledged change(s) (24.0 MiB staged)" in fit.notice and "\n" not in fit.notice
    roomier = fit_disk(60 * MiB, MiB, tmp_path, staging, block_size=MiB, free_bytes=lambda p: 10 * MiB + 7,
                       used_bytes=lambda: 24 * MiB)
    assert roomier.disk_bytes == 33 * MiB  # free + cached - min free, whole blocks
    tiny = fit_disk(60 * MiB, 0, tmp_path, staging, block_size=64 * MiB, free_bytes=lambda p: 0,
                    used_bytes=lambda: 24 * MiB)
    assert tiny.disk_bytes == 64 * MiB  # at least one block: the disk tier refuses less


def test_mount_refuses_a_disk_cache_larger_than_the_disk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    code = main(["mount", "s3://bucket-b/p", str(mnt), "--cache-dir", str(tmp_path / "c"), "--disk-cache", "100000TiB"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--disk-cache 100000.0 TiB does not fit in" in err, err


def test_min_free_space_option_reaches_the_settings(tmp_path: Path) -> None:
    args = build_parser().parse_args(["mount", "s3://bucket-b/p", str(tmp_path), "--min-free-space", "5GiB"])
    assert cli_mount.mount_settings(args, {}).cache.disk_min_free_bytes == 5 * GiB


# ---------------------------------------------------------------------------------------- --min-free-space
def key(i: int) -> BlockKey:
    return BlockKey("bucket/object", "e1", i)


def test_disk_tier_evicts_clean_blocks_to_keep_the_minimum_free(tmp_path: Path) -> None:
    free = {"bytes": 10 * MiB}

    def free_space() -> int:
        return free["bytes"]

    tier = DiskTier(tmp_path, 100 * MiB, min_free_bytes=4 * MiB, free_space=free_space)
    for i in range(4):
        assert tier.put(key(i), b"x" * MiB)
    assert len(tier) == 4 and tier.stats.evictions == 0  # 10 MiB free - 1 MiB > 4 MiB
    free["bytes"] = 4 * MiB + MiB // 2  # another program filled the disk
    assert tier.put(key(4), b"y" * MiB)
    assert tier.stats.evictions == 1 and tier.get(key(0)) is None  # the least recently used made room
    tier.pin([key(1), key(2), key(3), key(4)])
    free["bytes"] = MiB
    assert tier.put(key(5), b"z" * MiB) is False  # nothing evictable: the block is declined, not written
    assert tier.stats.rejected == 1 and tier.get(key(5)) is None
    assert tier.reserve_space(MiB) is True  # staged writes are bounded by the capacity, not this figure


def test_a_failing_free_space_probe_is_no_reason_to_miss(tmp_path: Path) -> None:
    def broken() -> int:
        raise OSError(5, "statvfs failed")

    tier = DiskTier(tmp_path, 10 * MiB, min_free_bytes=GiB, free_space=broken)
    assert tier.put(key(0), b"x" * 1000) and tier.get(key(0)) == b"x" * 1000


def test_negative_min_free_space_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="minimum free space must not be negative"):
        DiskTier(tmp_path, MiB, min_free_bytes=-1)


# ---------------------------------------------------------------------------------------- second mount
def test_cache_dir_holder_sees_a_held_lock_without_writing(tmp_path: Path) -> None:
    assert cache_dir_holder(tmp_path / "missing") is None
    (tmp_path / LOCK_FILENAME).write_text("4242")
    assert cache_dir_holder(tmp_path) is None
    with open(tmp_path / LOCK_FILENAME, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert cache_dir_holder(tmp_path) == "4242"
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILENAME]


def test_a_second_mount_of_a_held_source_is_refused_before_any_log(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    argv = ["mount", "s3://bucket-b/p", str(mnt), "--cache-dir", str(tmp_path / "c"), "--read-only"]
    settings = cli_mount.mount_settings(build_parser().parse_args(argv), {})
    source_dir = settings.source_cache_dir()
    source_dir.mkdir(parents=True)
    with open(source_dir / LOCK_FILENAME, "a+") as held:
        held.write("4242")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "s3://bucket-b/p is already mounted" in err and "(pid 4242)" in err, err
    assert not (source_dir / "daemon.log").exists()


def test_usage_error_type_is_shared() -> None:
    with pytest.raises(UsageError):
        fstab.translate("s3://bucket-b/p", "/mnt/x", ["nope"])


def test_the_readme_fstab_line_and_systemd_unit_translate() -> None:
    root = Path(__file__).parents[2]
    readme = root / "docs" / "configuration.md"
    [line] = [ln for ln in readme.read_text().splitlines() if ln.startswith("s3://") and " cachefs " in ln]
    source, mountpoint, fstype, options, _dump, _pass = line.split()
    assert fstype == "cachefs"
    argv = fstab.translate(source, mountpoint, options.split(","))
    assert build_parser().parse_args(argv).read_only is True
    unit = dict(ln.split("=", 1) for ln in (root / "docs/systemd/mnt-data.mount").read_text().splitlines()
                if "=" in ln and not ln.startswith("#"))
    assert unit["Type"] == "cachefs"
    assert build_parser().parse_args(fstab.translate(unit["What"], unit["Where"], unit["Options"].split(",")))


def test_stats_show_what_the_cache_saved() -> None:
    """``cachefs stats`` (table and plain lines) ends with the savings of the mount (issue 26)."""
    from cachefs.cli.stats import render_stats, savings_line

    stats = {**doc(0, 0, 0, 0, 0), "traffic": {
        "served_bytes": {"ram": 3 * MiB, "disk": MiB, "cluster": 2 * MiB, "source": 2 * MiB},
        "avoided_source_bytes": 6 * MiB, "avoided_source_requests": 12,
        "hit_ratios": {"local": 0.5, "cluster": 0.25, "source": 0.25}}}
    line = savings_line(stats)
    assert line == ("saved: 6.0 MiB and 12 requests did not reach the source (reads served: ram 3.0 MiB, "
                    "disk 1.0 MiB, cluster 2.0 MiB, source 2.0 MiB); of the bytes read, local 50.0%, cluster 25.0%, "
                    "source 25.0%")
    assert plain_line(stats, None).endswith(line)
    table = {**stats, "object_store": {"requests": 20, "bytes_read": 2 * MiB, "errors": 0},
             "tiers": {"ram": {**stats["tiers"]["ram"], "entries": 3, "hits": 6, "misses": 2, "evictions": 0,
                               "errors": 0}}}
    assert line in str(render_stats(table).caption)
    assert savings_line(doc(0, 0, 0, 0, 0)) is None  # a daemon without the section
