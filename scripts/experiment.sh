#!/usr/bin/env bash
# The experiment of docs/results.md: OPD against EOPD on the smollm2-cpu preset with the same
# seeds (same data, prompt order and sampling seeds per seed), one run after the other (each run
# uses the whole machine), then one report over every run.
# Usage: [OVERRIDES="train.iterations=16 eval.max_new_tokens=64"] bash scripts/experiment.sh [SEED ...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
seeds=("${@:-0 1 2}")
out=runs/exp
mkdir -p "$out"
dirs=()
for seed in ${seeds[@]}; do
  for v in eopd opd; do
    start=$(date +%s)
    rc=0
    eopd run --config configs/smollm2-cpu.yaml "run_dir=$out/$v-s$seed" "seed=$seed" "loss.variant=$v" \
      ${OVERRIDES:-} --overwrite > "$out/$v-s$seed.log" 2>&1 || rc=$?
    echo "$v seed=$seed rc=$rc wall=$(( $(date +%s) - start ))s" | tee -a "$out/summary.txt"
    dirs+=("$out/$v-s$seed")
  done
done
eopd report "${dirs[@]}" --out "$out/report.html"
