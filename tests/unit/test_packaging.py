"""How cachefs is packaged: its distribution name, the install instructions, the image's build context.

- The distribution name is our own: ``cachefs`` on PyPI is an unrelated project, so no shell block
  in the docs may tell a reader to ``pip install cachefs``; the README's "Install the tool only"
  gives the steps, names the system packages and says why the name was chosen.
- ``.dockerignore`` sends deploy/Dockerfile's COPY sources and nothing that a run leaves in the clone.
  Docker's matching rules are implemented here for the pattern syntax the file uses (``*``, ``**``,
  ``?``, ``!``; a pattern matching a directory excludes what is under it; the last match wins), and
  the test refuses syntax it does not implement, so the check cannot silently drift from Docker's.
"""

from __future__ import annotations

import re
import subprocess
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYPI_NAME_TAKEN_BY_ANOTHER_PROJECT = "cachefs"


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def section(markdown: str, heading: str) -> str:
    start = markdown.index(f"\n## {heading}\n")
    end = markdown.find("\n## ", start + 1)
    return markdown[start:end if end != -1 else None]


def shell_blocks(markdown: str) -> list[str]:
    return [m.group(2) for m in re.finditer(r"^([ \t]*)```(?:sh|bash|console)\n(.*?)^\1```", markdown, re.M | re.S)]


# ------------------------------------------------------------------------------------ distribution
def test_the_distribution_name_is_our_own_and_the_import_package_stays_cachefs() -> None:
    project = pyproject()["project"]
    name = project["name"]
    assert re.sub(r"[-_.]+", "-", name).lower() != PYPI_NAME_TAKEN_BY_ANOTHER_PROJECT
    assert name == "cachefs-fuse"
    assert project["scripts"]["cachefs"] == "cachefs.cli:main"
    assert "cachefs*" in pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]


def test_no_doc_tells_a_reader_to_pip_install_the_other_project() -> None:
    wrong = re.compile(rf"pip3? install\s+['\"]?{PYPI_NAME_TAKEN_BY_ANOTHER_PROJECT}(?![-\w.])")
    for doc in DOCS:
        for block in shell_blocks(doc.read_text()):
            assert not wrong.search(block), f"{doc.relative_to(ROOT)} installs PyPI's unrelated `cachefs`:\n{block}"


def test_readme_says_how_to_install_the_tool_only() -> None:
    text = section(README.read_text(), "Install")
    (block,) = shell_blocks(text)
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert any(c.startswith("apt-get install") and " fuse3 " in f"{c} " for c in commands), commands
    assert any(re.search(r"pip install (-c constraints.txt )?\.$", c) for c in commands), commands
    assert "cachefs --help" in commands
    # The name is explained where it is chosen.
    assert f"`{pyproject()['project']['name']}`" in text and "unrelated project" in text


# ------------------------------------------------------------------------------------ .dockerignore
def dockerignore_rules() -> list[tuple[re.Pattern[str], bool]]:
    """(pattern, excludes) in file order, as Docker's patternmatcher reads them."""
    rules = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = line[1:].strip() if include else line
        assert not set(pattern) & set("[]\\"), f"{raw!r}: the test does not implement this syntax"
        pattern = pattern.strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((re.compile(regex), not include))
    return rules


def sent_to_docker(path: str) -> bool:
    """Whether ``docker build`` from the repository root sends this file (a path relative to it)."""
    parts = path.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]  # the file and its parents
    excluded = False
    for regex, excludes in dockerignore_rules():
        if any(regex.fullmatch(candidate) for candidate in candidates):
            excluded = excludes
    return not excluded


