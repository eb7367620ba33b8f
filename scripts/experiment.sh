#!/usr/bin/env bash
# The experiment of docs/results.md (paper sections 5.5-5.6 on the CPU preset): OPD, EOPD,
# full_fkl (forward KL at every position) and random_fkl (forward KL at random positions, the gate's
# share) on the smollm2-cpu preset, seeds 0 1 2, one run after the other (each run uses the whole
# machine), then one report over every run and the tables of docs/results.md.
# Per seed the variants share data, prompt order and sampling seeds; only loss.variant differs.
# The evaluation samples 8 answers per prompt (Avg@8, Pass@k for k = 1, 2, 4, 8, as the paper).
# The teacher and the initial student are the same model for every variant of a seed: only the
# first variant of a seed evaluates them (and the variants set); the others evaluate their final
# student on the held-out set. About 17 minutes for the first variant of a seed and 9 for each other
# on an idle 2-core machine (12 runs: about 2 hours); EVAL_ALL=1 evaluates everything in every run.
# Usage: [VARIANTS="eopd opd"] [OVERRIDES="train.iterations=48"] [OUT=runs/exp] bash scripts/experiment.sh [SEED ...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
seeds=("${@:-0 1 2}")
variants=(${VARIANTS:-eopd opd full_fkl random_fkl})
out=${OUT:-runs/exp}
mkdir -p "$out"
dirs=()
for seed in ${seeds[@]}; do
  first=1
  for v in "${variants[@]}"; do
    evals=(eval.n_samples=8)
    if [ "$first" = 0 ] && [ -z "${EVAL_ALL:-}" ]; then evals+=("eval.models=[final]" eval.variants=false); fi
    first=0
    start=$(date +%s)
    rc=0
    eopd run --config configs/smollm2-cpu.yaml "run_dir=$out/$v-s$seed" "seed=$seed" "loss.variant=$v" \
      "${evals[@]}" ${OVERRIDES:-} --overwrite > "$out/$v-s$seed.log" 2>&1 || rc=$?
    echo "$v seed=$seed rc=$rc wall=$(( $(date +%s) - start ))s" | tee -a "$out/summary.txt"
    dirs+=("$out/$v-s$seed")
  done
done
eopd report "${dirs[@]}" --out "$out/report.html" --figures "$out/figures" --prefix exp-
python -m eopd_trainer.experiment_table "${dirs[@]}" --json "$out/facts.json" | tee "$out/table.md"
