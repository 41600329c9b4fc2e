#!/usr/bin/env python3
"""Run the parts of ``make test`` one after the other and end with one summary line per part.

    scripts/testparts.py "pytest=python -m pytest ..." "import contracts=lint-imports" ...

Each ``NAME=COMMAND`` runs through ``/bin/sh`` with its output passed through as it comes; every
part runs even when one before it failed, so one failure does not hide another. The last lines are
the summary, one per part, in order: ``NAME: passed`` or ``NAME: FAILED (exit N)``, with the time it
took and the part's own last line (pytest's counts, mypy's and lint-imports' verdicts): the failed
part is named on its own line, right above make's error. The exit status is 0 when every part passed,
else 1. A part's output is read in chunks and written through unchanged, so pytest's progress dots
appear as they are printed; only its last non-empty line is kept for the summary.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

# The summary quotes at most this much of a part's last line (pytest's can list many counts).
MAX_QUOTED = 160
CHUNK = 4096


@dataclass
class Result:
    name: str
    status: int
    seconds: float
    last_line: str

    def line(self, width: int) -> str:
        verdict = "passed" if self.status == 0 else f"FAILED (exit {self.status})"
        tail = self.last_line if len(self.last_line) <= MAX_QUOTED else self.last_line[:MAX_QUOTED] + "..."
        said = f": {tail}" if tail else ""
        return f"{self.name + ':':<{width + 1}} {verdict} in {_duration(self.seconds)}{said}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}:{secs:02d}" if minutes else f"{seconds:.1f} s"


def _last_line(text: bytes) -> str:
    lines = [line.strip() for line in text.decode(errors="replace").replace("\r", "\n").splitlines()]
    lines = [line.strip("= ").strip() for line in lines if line.strip("= ").strip()]
    return lines[-1] if lines else ""


def run_part(name: str, command: str) -> Result:
    started = time.monotonic()
    tail = b""
    with subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        assert proc.stdout is not None
        out = sys.stdout.buffer
        while chunk := proc.stdout.read1(CHUNK):  # type: ignore[attr-defined]
            out.write(chunk)
            out.flush()
            tail = (tail + chunk)[-8 * CHUNK:]
        status = proc.wait()
    return Result(name, status, time.monotonic() - started, _last_line(tail))


def summary(results: list[Result]) -> list[str]:
    width = max(len(r.name) for r in results)
    return [r.line(width) for r in results]


def main(argv: list[str]) -> int:
    parts = []
    for arg in argv:
        name, sep, command = arg.partition("=")
        if not sep or not name or not command:
            print(f"testparts: expected NAME=COMMAND, got {arg!r}", file=sys.stderr)
            return 2
        parts.append((name, command))
    if not parts:
        print("testparts: no parts given", file=sys.stderr)
        return 2
    results = []
    for name, command in parts:
        print(f"\n=== {name}: {command}", flush=True)
        results.append(run_part(name, command))
    print(flush=True)
    for line in summary(results):
        print(line)
    sys.stdout.flush()
    return 0 if all(r.status == 0 for r in results) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
