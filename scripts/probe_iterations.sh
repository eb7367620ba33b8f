#!/usr/bin/env bash
# How many training iterations the smollm2-cpu preset should run, measured on the TRAINING split
# (never on held-out): one run per seed, trained to each count in ITERS in turn (`--resume` with a
# larger train.iterations: the constant learning rate makes that the same run as one trained straight
# to the larger count), the final student evaluated after each on the first 64 training problems.
# Results: <out>/s<seed>/eval-train64.json (names it<N>), summarised at the end.
#   SEEDS="0 1" ITERS="24 32 40" bash scripts/probe_iterations.sh [out_dir]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/bootstrap.sh
OUT="$(realpath -m "${1:-runs/probe-iterations}")"
SEEDS="${SEEDS:-0}"
ITERS="${ITERS:-24 32 40}"
for seed in $SEEDS; do
  dir="$OUT/s$seed"
  first=1
  for it in $ITERS; do
    if [ "$first" = 1 ] && [ ! -f "$dir/run.json" ]; then
      eopd run --config configs/smollm2-cpu.yaml "run_dir=$dir" "seed=$seed" "train.iterations=$it" \
        eval.enabled=false checkpoint.every=8
    else
      eopd run --config configs/smollm2-cpu.yaml "run_dir=$dir" "seed=$seed" "train.iterations=$it" \
        eval.enabled=false checkpoint.every=8 --resume
    fi
    first=0
    head -n 64 "$dir/data/train.jsonl" > "$dir/train64.jsonl"
    [ "$it" = "$(echo $ITERS | cut -d' ' -f1)" ] && \
      eopd eval --run-dir "$dir" --model initial --name it0 --data "$dir/train64.jsonl" --set train64
    eopd eval --run-dir "$dir" --model final --name "it$it" --data "$dir/train64.jsonl" --set train64
  done
done
python - "$OUT" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("s*/eval-train64.json")):
    models = json.loads(f.read_text())["models"]
    print(f.parent.name, "  ".join(f"{name} avg {m['avg_at_k']:.3f} pass@4 {m['pass_at_k'].get('4', float('nan')):.3f}"
                                    for name, m in models.items()))
PY
