#!/usr/bin/env bash
# Prints the extra pip arguments for installing torch (used by bootstrap.sh and vllm_env.sh).
# On a host without an NVIDIA GPU, PyTorch's CPU wheel index is added, so a fresh CPU machine
# gets the ~200 MB CPU build rather than PyPI's default CUDA build (several GB of CUDA libraries).
# Unreachable (offline mirrors, air-gapped hosts: a 3 s connection probe) it is skipped and the
# configured indexes are used alone. EOPD_TORCH_INDEX_URL overrides it ("none": never add one).
set -euo pipefail
url="${EOPD_TORCH_INDEX_URL:-}"
if [ -z "$url" ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then url=none; else url=https://download.pytorch.org/whl/cpu; fi
fi
if [ "$url" != none ]; then
  PY="$(command -v python3.11 || command -v python3)"
  if "$PY" - "$url" <<'PYEOF' 2>/dev/null; then
import socket, sys, urllib.parse
u = urllib.parse.urlsplit(sys.argv[1])
if u.scheme == "file":
    sys.exit(0)
socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout=3).close()
PYEOF
    echo "--extra-index-url $url --retries 1"
  else
    echo "[bootstrap] $url is unreachable: installing torch from the configured pip indexes" >&2
  fi
fi
