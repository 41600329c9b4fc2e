"""``make test`` ends with one summary line per part, the failed one named (issue 37, item 7): its
pytest summary used to sit 43 lines above a bare ``make: *** Error 1``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PARTS = ["pytest", "import contracts", "mypy", "docs"]


def test_the_parts_end_with_one_line_each_and_the_failure_named() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "testparts.py"),
         "pytest=echo ....F; echo '==== 1 failed, 4 passed in 2.00s ===='; exit 1",
         "import contracts=echo 'Contracts: 12 kept, 0 broken.'",
         "mypy=echo 'Success: no issues found in 143 source files'",
         "docs=true"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    lines = result.stdout.rstrip("\n").splitlines()[-4:]
    assert re.fullmatch(r"pytest: +FAILED \(exit 1\) in \d+\.\d s: 1 failed, 4 passed in 2\.00s", lines[0]), lines
    assert re.fullmatch(r"import contracts: passed in \d+\.\d s: Contracts: 12 kept, 0 broken\.", lines[1]), lines
    assert re.fullmatch(r"mypy: +passed in \d+\.\d s: Success: no issues found in 143 source files", lines[2]), lines
    assert re.fullmatch(r"docs: +passed in \d+\.\d s", lines[3]), lines
    assert "....F" in result.stdout  # each part's own output passes through


def test_every_part_runs_and_all_passing_exits_zero() -> None:
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "testparts.py"), "a=exit 2", "b=echo ran-b"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "ran-b" in result.stdout
    ok = subprocess.run([sys.executable, str(REPO / "scripts" / "testparts.py"), "a=true", "b=true"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.rstrip().splitlines()[-2:][0].startswith("a: passed")


def test_make_test_runs_the_four_parts_through_it() -> None:
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile[makefile.index("\ntest: setup"):makefile.index("\npytest: setup")]
    assert "scripts/testparts.py" in recipe
    assert re.findall(r'"([a-z ]+)=', recipe) == PARTS
