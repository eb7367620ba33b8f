"""Aggregates finished runs into the markdown tables of docs/results.md: mean and spread over
seeds, per loss variant (its final student), with the teacher and the initial student (the same
models in every run: one row each, pooled over the runs that evaluated them), on every evaluated set.

    python -m eopd_trainer.eval.experiment_table runs/exp/eopd-s0 runs/exp/eopd-s1 ... [--json out.json]
        [--paired opd --paired eopd]

Runs are grouped by their loss (run.yaml's `loss.variant`, GKD's lambda and a KD warm-up named as
scripts/experiment.sh names them: `gkd0.8`, `eopd+warmup4`); the spread is the min-max range over the
group's runs. Columns: the headline Avg@k and Pass@k (k = 1, 2, 4, ..., n), strict and flexible
Avg@n, the share of response tokens with entropy >= 1 (student, and the teacher on the same
positions), FKL at teacher entropy >= tau, and, from `train_metrics.jsonl`, the gate ratio, clip
fraction and approx KL averaged over the last quarter of training, the share of trained rollouts
the teacher generated (mean over every iteration: KD, GKD, a warm-up); training and whole-run time
from `run_summary.json`. `--paired NAME` (repeatable, default opd) adds, per NAME, each variant's
final student minus NAME's on the same seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

from .run_files import extra_sets, loss_label, read_eval, read_iterations


def quarter_mean(rows: list[dict], key: str) -> float | None:
    """Mean of `iter/<key>` over the last quarter of the iteration records `rows` that have it."""
    values = [r[f"iter/{key}"] for r in rows if f"iter/{key}" in r]
    if not values:
        return None
    tail = values[len(values) - max(1, len(values) // 4):]
    return sum(tail) / len(tail)


def last_quarter(run_dir: Path, key: str) -> float | None:
    """Mean of `iter/<key>` over the last quarter of the run's iterations."""
    return quarter_mean(read_iterations(run_dir), key)


def run_facts(run_dir: Path) -> dict:
    """Everything the tables need of one run, as plain numbers."""
    cfg = yaml.safe_load((run_dir / "run.yaml").read_text()) or {}
    facts: dict = {"run": str(run_dir), "variant": loss_label(cfg), "seed": cfg.get("seed"),
                   "sets": {}}
    for set_name in [None, *extra_sets(run_dir)]:
        models = {}
        for name, m in read_eval(run_dir, set_name)["models"].items():
            row = {f"pass@{k}": v for k, v in m.get("pass_at_k", {}).items()}
            row.update({"avg": m.get("avg_at_k"), "strict": m.get("strict", {}).get("avg_at_k"),
                        "flexible": m.get("flexible", {}).get("avg_at_k"),
                        "h1_student": m.get("high_entropy_share_student"),
                        "h1_teacher": m.get("high_entropy_share_teacher"), "fkl_high": m.get("fkl_high_entropy")})
            models[name] = row
        facts["sets"][set_name or "held-out"] = models
    iterations = read_iterations(run_dir)  # train_metrics.jsonl, read once
    for key in ("gate_ratio", "clip_frac", "approx_kl"):
        facts[key] = quarter_mean(iterations, key)
    origin = [r["iter/teacher_origin_frac"] for r in iterations if "iter/teacher_origin_frac" in r]
    facts["teacher_share"] = sum(origin) / len(origin) if origin else None
    summary = json.loads((run_dir / "run_summary.json").read_text()) if (run_dir / "run_summary.json").is_file() else {}
    facts["train_s"], facts["total_s"] = summary.get("train_s"), summary.get("total_s")
    return facts


def spread(values: list[float | None]) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "–"
    mean = statistics.fmean(vals)
    return f"{mean:.3f}" if len(vals) == 1 else f"{mean:.3f} ({min(vals):.3f}–{max(vals):.3f})"


