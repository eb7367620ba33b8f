#!/usr/bin/env bash
# The experiment of docs/results.md (paper sections 5.5-5.6 on the CPU preset): OPD, EOPD,
# full_fkl (forward KL at every position) and random_fkl (forward KL at random positions, the gate's
# share) on the smollm2-cpu preset, seeds 0 1 2, one run after the other (each run uses the whole
# machine), then one report over every run. Per seed the variants share data, prompt order and
# sampling seeds; only loss.variant differs. About 13 minutes per run on an idle 2-core machine
# (12 runs: about 2.6 hours).
# Usage: [VARIANTS="eopd opd"] [OVERRIDES="train.iterations=48"] bash scripts/experiment.sh [SEED ...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
seeds=("${@:-0 1 2}")
variants=(${VARIANTS:-eopd opd full_fkl random_fkl})
out=runs/exp
mkdir -p "$out"
dirs=()
for seed in ${seeds[@]}; do
  for v in "${variants[@]}"; do
    start=$(date +%s)
    rc=0
    eopd run --config configs/smollm2-cpu.yaml "run_dir=$out/$v-s$seed" "seed=$seed" "loss.variant=$v" \
      ${OVERRIDES:-} --overwrite > "$out/$v-s$seed.log" 2>&1 || rc=$?
    echo "$v seed=$seed rc=$rc wall=$(( $(date +%s) - start ))s" | tee -a "$out/summary.txt"
    dirs+=("$out/$v-s$seed")
  done
done
eopd report "${dirs[@]}" --out "$out/report.html"
python -m eopd_trainer.experiment_table "${dirs[@]}" | tee "$out/table.md"
