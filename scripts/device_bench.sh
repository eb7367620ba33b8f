#!/usr/bin/env bash
# The GPU benchmarks on a lent device machine in one prepared command (docs/benchmarks.md, "On a lent
# GPU"): installs the carried wheelhouse beside the machine's own torch / transformers / numpy, runs
# bench_gpu_teacher and bench_gpu_trainer each under its own time limit (each writes its results after
# every part, so a part cut short loses only itself), and copies the results, the logs, nvidia-smi and
# docs/benchmarks.md to $OUT.
#
#   (here)   scripts/wheelhouse.sh --python 3.12 --platform manylinux_2_28_x86_64 --out build/wheelhouse-cp312 ...
#   (device) EOPD_COMMIT=<sha> bash scripts/device_bench.sh [TEACHER_S] [TRAINER_S]   (commit first: the device copy's .git can be stale)
#
# Environment: WHEELHOUSE (default build/wheelhouse-cp312), TEACHER_ARGS, TRAINER_ARGS (extra arguments of
# each benchmark; the defaults below fit both in about 9 minutes of an H200), OUT (required).
set -uo pipefail
: "${OUT:?set OUT to the folder the results go to}"
WH="${WHEELHOUSE:-build/wheelhouse-cp312}"
teacher_s="${1:-240}" trainer_s="${2:-240}"
export PYTHONUNBUFFERED=1
t0=$SECONDS
log() { echo "[device_bench $((SECONDS - t0)) s] $*"; }

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || log "no nvidia-smi"
# every carried wheel into a folder of its own, dependencies not resolved (pip in a venv over the system's
# site-packages did not see the image's numpy); the image's packages stay where they are
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/eopd-site "$WH"/*.whl || { log "install failed"; exit 3; }
export PYTHONPATH="/tmp/eopd-site${PYTHONPATH:+:$PYTHONPATH}"
PY=python3
log "installed; $($PY -c 'import torch, transformers, deepspeed; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "transformers", transformers.__version__, "deepspeed", deepspeed.__version__)' 2>&1 | tail -1)"

# shellcheck disable=SC2086
timeout -k 10 "$teacher_s" $PY -m bench.bench_gpu_teacher ${TEACHER_ARGS:---profiles auto --rounds 2} 2>&1 | tee "$OUT/gpu_teacher.log"
log "teacher benchmark: exit ${PIPESTATUS[0]}"
# shellcheck disable=SC2086
timeout -k 10 "$trainer_s" $PY -m bench.bench_gpu_trainer ${TRAINER_ARGS:---runs async:broadcast sync:auto --iterations 3 --batch 32} 2>&1 | tee "$OUT/gpu_trainer.log"
log "trainer benchmark: exit ${PIPESTATUS[0]}"
cp bench/results/gpu_teacher.json bench/results/gpu_trainer.json "$OUT/" 2>/dev/null
cp docs/benchmarks.md "$OUT/"
log "done"
