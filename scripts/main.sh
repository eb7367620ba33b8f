#!/usr/bin/env bash
# The main job: distil SmolLM2-135M-Instruct into a pruned copy of itself on one machine, end to end
# (`eopd run --config configs/smollm2-cpu.yaml`: queue, teacher, rollout worker, learner, then the
# held-out evaluation and an HTML report). Extra args go to `eopd run` (e.g. train.iterations=4).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
# The queue: the Redis at $REDIS_URL if set, else eopd run starts redis-server on a free port.
if [ -z "${REDIS_URL:-}" ] && ! command -v redis-server >/dev/null; then
  echo "[main] installing redis-server (the run's queue)"
  if [ "$(id -u)" = 0 ]; then
    apt-get update -q && apt-get install -y -q redis-server
  elif command -v sudo >/dev/null; then
    sudo apt-get update -q && sudo apt-get install -y -q redis-server
  fi
fi
# A fresh run each time (--overwrite); `bash scripts/main.sh --resume` continues an interrupted one.
fresh=--overwrite
for arg in "$@"; do [ "$arg" = "--resume" ] && fresh=""; done
eopd run --config configs/smollm2-cpu.yaml $fresh "$@"
if [ -f runs/smollm2-cpu/eval.json ]; then eopd report runs/smollm2-cpu; fi
