"""Issue 36, item 3: every workload in deploy/ runs its command with the image's own packages only.

The cluster-store bucket Job ran a Python script that imported boto3, a test dependency the image
never had: on a real cluster it failed on every install. The tests had run that command in the
development environment, which has boto3. Here each command of the cachefs image in deploy/ runs in
an environment installed as deploy/Dockerfile installs the image (``pip install -c constraints.txt
'.[csi,operator]'`` in a fresh virtualenv, nothing from the test extras), built once and cached under
/tmp by the hash of pyproject.toml and constraints.txt (editable, so it runs this checkout's code);
and the bucket Job's command creates its bucket in a real SeaweedFS.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "ghcr.io/cachefs/cachefs-csi"
# deploy/Dockerfile: ENTRYPOINT ["/usr/bin/tini", "--", "cachefs-csi"] (tini is not the point here).
ENTRYPOINT = ("cachefs-csi",)
BUILD_TIMEOUT_S = 900
RUN_TIMEOUT_S = 120


def image_venv() -> Path:
    """The image's environment, built on first use (about a minute) and reused while pyproject.toml,
    constraints.txt and the checkout's path stay the same; a lock keeps parallel workers to one build."""
    key = hashlib.sha256(b"".join((ROOT / name).read_bytes() for name in ("pyproject.toml", "constraints.txt"))
                         + str(ROOT).encode()).hexdigest()[:16]
    venv = Path(tempfile.gettempdir()) / f"cachefs-image-env-{key}"
    with open(f"{venv}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / "complete").exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=BUILD_TIMEOUT_S)
            result = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "-c", "constraints.txt", "-e",
                                     ".[csi,operator]"], cwd=ROOT, capture_output=True, text=True,
                                    timeout=BUILD_TIMEOUT_S)
            assert result.returncode == 0, f"installing the image's packages failed:\n{result.stderr[-3000:]}"
            (venv / "complete").write_text("")
    return venv


@pytest.fixture(scope="session")
def image_env() -> Path:
    return image_venv()


def image_containers() -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, container) of every container of the cachefs image in a workload under deploy/."""
    helm = ROOT / "deploy" / "helm"  # templates, generated from the manifests read here (scripts/helm_chart.py)
    for path in sorted(p for p in (ROOT / "deploy").rglob("*.yaml") if helm not in p.parents):
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict) or doc.get("kind") not in ("Deployment", "DaemonSet", "StatefulSet", "Job",
                                                                      "CronJob"):
                continue
            spec = doc["spec"]
            template = spec["jobTemplate"]["spec"]["template"] if doc["kind"] == "CronJob" else spec["template"]
            for container in template["spec"]["containers"] + template["spec"].get("initContainers", []):
                if container["image"].split(":")[0] == IMAGE:
                    yield f"{path.relative_to(ROOT)} {doc['kind']}/{doc['metadata']['name']}/{container['name']}", container


def argv_of(container: dict[str, Any]) -> list[str]:
    return list(container.get("command") or ENTRYPOINT) + list(container.get("args") or [])


def run_in_image(env_dir: Path, argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    program = env_dir / "bin" / argv[0]
    assert program.exists(), f"{argv[0]} is not a program of the image"
    base = {"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin", "HOME": "/", "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    return subprocess.run([str(program), *argv[1:]], capture_output=True, text=True, cwd="/", env={**base, **(env or {})},
                          timeout=RUN_TIMEOUT_S)


def test_the_image_environment_has_no_test_extras(image_env: Path) -> None:
    result = run_in_image(image_env, ["python", "-c", "import boto3"])
    assert result.returncode != 0 and "No module named 'boto3'" in result.stderr


def test_every_workload_of_the_image_starts_its_program_there(image_env: Path) -> None:
    found = list(image_containers())
    assert len(found) >= 4, found  # the node plugin, the controller, the operator, the bucket Job
    for where, container in found:
        argv = argv_of(container)
        if argv[0] == "python" and argv[1] == "-c":  # a script: what it imports must be in the image
            imports = "\n".join(line.strip() for line in argv[2].splitlines()
                                if line.strip().startswith(("import ", "from ")))
            result = run_in_image(image_env, ["python", "-c", imports])
        else:  # the program loads what it needs; --help proves it starts with the image's packages
            result = run_in_image(image_env, [argv[0], *[a for a in argv[1:] if not a.startswith("-")][:3], "--help"])
        assert result.returncode == 0, f"{where}: {' '.join(argv[:4])}...: {result.stderr[-800:]}"
    imports = "import csi_driver.main, csi_driver.operator.main, csi_driver.mountpods, cachefs.cli.main"
    result = run_in_image(image_env, ["python", "-c", imports])
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.s3
def test_the_bucket_job_creates_its_bucket_with_the_image_alone(image_env: Path, seaweed) -> None:
    (container,) = [c for where, c in image_containers() if "bucket-job.yaml" in where]
    argv = argv_of(container)
    bucket = f"cluster-{uuid.uuid4().hex[:10]}"
    argv[argv.index("--cluster-endpoint-url") + 1] = seaweed.endpoint_url
    argv[argv.index("--cluster-cache") + 1] = f"s3://{bucket}"
    # The Job's environment: the store's keys from its Secret, as the manifest maps them.
    keys = {"AWS_ACCESS_KEY_ID": seaweed.access_key, "AWS_SECRET_ACCESS_KEY": seaweed.secret_key}
    assert {e["name"] for e in container["env"] if "valueFrom" in e} == set(keys)
    for expected in ("created", "exists"):  # applying the component again is harmless
        result = run_in_image(image_env, argv, keys)
        assert result.returncode == 0 and f"bucket {bucket} {expected}" in result.stdout, result.stderr[-1500:]
    seaweed.client().head_bucket(Bucket=bucket)
    # A store that never answers: bounded, one line, non-zero.
    dead = [*argv]
    dead[dead.index("--cluster-endpoint-url") + 1] = "http://127.0.0.1:9"
    dead = [a for a in dead if not a.startswith(("--tries", "--interval"))] + ["--tries=2", "--interval=0"]
    result = run_in_image(image_env, dead, keys)
    assert result.returncode == 1 and "not created after 2 tries" in result.stderr, result.stderr[-800:]
