"""The documentation: a README a newcomer reads in minutes, and a docs/ site that builds strictly.

`make test` also runs `mkdocs build --strict`; this test runs the same build so that a broken link,
a missing anchor or a page left out of the navigation fails under plain pytest too, and pins the
README's shape (the two commands first, short enough to read in five minutes).
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
README_MAX_LINES = 300  # issue 24: "a README a newcomer reads in five minutes"


def test_readme_opens_with_the_two_commands_and_stays_short() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < README_MAX_LINES
    first_block = re.search(r"```sh\n(.*?)```", text, re.S)
    assert first_block is not None
    commands = [ln.split("#")[0].strip() for ln in first_block.group(1).splitlines() if ln.strip()]
    assert commands == ["make demo", "make test"]


def test_every_docs_link_in_the_readme_names_a_file() -> None:
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(((?:docs|deploy)/[^)#]+)", text)
    assert targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, missing


def test_docs_build_strictly(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    result = subprocess.run([str(mkdocs), "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
