#!/usr/bin/env bash
# One-shot set-up for a fresh Debian/Ubuntu machine (run as root, or with sudo available):
# system packages for FUSE, then a virtualenv in .venv with cachefs and its test tools.
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v fusermount3 >/dev/null 2>&1 || need_apt+=(fuse3)
dpkg -s libfuse3-dev >/dev/null 2>&1 || need_apt+=(libfuse3-dev)
command -v pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)
command -v fio >/dev/null 2>&1 || need_apt+=(fio)
command -v gcc >/dev/null 2>&1 || need_apt+=(gcc)  # pyfuse3 has no wheel: it compiles
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || need_apt+=(python3)
# A venv with pip, and the headers of *this* interpreter (pyenv/uv builds carry their own).
if ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then need_apt+=(python3-venv); fi
if ! "$PY" -c 'import os, sysconfig; raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' >/dev/null 2>&1; then
  need_apt+=(python3-dev)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${need_apt[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.cachefs-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[test]'
  touch "$stamp"
fi