def copy_sources() -> list[str]:
    sources = []
    for line in (ROOT / "deploy" / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            sources += [w.rstrip("/") for w in words[1:-1] if not w.startswith("--")]
    return sources


def test_every_dockerfile_copy_source_is_sent() -> None:
    sources = copy_sources()
    assert {"pyproject.toml", "README.md", "tiering", "cachefs", "csi_driver"} <= set(sources)
    for source in sources:
        path = ROOT / source
        files = [path] if path.is_file() else [p for p in path.rglob("*.py") if "__pycache__" not in p.parts]
        assert files, source
        for file in files:
            assert sent_to_docker(file.relative_to(ROOT).as_posix()), f"{file.relative_to(ROOT)} is not sent"


@pytest.mark.parametrize("path", [
    ".venv/bin/python", ".venv/lib/python3.11/site-packages/x.py", ".demo/data/a.bin",
    "bench-results/results.json", ".git/HEAD", ".pytest_cache/v/x", ".hypothesis/examples/x",
    "build/lib/cachefs/fs.py", "dist/cachefs_fuse-0.1.0.whl", "cachefs_fuse.egg-info/PKG-INFO",
    "cachefs/__pycache__/fs.cpython-311.pyc", "tiering/writeback/__pycache__/x.pyc", "cachefs/fs.pyc",
    "tests/unit/test_packaging.py", "benchmarks/bench.py",
])
def test_what_a_run_leaves_in_the_clone_is_not_sent(path: str) -> None:
    assert not sent_to_docker(path)


def test_everything_git_ignores_docker_ignores_too() -> None:
    for raw in (ROOT / ".gitignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith(("#", "!")):
            continue
        example = pattern.strip("/").replace("*", "x") + ("/file" if pattern.endswith("/") else "")
        assert not sent_to_docker(example), f".gitignore's {pattern} ({example}) would be sent"
        if not pattern.startswith("/"):  # gitignore matches it at any depth
            assert not sent_to_docker(f"cachefs/{example}"), f".gitignore's {pattern} under cachefs/ would be sent"


def test_the_matcher_follows_dockers_rules() -> None:
    # `*` stays within one path segment, a matched directory takes its files with it, and a later
    # `!` pattern wins over an earlier one: the three rules the file relies on.
    assert not sent_to_docker("docs")
    assert not sent_to_docker("docs/benchmarks.md")
    assert sent_to_docker("cachefs/fs.py") and sent_to_docker("pyproject.toml")


# ------------------------------------------------------------------------------------ extras (issue 24, item 8)
KUBERNETES_STACK = {"kubernetes": "kubernetes", "kopf": "kopf", "grpcio": "grpc", "protobuf": "google.protobuf"}
# Run in a child interpreter: every module of the Kubernetes stack refuses to import, as on a host
# where only `pip install .` ran.
BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Blocker())
"""


def _requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def test_the_tool_installs_without_the_kubernetes_stack_and_extras_add_it() -> None:
    project = pyproject()["project"]
    base = {_requirement_name(r) for r in project["dependencies"]}
    assert not base & set(KUBERNETES_STACK), base & set(KUBERNETES_STACK)
    extras = project["optional-dependencies"]
    csi = {_requirement_name(r) for r in extras["csi"]}
    operator = {_requirement_name(r) for r in extras["operator"]}
    assert {"grpcio", "protobuf", "kubernetes"} <= csi and {"kopf", "kubernetes"} <= operator
    assert f"{project['name']}[csi,operator]" in extras["test"]  # the tests cover every part
    assert project["scripts"]["cachefs-csi"] == "csi_driver.entry:csi"
    assert project["scripts"]["cachefs-operator"] == "csi_driver.entry:operator"
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "pip install --no-cache-dir -c constraints.txt '.[csi,operator]'" in dockerfile  # the image has every part


def _without_kubernetes(code: str) -> subprocess.CompletedProcess[str]:
    import sys

    script = BLOCKER.format(blocked=tuple(KUBERNETES_STACK.values())) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_the_tool_runs_without_the_kubernetes_stack() -> None:
    result = _without_kubernetes("""
        import contextlib, io, sys
        import cachefs.daemon.main, cachefs.cli.fstab, csi_driver.flex  # the daemon, mount(8) and FlexVolume
        from cachefs.cli.main import main
        for argv in (["--help"], ["mount", "--help"], ["prefetch", "--help"], ["stats", "--help"]):
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
                main(argv)
            assert "usage: cachefs" in out.getvalue(), argv
        assert not [m for m in sys.modules if m.split(".")[0] in ("kubernetes", "kopf", "grpc")]
        print("fine")
    """)
    assert result.returncode == 0 and result.stdout.strip() == "fine", result.stderr


@pytest.mark.parametrize(("entry", "extra"), [("csi", "csi"), ("operator", "operator")])
def test_a_kubernetes_entry_point_without_its_extra_names_it_in_one_line(entry: str, extra: str) -> None:
    result = _without_kubernetes(f"""
        from csi_driver.entry import {entry}
        {entry}(["--help"])
    """)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"pip install 'cachefs-fuse[{extra}]'" in result.stderr and f"[{extra}] extra" in result.stderr


# ------------------------------------------------------------------------------------ constraints
def test_constraints_pin_every_dependency_inside_pyproject_ranges_and_setup_and_the_image_use_them() -> None:
    """constraints.txt (issue 28): what CI tested, used by `make setup` and the image. Each pin must
    satisfy the range pyproject.toml declares, or a fresh install would fail to resolve."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pins = {}
    for line in lines:
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt: {line!r} is not NAME==VERSION"
            pins[canonicalize_name(name)] = version
    project = pyproject()["project"]
    assert canonicalize_name(project["name"]) not in pins  # the project itself is never pinned
    extras = project["optional-dependencies"]
    for spec in [*project["dependencies"], *extras["test"], *extras["csi"], *extras["operator"]]:
        requirement = Requirement(spec)
        name = canonicalize_name(requirement.name)
        if name == canonicalize_name(project["name"]):
            continue  # [test] names the project's own extras
        assert name in pins, f"{requirement.name} is not pinned in constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (spec, pins[name])
    assert "pip install -q -c constraints.txt -e '.[test]'" in (ROOT / "scripts" / "setup.sh").read_text()
    assert "pip install --no-cache-dir -c constraints.txt '.[csi,operator]'" in (ROOT / "deploy" / "Dockerfile").read_text()
