#!/usr/bin/env bash
# Regenerate the committed Python stubs (csi_pb2.py, csi_pb2.pyi, csi_pb2_grpc.py) from csi.proto
# with grpcio-tools (a test/dev extra; its version is pinned in pyproject.toml so that a fresh
# generation is byte-identical to the committed one: tests/csi/test_proto.py checks that).
#
#   csi_driver/proto/generate.sh            write the stubs next to csi.proto
#   csi_driver/proto/generate.sh OUT_DIR    write them to OUT_DIR instead (what the test does)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-$here}"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python=python3
mkdir -p "$out"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# Generate under the package path so the generated import lines name csi_driver.proto.csi_pb2.
"$python" -m grpc_tools.protoc \
  --proto_path="$root" \
  --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" \
  csi_driver/proto/csi.proto
for f in csi_pb2.py csi_pb2.pyi csi_pb2_grpc.py; do
  cp "$tmp/csi_driver/proto/$f" "$out/$f"
done
