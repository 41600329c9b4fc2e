"""The command line refuses bad input with one line on stderr, before any daemon is started."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.clusterkeys import write_key_file

from cachefs.cli import mount as cli_mount
from cachefs.cli.main import build_parser, main
from cachefs.cli.mount import mount_settings, preflight
from cachefs.client import UsageError
from tiering.settings import DEFAULT_BLOCK_SIZE


@pytest.fixture(autouse=True)
def no_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing in this file may start a daemon or run fusermount: make that fail loudly."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the CLI tried to start a daemon or run a command")

    monkeypatch.setattr(cli_mount, "spawn_daemon", forbidden)
    monkeypatch.setattr(cli_mount, "run_foreground", forbidden)
    monkeypatch.setattr(subprocess, "Popen", forbidden)
    monkeypatch.setattr(subprocess, "run", forbidden)


@pytest.fixture
def mnt(tmp_path: Path) -> Path:
    path = tmp_path / "mnt"
    path.mkdir()
    return path


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv, environ={})
    except SystemExit as exc:  # argparse errors leave through SystemExit
        code = exc.code
    out, err = capsys.readouterr()
    assert out == ""
    return code, err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("cachefs: error: ")
    for needle in needles:
        assert needle in err, err


def mount_args(source: str, mountpoint: Path, cache_dir: Path, *extra: str) -> list[str]:
    return ["mount", source, str(mountpoint), "--cache-dir", str(cache_dir), *extra]


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--ram-cache", "12XB"], ["--ram-cache", "'12XB'"]),
        (["--cluster-cache", "http://bucket"], ["--cluster-cache", "http"]),
        (["--cluster-cache", "file:///tmp/x"], ["--cluster-cache must be s3://"]),
        (["--cluster-cache", "s3://Bad_Bucket"], ["--cluster-cache", "Bad_Bucket"]),
        (["--cluster-cache", "s3://ok-bucket", "--cluster-endpoint-url", "ftp://x"], ["cluster endpoint URL"]),
        (["--cluster-endpoint-url", "http://x:1"], ["need --cluster-cache"]),
        (["--cluster-profile", "p"], ["need --cluster-cache"]),
        (["--cluster-cache", "s3://ok-bucket", "--cluster-timeout", "0"], ["cluster-timeout"]),
        (["--cluster-cache", "s3://ok-bucket", "--cluster-timeout", "40"], ["--cluster-timeout", "shorter than --fetch-timeout"]),
        (["--cluster-cache", "s3://ok-bucket"], ["--cluster-cache needs --cluster-key-file", "CACHEFS_CLUSTER_KEY_FILE"]),
        (["--cluster-cache", "s3://ok-bucket", "--cluster-key-file", "/nonexistent/cluster.key"],
         ["cannot read the cluster key file /nonexistent/cluster.key"]),
        (["--disk-cache", "lots"], ["--disk-cache", "'lots'"]),
        (["--readahead", "1.5B"], ["--readahead", "'1.5B'"]),
        (["--block-size", "4k"], ["--block-size 4.0 KiB is outside 64.0 KiB to 256.0 MiB"]),
        (["--block-size", "1GiB"], ["--block-size 1.0 GiB"]),
        (["--ram-cache", "64k", "--block-size", "1MiB"], ["--ram-cache 64.0 KiB is smaller than one block (--block-size 1.0 MiB)"]),
        (["--stats-addr", "nope"], ["--stats-addr", "'nope'"]),
        (["--stats-addr", "127.0.0.1:99999"], ["'127.0.0.1:99999'"]),
        (["--stats-addr", "127.0.0.1:"], ["--stats-addr"]),
        (["--fetch-timeout", "-1"], ["--fetch-timeout", "negative"]),
        (["--fetch-timeout", "0"], ["--fetch-timeout 0 must be more than 0"]),
        (["--fetch-timeout", "soon"], ["--fetch-timeout", "'soon'"]),
        (["--dir-ttl", "-5"], ["--dir-ttl", "negative"]),
        (["--attr-ttl", "100000"], ["attr-ttl"]),
        (["--max-fetches", "0"], ["--max-fetches 0 must be between 1 and 1024"]),
        (["--max-fetches", "many"], ["--max-fetches"]),
        (["--log-level", "LOUD"], ["--log-level"]),
        (["--endpoint-url", "ftp://host"], ["endpoint URL", "'ftp://host'"]),
        (["--no-such-flag"], ["--no-such-flag"]),
        (["--disk-cache", "0"], ["writable mount", "--disk-cache", "--read-only"]),
        (["--disk-cache", "1KiB"], ["--disk-cache 1.0 KiB is smaller than one block (--block-size 8.0 MiB)"]),
        (["--read-only", "--write-through"], ["--write-through", "writable"]),
        (["--upload-delay", "-1"], ["--upload-delay", "negative"]),
        (["--upload-delay", "99999"], ["--upload-delay 99999 must be between 0 and 3600 seconds"]),
        (["--max-uploads", "0"], ["--max-uploads 0"]),
        (["--dirty-wait", "7200"], ["--dirty-wait 7200"]),
        (["--rename-dir-limit", "-1"], ["rename-dir-limit"]),
    ],
)
def test_bad_mount_options(extra: list[str], needles: list[str], mnt: Path, cache_dir: Path, capsys) -> None:
    code, err = run(mount_args("s3://my-bucket", mnt, cache_dir, *extra), capsys)
    assert_one_line_error(code, err, *needles)


@pytest.mark.parametrize(
    ("source", "needles"),
    [
        ("gs://b", ["GCS bucket name 'b'"]),
        ("ftp://host/x", ["'ftp'", "version identity"]),
        ("nosuch://b", ["unsupported", "'nosuch'"]),
        ("http://x/p", ["end it with '/'"]),
        ("https://user:pw@x/", ["credentials"]),
        ("http://127.0.0.1:9/ds/", ["read-only", "--read-only"]),
        ("s3://A_B", ["bucket name 'A_B'"]),
        ("s3://ab", ["bucket name 'ab'"]),
        ("s3://", ["no bucket"]),
        ("bucket", ["no scheme"]),
        ("s3://bucket-1//x", ["'//'"]),
        ("file://relative/path", ["host"]),
    ],
)
def test_bad_sources(source: str, needles: list[str], mnt: Path, cache_dir: Path, capsys) -> None:
    code, err = run(mount_args(source, mnt, cache_dir), capsys)
    assert_one_line_error(code, err, *needles)


def test_missing_mountpoint_argument(capsys) -> None:
    code, err = run(["mount", "s3://my-bucket"], capsys)
    assert_one_line_error(code, err, "mountpoint")


def test_mountpoint_that_does_not_exist(tmp_path: Path, cache_dir: Path, capsys) -> None:
    missing = tmp_path / "nowhere"
    code, err = run(mount_args("s3://my-bucket", missing, cache_dir), capsys)
    assert_one_line_error(code, err, str(missing), "does not exist")


def test_mountpoint_not_empty(mnt: Path, cache_dir: Path, capsys) -> None:
    (mnt / "leftover").write_text("x")
    code, err = run(mount_args("s3://my-bucket", mnt, cache_dir), capsys)
    assert_one_line_error(code, err, str(mnt), "not empty")


def test_mountpoint_is_a_file(tmp_path: Path, cache_dir: Path, capsys) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    code, err = run(mount_args("s3://my-bucket", target, cache_dir), capsys)
    assert_one_line_error(code, err, str(target), "not a directory")


def test_cache_dir_that_cannot_be_created(tmp_path: Path, mnt: Path, capsys) -> None:
    blocker = tmp_path / "regular-file"
    blocker.write_text("x")
    bad = blocker / "cache"
    code, err = run(mount_args("s3://my-bucket", mnt, bad), capsys)
    assert_one_line_error(code, err, str(bad), "cannot be created")


def test_cache_dir_that_is_a_file(tmp_path: Path, mnt: Path, capsys) -> None:
    blocker = tmp_path / "regular-file"
    blocker.write_text("x")
    code, err = run(mount_args("s3://my-bucket", mnt, blocker), capsys)
    assert_one_line_error(code, err, str(blocker))


def test_stats_of_a_path_that_is_not_a_mount(tmp_path: Path, capsys) -> None:
    code, err = run(["stats", str(tmp_path)], capsys)
    assert_one_line_error(code, err, str(tmp_path), "is not inside a cachefs mount")
    code, err = run(["stats", "--json", str(tmp_path)], capsys)
    assert_one_line_error(code, err, "is not inside a cachefs mount")


def test_stats_of_a_mount_that_is_not_cachefs(capsys) -> None:
    code, err = run(["stats", "/proc"], capsys)
    assert_one_line_error(code, err, "not a cachefs mount")


def test_unmount_of_a_path_that_is_not_mounted(tmp_path: Path, capsys) -> None:
    code, err = run(["unmount", str(tmp_path)], capsys)
    assert_one_line_error(code, err, str(tmp_path), "not mounted")
    code, err = run(["umount", str(tmp_path / "missing")], capsys)
    assert_one_line_error(code, err, "not mounted")


def test_unmount_of_a_mount_that_is_not_cachefs(capsys) -> None:
    code, err = run(["unmount", "/proc"], capsys)
    assert_one_line_error(code, err, "not a cachefs mount")


def test_no_command(capsys) -> None:
    """Issue 12: a bare ``cachefs`` prints the usage (with the commands), exit 2 as argparse does."""
    code, err = run([], capsys)
    assert code == 2 and err.startswith("usage: cachefs") and "mount" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------ good input
def test_mount_settings_from_arguments(mnt: Path, cache_dir: Path) -> None:
    args = build_parser().parse_args(
        mount_args(
            "s3://my-bucket/train/", mnt, cache_dir,
            "--ram-cache", "2GiB", "--disk-cache", "100G", "--readahead", "0", "--max-fetches", "8",
            "--fetch-timeout", "2.5", "--dir-ttl", "0", "--attr-ttl", "1", "--stats-addr", ":9999",
        )
    )
    settings = mount_settings(args, {"AWS_ENDPOINT_URL": "http://127.0.0.1:8333"})
    assert settings.source == "s3://my-bucket/train/"
    assert settings.mountpoint == mnt and settings.mountpoint.is_absolute()
    assert settings.cache_dir == cache_dir
    assert settings.endpoint_url == "http://127.0.0.1:8333"
    assert settings.cache.ram_bytes == 2 * 1024**3
    assert settings.cache.disk_bytes == 100 * 1024**3
    assert settings.cache.block_size == DEFAULT_BLOCK_SIZE
    assert settings.cache.readahead_max_bytes == 0
    assert settings.cache.max_concurrent_fetches == 8
    assert settings.cache.fetch_timeout_s == 2.5
    assert settings.fs.dir_ttl_s == 0 and settings.fs.attr_ttl_s == 1 and not settings.fs.read_only
    assert settings.fs.file_mode == 0o644 and settings.fs.dir_mode == 0o755
    assert not settings.writeback.write_through and settings.writeback.upload_delay_s == 2
    assert settings.stats_addr == "127.0.0.1:9999"
    # An explicit flag wins over the environment.
    args = build_parser().parse_args(mount_args("s3://my-bucket", mnt, cache_dir, "--endpoint-url", "https://s3.example"))
    assert mount_settings(args, {"AWS_ENDPOINT_URL": "http://other"}).endpoint_url == "https://s3.example"


@pytest.mark.parametrize("source", ["http://127.0.0.1:9/ds/", "file:///srv/data"])
def test_aws_endpoint_url_in_the_environment_leaves_non_s3_sources_alone(source: str, mnt: Path,
                                                                          cache_dir: Path) -> None:
    """Issue 24, item 4: AWS_ENDPOINT_URL is for S3 clients; an http:// or file:// source ignores it."""
    args = build_parser().parse_args(mount_args(source, mnt, cache_dir, "--read-only"))
    settings = mount_settings(args, {"AWS_ENDPOINT_URL": "http://127.0.0.1:8333"})
    assert settings.endpoint_url is None
    preflight(settings)