def tables(facts: list[dict], paired: tuple[str, ...] = ("opd",)) -> str:
    groups: dict[str, list[dict]] = {}
    for f in facts:
        groups.setdefault(f["variant"], []).append(f)
    out = []
    sets = sorted({s for f in facts for s in f["sets"]}, key=lambda s: (s != "held-out", s))
    for set_name in sets:
        ks = sorted({int(k.split("@")[1]) for f in facts for m in f["sets"].get(set_name, {}).values()
                     for k in m if k.startswith("pass@")})
        cols = ["avg", *[f"pass@{k}" for k in ks], "strict", "flexible", "h1_student", "h1_teacher", "fkl_high"]
        out.append(f"### {set_name} set: mean (min–max) over seeds\n")
        out.append("| model | runs | " + " | ".join(cols) + " |")
        out.append("|---" * (len(cols) + 2) + "|")
        # The teacher and the initial student are the same models in every run: one row each,
        # pooled over the runs that evaluated them; then each variant's final student.
        rows_of = [("teacher", facts, "teacher"), ("initial", facts, "initial")]
        rows_of += [(f"{variant} / final", runs, "final") for variant, runs in groups.items()]
        for label, runs, model in rows_of:
            rows = [f["sets"].get(set_name, {}).get(model) for f in runs]
            rows = [r for r in rows if r is not None]
            if rows:
                out.append(f"| {label} | {len(rows)} | " + " | ".join(spread([r.get(c) for r in rows]) for c in cols) + " |")
        out.append("")
    for reference in paired:
        out.extend(paired_differences(groups, reference))
    out.append("### training: last quarter of iterations, teacher-generated share, times; mean (min–max) over seeds\n")
    out.append("| variant | runs | gate ratio | clip fraction | approx KL | teacher-generated | training (s) | whole run (s) |")
    out.append("|---" * 8 + "|")
    for variant, runs in groups.items():
        out.append(f"| {variant} | {len(runs)} | " + " | ".join(
            spread([f.get(k) for f in runs])
            for k in ("gate_ratio", "clip_frac", "approx_kl", "teacher_share", "train_s", "total_s")) + " |")
    return "\n".join(out) + "\n"


def paired_differences(groups: dict[str, list[dict]], reference: str = "opd") -> list[str]:
    """Each variant's final student minus the reference variant's (default OPD) on the same seed, held-out
    set: Avg@n and Pass@n differences, mean (min–max) over the seeds both ran. Runs of one seed
    share data, prompt order and sampling seeds, so the pairing removes the seed's own luck."""
    if reference not in groups or len(groups) < 2:
        return []

    def finals(runs):
        return {f["seed"]: f["sets"].get("held-out", {}).get("final") for f in runs}

    ref = finals(groups[reference])
    out = [f"### paired by seed: final student minus {reference}'s (held-out set)\n",
           "| variant | seeds | Avg@n difference | Pass@n difference |", "|---|---|---|---|"]
    for variant, runs in groups.items():
        if variant == reference:
            continue
        pairs = [(m, ref[seed]) for seed, m in finals(runs).items() if m and ref.get(seed)]
        if not pairs:
            continue
        n = max(int(k.split("@")[1]) for k in pairs[0][0] if k.startswith("pass@"))
        out.append(f"| {variant} − {reference} | {len(pairs)} | "
                   + spread([a.get("avg") - b.get("avg") for a, b in pairs]) + " | "
                   + spread([a.get(f"pass@{n}") - b.get(f"pass@{n}") for a, b in pairs]) + " |")
    out.append("")
    return out


def read_facts(runs: list[Path]) -> list[dict] | None:
    """`run_facts` of every run; None (said on stderr) when one is not a run directory."""
    missing = [r for r in runs if not (r / "run.yaml").is_file()]
    if missing:
        print(f"not a run directory (no run.yaml): {', '.join(map(str, missing))}", file=sys.stderr)
        return None
    return [run_facts(r) for r in runs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eopd_trainer.eval.experiment_table",
                                description="Markdown tables (mean and range over seeds) of finished runs.")
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--json", type=Path, default=None, help="also write the per-run facts here")
    p.add_argument("--paired", action="append", default=None, metavar="VARIANT",
                   help="also tabulate each variant minus this one, paired by seed (repeatable; default opd)")
    args = p.parse_args(argv)
    facts = read_facts(args.runs)
    if facts is None:
        return 2
    if args.json:
        args.json.write_text(json.dumps(facts, indent=1))
    paired = tuple(args.paired or ["opd"])
    variants = sorted({f["variant"] for f in facts})
    for name in sorted(set(paired) - set(variants)):
        print(f"--paired {name}: no run of that variant here (variants: {', '.join(variants)}); no table for it",
              file=sys.stderr)
    print(tables(facts, paired), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
