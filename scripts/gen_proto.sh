#!/usr/bin/env bash
# The one command that generates the gRPC/protobuf Python code from proto/ (output is git-ignored).
# `-I proto` makes the generated imports resolve as the package path `eopd.v1`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
out=services/common
"$PY" -m grpc_tools.protoc -I proto \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  proto/eopd/v1/*.proto
echo "generated: $(ls $out/eopd/v1/*_pb2*.py | tr '\n' ' ')"
