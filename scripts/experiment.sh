#!/usr/bin/env bash
# The experiment of docs/results.md (paper sections 5.5-5.6 on the CPU preset): EOPD, OPD,
# full_fkl (forward KL at every position) and random_fkl (forward KL at random positions, the gate's
# share) on the smollm2-cpu preset, seeds 0 1 2, one run after the other (each run uses the whole
# machine), then one report over every run and the tables of docs/results.md.
#
# Per seed the variants share data, prompt order and sampling seeds; only loss.variant differs.
# Order: the first two variants (EOPD and OPD) for every seed, then the others, so that a partial
# experiment answers the main question first. The evaluation samples 8 answers per prompt (Avg@8,
# Pass@k for k = 1, 2, 4, 8, as the paper). The teacher and the initial student are the same models
# in every run: the first run evaluates them (held-out and variants sets); the first variant's run of
# each seed evaluates its final student on both sets, every other run on the held-out set
# (EVAL_ALL=1: everything in every run; FINAL_ONLY=1: only the final student on the held-out set,
# when archived runs of the same preset and seeds have evaluated the rest; with FINAL_VARIANTS=1 too
# the final student on the variants set; VARIANTS_EVERY_RUN=1: every run's final student on both sets,
# the teacher and initial student in the first run only; the default for PRESET=smollm2-far, issue 35).
#
# Resumable across machines: with ARCHIVE=DIR each finished run's small files (run.yaml, eval*.json,
# train_metrics.jsonl, run_summary.json: what the report and the tables read) are copied to
# DIR/<variant>-s<seed>/, and a run already finished in OUT or archived in DIR is not run again.
# A run takes 10-25 minutes on 2 CPU cores (docs/results.md has the measured times).
# A finished run's checkpoints, weights/ and student-init/ (GBs a run) are deleted once it is evaluated:
# its results are in the small files; KEEP_CHECKPOINTS=1 keeps them (to resume or re-evaluate).
# DRY_RUN=1 prints the runs it would start.
# Variants: a loss.variant name (eopd opd full_fkl random_fkl opd_fkl entropy_bonus advantage_shaping
# eopd_topk_rkl kd grpo), or gkd<lambda> for GKD at that lambda (gkd0.5 gkd0.8 gkd1.0: the share of
# on-policy student samples; the rest teacher-generated), or <variant>+warmup<N> for N KD warm-up
# iterations first (e.g. eopd+warmup4). grpo samples GRPO_SAMPLES (default 8, the paper's) per prompt.
# Teacher modifiers (issue 32), after the variant and before +warmup: +privileged (the teacher sees
# the answer: teacher.prompt_template "{prompt}\nThe correct final answer is {answer}."), +self (the
# teacher is the student's own initial weights, given the answer), +routed (two teachers routed by the
# problem's kind: word problems, kind "more", to the teacher given the answer, the rest to the plain
# teacher; one teacher process), e.g. eopd+privileged, eopd+self, eopd+routed.
# PRESET=smollm2-far runs the far-student preset (issue 35, configs/smollm2-far.yaml) instead of smollm2-cpu;
# its student is built first when missing (scripts/far_student.py --build: the student of the archived choice,
# docs/results/far-student/choice.json, pruned and healed with KD again).
# Usage: [VARIANTS="eopd opd"] [OVERRIDES="train.iterations=48"] [OUT=runs/exp, smollm2-far: runs/exp-far]
#        [ARCHIVE=docs/results/runs; smollm2-far: a directory of its own, docs/results/runs-far]
#        [PRESET=smollm2-cpu] bash scripts/experiment.sh [SEED ...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
seeds=(${@:-0 1 2})
variants=(${VARIANTS:-eopd opd full_fkl random_fkl})
preset=${PRESET:-smollm2-cpu}
if [ "$preset" = smollm2-far ]; then out=${OUT:-runs/exp-far}; else out=${OUT:-runs/exp}; fi  # run names repeat across presets
archive=${ARCHIVE:-}
if [ "$preset" = smollm2-far ]; then variants_every_run=${VARIANTS_EVERY_RUN-1}; else variants_every_run=${VARIANTS_EVERY_RUN:-}; fi
mkdir -p "$out"
if [ "$preset" = smollm2-far ] && [ ! -f runs/far-student/student/config.json ] && [ -z "${DRY_RUN:-}" ]; then
  python scripts/far_student.py --build --out runs/far-student  # the archived choice's student, healed again
fi

finished() {  # a run whose training and evaluation completed
  [ -f "$1/eval.json" ] && [ -f "$1/run_summary.json" ] && python - "$1" <<'PY'
import json, sys
from pathlib import Path
s = json.loads((Path(sys.argv[1]) / "run_summary.json").read_text())
e = json.loads((Path(sys.argv[1]) / "eval.json").read_text())
last = (s.get("invocations") or [{}])[-1]
sys.exit(0 if last.get("outcome") == "completed" and "final" in e.get("models", {}) else 1)
PY
}

