"""The benchmark's own logic, without timing: limits are the best engine, medians, ratios, the
"limit beaten" check, the quiet-machine warning, the round rotation, and how a summary is built.

Nothing here measures speed; the inputs are made-up samples. (The end-to-end runs are the smoke
tests beside this file.)
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import analysis, bench, engines, procstat, report

# -- analysis -------------------------------------------------------------------------------------


def test_median_ignores_missing_samples_and_is_none_without_any() -> None:
    assert analysis.median([3.0, None, 1.0, 2.0]) == 2.0
    assert analysis.median([4.0, 1.0]) == 2.5
    assert analysis.median([]) is None and analysis.median([None]) is None


def test_ratio_is_none_when_a_side_is_missing_or_zero() -> None:
    assert analysis.ratio(3.0, 4.0) == 0.75
    assert analysis.ratio(None, 4.0) is None and analysis.ratio(3.0, None) is None and analysis.ratio(3.0, 0) is None


def test_the_limit_is_the_fastest_engine_and_the_cpu_reference_the_cheapest() -> None:
    rates = {"aiohttp": 300.0, "boto3": 900.0, "obstore": 850.0, "awscrt": None}
    assert analysis.best_engine(rates) == ("boto3", 900.0)
    cpu = {"aiohttp": 2.5, "boto3": 0.6, "obstore": 0.65, "broken": 0.0}
    assert analysis.best_engine(cpu, higher_is_better=False) == ("boto3", 0.6)  # 0 is "not measured"
    assert analysis.best_engine({}) == (None, None)
    assert analysis.best_engine({"a": None}) == (None, None)


def test_a_tool_past_the_limit_beyond_noise_is_flagged_and_within_noise_is_not() -> None:
    tools = {"cachefs": 500.0, "rclone": 1000.0, "s3fs": 1200.0, "missing": None}
    beaten = analysis.limit_beaten(1000.0, tools)
    assert set(beaten) == {"s3fs"} and beaten["s3fs"] == pytest.approx(1.2)
    # Exactly at the noise bound is still "equal"; just past it is not.
    assert analysis.limit_beaten(1000.0, {"t": 1000.0 * analysis.LIMIT_NOISE}) == {}
    assert set(analysis.limit_beaten(1000.0, {"t": 1000.0 * analysis.LIMIT_NOISE + 1})) == {"t"}
    # A cost reference is a floor for the same work, not a bound: never "beaten"; no limit, no flag.
    assert analysis.limit_beaten(1.0, {"t": 0.1}, higher_is_better=False) == {}
    assert analysis.limit_beaten(None, tools) == {} and analysis.limit_beaten(0.0, tools) == {}


def test_quiet_warnings_name_each_reason_and_stay_silent_on_a_quiet_machine() -> None:
    assert analysis.quiet_warnings(1.9, 0.05, 2) == []
    load = analysis.quiet_warnings(2.5, 0.05, 2)
    assert len(load) == 1 and "load average 2.50" in load[0]
    busy = analysis.quiet_warnings(0.5, 0.45, 2)
    assert len(busy) == 1 and "45%" in busy[0]
    assert len(analysis.quiet_warnings(8.0, 0.9, 2)) == 2
    # The load bar scales with the cores.
    assert analysis.quiet_warnings(2.5, 0.0, 4) == []


def test_settle_waits_for_the_load_to_fall_to_the_bar_and_no_longer_than_its_bound() -> None:
    loads = iter([3.1, 2.6, 2.2, 1.9, 1.5])
    slept: list[float] = []
    assert analysis.settle(lambda: next(loads), slept.append, 2, max_s=45, poll_s=1) == 3
    assert slept == [1, 1, 1]
    slept.clear()  # a machine busy with others: the wait stops at its bound
    assert analysis.settle(lambda: 9.0, slept.append, 2, max_s=5, poll_s=1) == 5 and len(slept) == 5
    assert analysis.settle(lambda: 0.2, slept.append, 2) == 0  # quiet already: no wait


def test_rotation_puts_every_tool_first_once_in_as_many_rounds() -> None:
    tools = ["cachefs", "rclone", "s3fs"]
    orders = [analysis.rotation(tools, r) for r in range(3)]
    assert orders[0] == tools
    assert [o[0] for o in orders] == tools
    assert all(sorted(o) == sorted(tools) for o in orders)
    assert analysis.rotation(tools, 3) == tools and analysis.rotation([], 5) == []


def test_per_gib() -> None:
    assert analysis.per_gib(2.0, 2 * 1024**3) == 1.0
    assert analysis.per_gib(None, 10) is None and analysis.per_gib(1.0, 0) is None


# -- engines (no server) ----------------------------------------------------------------------------


def test_plan_splits_big_objects_into_parts_and_keeps_small_ones_whole() -> None:
    mib = engines.MiB
    parts = engines.plan([("big", 20 * mib), ("small", 100 * 1024), ("empty", 0)], 8 * mib)
    assert parts[:3] == [("big", 0, 8 * mib), ("big", 8 * mib, 16 * mib), ("big", 16 * mib, 20 * mib)]
    assert parts[3] == ("small", 0, 100 * 1024) and parts[4] == ("empty", 0, 0)


def test_engine_run_derived_figures_and_credentials_never_show_the_secret() -> None:
    run = engines.EngineRun("boto3", 2 * engines.GiB, 2.0, 1.0, 0.5, 256, 8, 8 * engines.MiB)
    assert run.mib_s == 1024.0 and run.cpu_s_per_gib == 0.5 and run.busiest_thread_s_per_gib == 0.25
    assert run.requests_s == 128.0 and run.to_json()["mib_s"] == 1024.0
    creds = engines.Credentials("AKIDEXAMPLE", "s3cr3t-value")
    assert "s3cr3t" not in repr(creds) and "AKIDEXAMPLE" not in repr(creds)


def test_an_unknown_engine_is_refused_by_name() -> None:
    assert "unknown engine" in (engines.unavailable_reason("curl") or "")
    with pytest.raises(engines.EngineUnavailable):
        engines.fetch("curl", "http://127.0.0.1:1", "b", [("k", 1)], engines.Credentials("a", "b"))


# -- procstat ---------------------------------------------------------------------------------------


def test_busiest_thread_is_the_largest_increase_and_a_new_thread_counts_from_zero() -> None:
    before = {(1, 1): 5.0, (1, 2): 1.0}
    after = {(1, 1): 5.5, (1, 2): 3.0, (1, 3): 1.5}
    assert procstat.busiest_thread_s(before, after) == 2.0
    assert procstat.busiest_thread_s({}, {}) == 0.0


def test_span_meter_charges_a_thread_that_exited_inside_the_span() -> None:
    meter = procstat.SpanMeter(os.getpid())

    def spin() -> None:
        end = procstat.process_cpu_s(os.getpid()) + 0.6
        while procstat.process_cpu_s(os.getpid()) < end:
            pass

    worker = threading.Thread(target=spin)
    worker.start()
    worker.join()
    span = meter.stop()
    # The worker is gone from /proc/self/task, but the sampler saw it working.
    assert span.cpu_s >= 0.5 and span.busiest_thread_s > 0


def test_quiet_sample_is_within_range() -> None:
    sample = procstat.quiet_sample(0.05, [os.getpid()])
    assert 0.0 <= sample.foreign_busy <= 1.0 and len(sample.loadavg) == 3 and sample.cpus >= 1


def test_evict_drops_the_pages_of_a_file_or_a_tree(tmp_path: Path) -> None:
    (tmp_path / "d" / "e").mkdir(parents=True)
    for name in ("a", "d/b", "d/e/c"):
        (tmp_path / name).write_bytes(b"x" * 4096)
    assert bench.evict(tmp_path) == 3
    assert bench.evict(tmp_path / "a") == 1


# -- the summary --------------------------------------------------------------------------------------


def make_bench(tmp_path: Path, argv: list[str]) -> tuple[bench.Bench, list[SimpleNamespace]]:
    args = bench.parse_args(argv)
    b = bench.Bench(args, server=None, cluster=None, work=tmp_path)  # type: ignore[arg-type]
    tools = [SimpleNamespace(name=n, version=lambda: "test") for n in args.tool_names]
    return b, tools


def engine_sample(run: int, mib_s: float, cpu: float, thread: float) -> dict[str, float]:
    return {"round": run, "mib_s": mib_s, "requests_s": mib_s / 8, "cpu_s_per_gib": cpu,
            "busiest_thread_s_per_gib": thread, "cpu_s": cpu, "requests": 128, "threads": 8, "part_size": 8 << 20}


def test_summary_takes_the_fastest_engine_as_the_limit_and_flags_a_tool_that_beats_it(tmp_path: Path) -> None:
    b, tools = make_bench(tmp_path, ["--tools", "cachefs,s3fs", "--rounds", "3"])
    b.engine_runs = {"big": {
        "aiohttp": [engine_sample(r, v, 2.5, 1.6) for r, v in ((1, 300.0), (2, 320.0), (3, 280.0))],
        "boto3": [engine_sample(r, v, 0.6, 0.2) for r, v in ((1, 400.0), (2, 900.0), (3, 950.0))],
    }}
    for r, (c, s) in enumerate(((500.0, 1100.0), (700.0, 1000.0), (600.0, 1200.0))):
        b.add("cachefs", "cold_read", r, c, procstat.Span(1.0, 0.5), 0.5)
        b.add("s3fs", "cold_read", r, s)
    b.rounds = [{"round": 1, "loadavg": [0.2, 0.2, 0.2], "foreign_busy": 0.0, "quiet": True, "warnings": []},
                {"round": 2, "loadavg": [3.0, 1.0, 0.5], "foreign_busy": 0.3, "quiet": False, "warnings": ["x"]}]
    result = report.summarise(b, tools, b.args, "now")  # type: ignore[arg-type]

    cold = result["figures"]["cold_read"]
    assert cold["limit_median"] == 900.0 and cold["limit_engine"] == "boto3"  # boto3's median, not its best round
    assert result["limits"]["raw_get"]["samples"] == [400.0, 900.0, 950.0]  # the best engine of each round
    assert result["limits"]["raw_get_cpu"]["median"] == 0.6 and result["limits"]["raw_get_thread"]["median"] == 0.2
    assert cold["tools"]["cachefs"]["median"] == 600.0
    assert cold["tools"]["cachefs"]["ratio_to_limit"] == pytest.approx(600 / 900)
    assert cold["tools"]["cachefs"]["cpu"] == 2.0 and cold["tools"]["cachefs"]["busiest_thread"] == 1.0  # per GiB
    assert cold["tools"]["cachefs"]["ratio_to_peers"]["s3fs"] == pytest.approx(600 / 1100)
    # s3fs's median 1100 is past 900 x 1.05: the limit is not one, and the run says so loudly.
    assert cold["limit_beaten"] == {"s3fs": pytest.approx(1100 / 900)}
    assert result["limit_beaten"] == [{"figure": "cold_read", "tool": "s3fs", "ratio": pytest.approx(1100 / 900),
                                       "limit": "raw_get"}]
    assert any(w.startswith("LIMIT BEATEN") and "s3fs" in w for w in result["warnings"])
    assert result["quiet"] is False
    md = report.markdown(result)
    assert "LIMIT BEATEN" in md and "the machine was not quiet" in md
    assert set(result["figures"]) == {f.key for f in report.FIGURES if not f.full_only}
    targets = {t["target"]: t for t in result["targets"]}
    assert targets["cold read >= 0.8x the fastest raw GET engine"]["status"] == "MISS"
    assert targets["daemon CPU, cold read <= 1.0 CPU-s/GiB"]["status"] == "MISS"  # 2.0 CPU-s/GiB
    assert targets["cluster-tier node >= 0.8x the cluster store's raw GET"]["status"] == "n/a"


def test_a_limit_within_reach_raises_no_alarm_and_a_quiet_run_no_warning(tmp_path: Path) -> None:
    b, tools = make_bench(tmp_path, ["--tools", "cachefs", "--rounds", "1"])
    b.engine_runs = {"big": {"obstore": [engine_sample(1, 1000.0, 0.6, 0.1)]}}
    b.add("cachefs", "cold_read", 0, 1020.0, procstat.Span(0.4, 0.1), 1.0)
    b.rounds = [{"round": 1, "loadavg": [0.1, 0.1, 0.1], "foreign_busy": 0.01, "quiet": True, "warnings": []}]
    result = report.summarise(b, tools, b.args, "now")  # type: ignore[arg-type]
    assert result["limit_beaten"] == [] and result["warnings"] == [] and result["quiet"] is True
    targets = {t["target"]: t["status"] for t in result["targets"]}
    assert targets["cold read >= 0.8x the fastest raw GET engine"] == "PASS"
    assert targets["daemon CPU, cold read <= 1.0 CPU-s/GiB"] == "PASS"
    assert targets["busiest daemon thread, cold read <= 0.25 CPU-s/GiB"] == "PASS"


def test_per_file_costs_are_in_milliseconds(tmp_path: Path) -> None:
    b, _tools = make_bench(tmp_path, ["--tools", "cachefs"])
    b.add("cachefs", "epoch_1r", 0, 300.0, procstat.Span(2.0, 1.0), 1000)
    sample = b.samples["cachefs"]["epoch_1r"][0]
    assert sample["cpu"] == 2.0 and sample["thread"] == 1.0 and sample["value"] == 300.0


def test_a_cold_file_is_checked_in_all_and_on_its_busiest_thread(tmp_path: Path) -> None:
    """Issue 35: the daemon's CPU per cold file (<= 0.5 ms) and the part of it on its busiest thread
    (<= 0.15 ms), both from the announced epoch."""
    b, tools = make_bench(tmp_path, ["--tools", "cachefs", "--rounds", "1"])
    b.add("cachefs", "epoch_1r_announced", 0, 500.0, procstat.Span(0.4, 0.2), 1000)  # 0.4 ms, 0.2 ms busiest
    b.rounds = [{"round": 1, "loadavg": [0.1, 0.1, 0.1], "foreign_busy": 0.01, "quiet": True, "warnings": []}]
    targets = {t["target"]: t for t in report.summarise(b, tools, b.args, "now")["targets"]}  # type: ignore[arg-type]
    assert targets["daemon CPU per cold file (announced epoch) <= 0.5 ms"]["status"] == "PASS"
    busiest = targets["busiest daemon thread per cold file (announced epoch) <= 0.15 ms"]
    assert busiest["status"] == "MISS" and busiest["measured"] == pytest.approx(0.2)


def test_the_store_and_the_reader_are_shown_beside_the_daemon_for_each_cold_epoch(tmp_path: Path) -> None:
    """Issue 35: where the S3 server's CPU binds a 2-core machine, the bench shows it: per file, the
    daemon's, the server's and the reader's CPU, and how many CPUs their sum kept busy."""
    b, tools = make_bench(tmp_path, ["--tools", "cachefs", "--rounds", "1"])
    # 1000 files at 500 files/s: daemon 1.0 s, server 0.8 s, reader 0.2 s over the epoch.
    b.add("cachefs", "epoch_1r_announced", 0, 500.0, procstat.Span(1.0, 0.3), 1000, {"store": 0.8, "reader": 0.2})
    b.add("cachefs", "epoch_1r", 0, 250.0, procstat.Span(2.0, 0.6), 1000)  # no server figure: no row
    b.rounds = [{"round": 1, "loadavg": [0.1, 0.1, 0.1], "foreign_busy": 0.01, "quiet": True, "warnings": []}]
    result = report.summarise(b, tools, b.args, "now")  # type: ignore[arg-type]
    announced = result["figures"]["epoch_1r_announced"]["tools"]["cachefs"]
    assert announced["store"] == pytest.approx(0.8) and announced["reader"] == pytest.approx(0.2)  # ms per file
    assert "store" not in result["figures"]["epoch_1r"]["tools"]["cachefs"]
    section = report.markdown(result).split("## Who pays for a cold small file")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| shuffled")]
    assert len(rows) == 1 and "order announced" in rows[0], section
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    # files/s, daemon, busiest, server, reader, all three (2.0 ms), CPUs busy (2.0 x 500 / 1000 = 1.0)
    assert cells[1:] == ["500.0", "1.00", "0.30", "0.80", "0.20", "2.00", f"1.00 of {result['machine']['cpus']}"]


