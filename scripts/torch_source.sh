#!/usr/bin/env bash
# Prints the extra pip arguments for installing torch (used by bootstrap.sh and vllm_env.sh).
# On a host without an NVIDIA GPU, PyTorch's CPU wheel index is added, so a fresh CPU machine
# gets the ~200 MB CPU build rather than PyPI's default CUDA build (several GB of CUDA libraries).
# Unreachable (offline mirrors, air-gapped hosts) it is skipped after one quick retry and the
# configured indexes are used alone. EOPD_TORCH_INDEX_URL overrides it ("none": never add one).
set -euo pipefail
url="${EOPD_TORCH_INDEX_URL:-}"
if [ -z "$url" ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then url=none; else url=https://download.pytorch.org/whl/cpu; fi
fi
if [ "$url" != none ]; then
  echo "--extra-index-url $url --retries 1"
fi