def test_an_explicit_endpoint_url_with_a_non_s3_source_is_one_line(mnt: Path, cache_dir: Path, capsys) -> None:
    code, err = run(mount_args("file:///srv/data", mnt, cache_dir, "--read-only", "--endpoint-url",
                               "http://127.0.0.1:8333"), capsys)
    assert_one_line_error(code, err, "--endpoint-url", "s3://", "file://")


def test_preflight_accepts_good_settings_without_contacting_anything(mnt: Path, cache_dir: Path) -> None:
    args = build_parser().parse_args(mount_args("s3://my-bucket/prefix", mnt, cache_dir))
    preflight(mount_settings(args, {}))
    assert cache_dir.is_dir()  # created and probed
    # The probe file is gone; the source's own directory is made private (0700) before any log is opened.
    (source_dir,) = cache_dir.iterdir()
    assert source_dir.is_dir() and list(source_dir.iterdir()) == [] and source_dir.stat().st_mode & 0o777 == 0o700
    assert list(mnt.iterdir()) == []


def test_write_back_options(mnt: Path, cache_dir: Path) -> None:
    args = build_parser().parse_args(mount_args(
        "s3://my-bucket", mnt, cache_dir, "--write-through", "--upload-delay", "0.5", "--max-uploads", "9",
        "--dirty-wait", "3", "--rename-dir-limit", "12",
    ))
    settings = mount_settings(args, {})
    assert settings.writeback.write_through and settings.writeback.upload_delay_s == 0.5
    assert settings.writeback.max_uploads == 9 and settings.writeback.space_wait_s == 3
    assert settings.fs.rename_dir_limit == 12 and not settings.fs.read_only