def test_quick_and_full_sets_choose_their_defaults_and_bad_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    quick = bench.parse_args([])
    assert quick.set == "quick" and quick.files == bench.QUICK_DEFAULTS["files"] and quick.rounds >= 3
    assert quick.engine_names == list(engines.ENGINES)
    full = bench.parse_args(["--set", "full"])
    assert full.files == bench.FULL_DEFAULTS["files"]
    assert bench.parse_args(["--runs", "2"]).rounds == 2  # the old spelling still works
    for bad in (["--engines", "curl"], ["--tools", "nfs"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    assert "curl" in capsys.readouterr().err


def test_a_failing_job_is_its_error_text_and_the_others_still_run() -> None:
    # No server is needed: the first job is refused before any request (threads=0), the second has
    # nothing to fetch. One child runs both; the first's failure does not stop the second.
    creds = engines.Credentials("AKID", "never-in-a-message-0123456789")
    bad = engines.Job("http://127.0.0.1:1", "bucket", [("key", 1024)], creds, threads=0)
    empty = engines.Job("http://127.0.0.1:1", "bucket", [], creds)
    first, second = engines.measure_jobs("obstore", [bad, empty])
    assert isinstance(first, str) and first.startswith("obstore: ValueError") and "threads (0)" in first
    assert creds.secret_key not in first
    assert isinstance(second, engines.EngineRun) and second.bytes == 0 and second.requests == 0


def test_the_direct_io_variant_runs_the_large_file_only_and_has_targets_of_its_own(tmp_path: Path) -> None:
    from benchmarks.peers import TOOLS

    assert TOOLS["cachefs-direct-io"].big_file_only and not TOOLS["cachefs"].big_file_only
    b, tools = make_bench(tmp_path, ["--rounds", "1"])
    assert [t.name for t in tools] == ["cachefs", "cachefs-direct-io", "rclone", "s3fs"]  # the default set
    b.engine_runs = {"big": {"obstore": [engine_sample(1, 1000.0, 0.6, 0.1)]}}
    b.add("cachefs", "cold_read", 0, 400.0, procstat.Span(2.0, 1.2), 1.0)
    b.add("cachefs-direct-io", "cold_read", 0, 850.0, procstat.Span(0.9, 0.2), 1.0)
    b.rounds = [{"round": 1, "loadavg": [0.1, 0.1, 0.1], "foreign_busy": 0.01, "quiet": True, "warnings": []}]
    result = report.summarise(b, tools, b.args, "now")  # type: ignore[arg-type]
    targets = {t["target"]: t["status"] for t in result["targets"]}
    assert targets["cold read >= 0.8x the fastest raw GET engine"] == "MISS"
    assert targets["--direct-io: cold read >= 0.8x the fastest raw GET engine"] == "PASS"
    assert targets["--direct-io: daemon CPU, cold read <= 1.0 CPU-s/GiB"] == "PASS"
    assert targets["--direct-io: busiest daemon thread, cold read <= 0.25 CPU-s/GiB"] == "PASS"
    assert targets["--direct-io: disk-tier read >= 0.8x local-disk read"] == "n/a"
    md = report.markdown(result)
    assert "cachefs-direct-io" in md