archive_run() {  # what the report and the tables read, a few hundred KB per run
  mkdir -p "$2" && cp "$1"/run.yaml "$1"/eval*.json "$1"/train_metrics.jsonl "$1"/run_summary.json "$2/"
}

prune_run() {  # a finished run's big files: checkpoints (with the HF export), weights/, student-init/
  rm -rf "$1/checkpoints" "$1/weights" "$1/student-init"
}

PRIVILEGED_TEMPLATE='{prompt}\nThe correct final answer is {answer}.'

variant_overrides() {  # a variant's name -> its key=value overrides, one per line (see the header)
  local v=$1 extra=() t
  if [[ $v == *+warmup* ]]; then extra+=("train.warmup_kd_iterations=${v##*+warmup}"); v=${v%%+warmup*}; fi
  t=$(printf '"%s"' "$PRIVILEGED_TEMPLATE")  # YAML double quotes: \n is a newline
  case $v in
    *+privileged) extra+=("teacher.prompt_template=$t"); v=${v%+privileged} ;;
    *+self) extra+=("teacher.model=smollm2-135m[drop=14]" "teacher.prompt_template=$t"); v=${v%+self} ;;
    *+routed) extra+=("teachers=[{name: hinted, model: smollm2-135m, prompt_template: $t}]" "route.field=kind"
                      "route.routes={more: hinted}"); v=${v%+routed} ;;
  esac
  case $v in
    gkd[0-9]*) printf '%s\n' "loss.variant=gkd" "loss.gkd_lambda=${v#gkd}" ;;
    grpo) printf '%s\n' "loss.variant=grpo" "rollout.n_samples=${GRPO_SAMPLES:-8}" ;;
    *) printf '%s\n' "loss.variant=$v" ;;
  esac
  if [ ${#extra[@]} -gt 0 ]; then printf '%s\n' "${extra[@]}"; fi
}

order=()
for group in "${variants[*]:0:2}" "${variants[*]:2}"; do
  for seed in "${seeds[@]}"; do
    for v in $group; do order+=("$v:$seed"); done
  done
done

dirs=()
for i in "${!order[@]}"; do
  v=${order[$i]%%:*} seed=${order[$i]##*:}
  name=$v-s$seed dir=$out/$v-s$seed
  dirs+=("$dir")
  if [ -n "$archive" ] && ! finished "$dir" && finished "$archive/$name"; then
    rm -rf "$dir" && mkdir -p "$dir" && cp -r "$archive/$name/." "$dir/"
  fi
  if finished "$dir"; then
    echo "$name: finished already ($dir)"
    if [ -n "$archive" ] && ! finished "$archive/$name"; then archive_run "$dir" "$archive/$name"; fi
    continue
  fi
  evals=(eval.n_samples=8)
  if [ -n "${FINAL_ONLY:-}" ]; then
    evals+=("eval.models=[final]")
    if [ -z "${FINAL_VARIANTS:-}" ]; then evals+=(eval.variants=false); fi
  elif [ -z "${EVAL_ALL:-}" ]; then
    if [ "$i" != 0 ]; then evals+=("eval.models=[final]"); fi
    if [ "$v" != "${variants[0]}" ] && [ -z "$variants_every_run" ]; then evals+=(eval.variants=false); fi
  fi
  mapfile -t loss < <(variant_overrides "$v")
  if [ -n "${DRY_RUN:-}" ]; then echo "would run: $name ${loss[*]} ${evals[*]}"; continue; fi
  start=$(date +%s)
  rc=0
  eopd run --config "configs/$preset.yaml" "run_dir=$dir" "seed=$seed" "${loss[@]}" \
    "${evals[@]}" ${OVERRIDES:-} --overwrite > "$out/$name.log" 2>&1 || rc=$?
  echo "$name rc=$rc wall=$(( $(date +%s) - start ))s" | tee -a "$out/summary.txt"
  if [ "$rc" = 0 ] && [ -n "$archive" ]; then archive_run "$dir" "$archive/$name"; fi
  if [ "$rc" = 0 ] && [ -z "${KEEP_CHECKPOINTS:-}" ]; then prune_run "$dir"; fi
done
if [ -n "${DRY_RUN:-}" ]; then exit 0; fi
done_dirs=()
for d in "${dirs[@]}"; do if finished "$d"; then done_dirs+=("$d"); fi; done
eopd report "${done_dirs[@]}" --out "$out/report.html"
python -m eopd_trainer.eval.experiment_figures "${done_dirs[@]}" --out "$out/figures" --prefix exp_
python -m eopd_trainer.eval.experiment_table "${done_dirs[@]}" --paired opd --paired eopd --json "$out/facts.json" | tee "$out/table.md"