def test_read_only_mount_settings(mnt: Path, cache_dir: Path) -> None:
    args = build_parser().parse_args(mount_args("s3://my-bucket", mnt, cache_dir, "--read-only", "--disk-cache", "0"))
    settings = mount_settings(args, {})
    assert settings.fs.read_only and settings.fs.file_mode == 0o444 and settings.fs.dir_mode == 0o555


def test_direct_io_is_off_unless_asked_and_works_on_both_kinds_of_mount(mnt: Path, cache_dir: Path) -> None:
    default = mount_settings(build_parser().parse_args(mount_args("s3://my-bucket", mnt, cache_dir)), {})
    assert default.fs.direct_io is False
    for extra in (["--direct-io"], ["--direct-io", "--read-only"]):
        settings = mount_settings(build_parser().parse_args(mount_args("s3://my-bucket", mnt, cache_dir, *extra)), {})
        assert settings.fs.direct_io is True and settings.fs.read_only is ("--read-only" in extra)


def test_flush_and_status_of_a_path_that_is_not_a_mount(tmp_path: Path, capsys) -> None:
    code, err = run(["flush", str(tmp_path)], capsys)
    assert_one_line_error(code, err, "is not inside a cachefs mount")
    code, err = run(["status", str(tmp_path)], capsys)
    assert_one_line_error(code, err, "not inside a cachefs mount")
    code, err = run(["status", str(tmp_path / "x")], capsys)  # a missing path says so (issue 37, item 2)
    assert_one_line_error(code, err, f"{tmp_path / 'x'}: no such file or directory")


def test_flush_timeout_must_be_a_duration(tmp_path: Path, capsys) -> None:
    code, err = run(["flush", str(tmp_path), "--timeout", "soon"], capsys)
    assert code == 2 and "--timeout" in err


def test_cluster_options_become_typed_settings(mnt: Path, cache_dir: Path, tmp_path: Path) -> None:
    parser = build_parser()
    key_file = write_key_file(tmp_path)
    args = parser.parse_args(mount_args("s3://src", mnt, cache_dir, "--cluster-cache", "s3://shared/cache",
                                        "--cluster-endpoint-url", "http://seaweed:8333", "--cluster-profile", "cl",
                                        "--cluster-timeout", "2", "--cluster-key-file", str(key_file)))
    settings = mount_settings(args, {"AWS_ACCESS_KEY_ID": "source-key", "AWS_SECRET_ACCESS_KEY": "s"})
    cluster = settings.cluster
    assert cluster is not None and cluster.key_file == key_file
    assert (cluster.url, cluster.endpoint_url, cluster.profile, cluster.timeout_s) == (
        "s3://shared/cache", "http://seaweed:8333", "cl", 2.0)
    env = cluster.environ({"AWS_ACCESS_KEY_ID": "source-key", "AWS_SECRET_ACCESS_KEY": "s", "HOME": "/h"})
    assert env == {"AWS_PROFILE": "cl", "HOME": "/h"}  # the profile's keys, not the source's


def test_every_endpoint_setting_botocore_honours_is_in_the_source_identity(mnt: Path, cache_dir: Path,
                                                                            tmp_path: Path) -> None:
    """Issue 34: AWS_ENDPOINT_URL_S3 steered botocore but not the identity (cache directory, cluster-tier
    keys), so another server's data was cached and shared as the AWS bucket's."""
    from cachefs.settings import source_hash

    args = build_parser().parse_args(mount_args("s3://my-bucket/train/", mnt, cache_dir))
    base = {"AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def endpoint(**env: str) -> str | None:
        settings = mount_settings(args, {**base, **env})
        assert settings.source_label() == source_hash("s3://my-bucket/train/", settings.endpoint_url)
        return settings.endpoint_url

    assert endpoint() is None
    assert endpoint(AWS_ENDPOINT_URL_S3="http://s3-only:1") == "http://s3-only:1"
    assert endpoint(AWS_ENDPOINT_URL="http://all:2", AWS_ENDPOINT_URL_S3="http://s3-only:1") == "http://s3-only:1"
    assert endpoint(AWS_ENDPOINT_URL="http://all:2") == "http://all:2"
    assert endpoint(AWS_ENDPOINT_URL="http://all:2", AWS_IGNORE_CONFIGURED_ENDPOINT_URLS="true") is None
    config = tmp_path / "config"
    config.write_text("[default]\nendpoint_url = http://from-profile:3\n")
    assert endpoint(AWS_CONFIG_FILE=str(config)) == "http://from-profile:3"
    config.write_text("[default]\nendpoint_url = http://from-profile:3\nservices = local\n\n"
                      "[services local]\ns3 =\n  endpoint_url = http://from-services:4\n")
    assert endpoint(AWS_CONFIG_FILE=str(config)) == "http://from-services:4"
    assert endpoint(AWS_CONFIG_FILE=str(config), AWS_ENDPOINT_URL="http://all:2") == "http://all:2"
    config.write_text("[default]\nservices = missing\n")
    with pytest.raises(UsageError, match="services"):
        mount_settings(args, {**base, "AWS_CONFIG_FILE": str(config)})


def test_the_store_talks_to_the_endpoint_its_identity_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's client uses the resolved endpoint, and never one only the process's environment has."""
    import asyncio

    from tiering.objectstore import S3ObjectStore

    base = {"AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "AKIDTEST", "AWS_SECRET_ACCESS_KEY": "secret"}

    async def client_endpoint(environ: dict[str, str]) -> tuple[str | None, str]:
        store = S3ObjectStore("my-bucket", "", environ=environ)
        try:
            return store.endpoint_url, (await store._session()).meta.endpoint_url
        finally:
            await store.close()

    assert asyncio.run(client_endpoint({**base, "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9"})) == (
        "http://127.0.0.1:9", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # the process's, not the store's environ
    named, used = asyncio.run(client_endpoint(base))
    assert named is None and "amazonaws.com" in used


@pytest.mark.parametrize(("extra", "line"), [
    (["--fetch-timeout", "0"], "--fetch-timeout 0 must be more than 0 and at most 3600 seconds"),
    (["--ram-cache", "512"], "--ram-cache 512 B is smaller than one block (--block-size 8.0 MiB): give at least "
                             "8.0 MiB, or 0 to turn the RAM tier off"),
    (["--block-size", "512MiB"], "--block-size 512.0 MiB is outside 64.0 KiB to 256.0 MiB"),
    (["--max-fetches", "5000"], "--max-fetches 5000 must be between 1 and 1024"),
    (["--upload-max-delay", "100000"], "--upload-max-delay 100000 must be between 0 and 86400 seconds"),
    (["--upload-delay", "60", "--upload-max-delay", "10"], "--upload-max-delay 10 must not be shorter than "
                                                            "--upload-delay (60 seconds)"),
    (["--stop-timeout", "90000"], "--stop-timeout 90000 must be between 0 and 86400 seconds"),
])
def test_limit_errors_name_the_option_and_show_the_value_in_the_users_unit(extra: list[str], line: str, mnt: Path,
                                                                           cache_dir: Path, capsys) -> None:
    """Issue 37, item 9: "fetch timeout must be between 0 and 3600 seconds", "RAM cache (512 bytes) is
    smaller than one block (8388608 bytes)" named neither the option nor the value as typed."""
    code, err = run(mount_args("s3://my-bucket", mnt, cache_dir, *extra), capsys)
    assert code == 2 and err == f"cachefs: error: {line}\n"
