"""The README's results table, laid out from the archived runs it quotes; `--check` writes nothing and
fails (exit 1) when the README's table differs from what the archives say now.

    python -m scripts.readme_table [--check]

Sources, one per row (read-only; they are the record):

- EOPD, EOPD with the exact full-vocabulary reverse KL, OPD, GKD (lambda 1), eopd on TRL's objective
  and TRL's GKDTrainer: the head-to-head benchmark's report, `bench/results/e2e_trl.json`
  (`python -m bench.bench_e2e --phase report --reference trl-gkd --archive bench/results/e2e-avg8`;
  per-run files in `bench/results/e2e-avg8/`): the same task, the same optimizer steps, each final
  student on the held-out and the variants set at Avg@8.
- The teacher and the starting student on the held-out set: that archive's `initial/eval.json`
  (graded with as many answers per problem as the report: checked).
- KD, and the teacher's and starting student's variants set: the 24-iteration experiment of
  docs/results.md (`docs/results/runs/`, Avg@8; KD is not in the head-to-head), marked as such.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from eopd_trainer.eval.experiment_table import read_facts, spread

from scripts import doc_blocks

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
E2E = ROOT / "bench" / "results" / "e2e_trl.json"
E2E_INITIAL = ROOT / "bench" / "results" / "e2e-avg8" / "initial" / "eval.json"
EXPERIMENT = ROOT / "docs" / "results" / "runs"
COMMAND = "python -m scripts.readme_table"
BLOCK = "results-table"
#: The head-to-head's systems in the table, in order, with the README's names.
E2E_ROWS = (("eopd-rkl-full@trl-async", "**EOPD with the exact reverse KL** (eopd's default: `eopd_rkl` over the full "
                                        "vocabulary, at TRL's layout in `mode=async`)"),
            ("eopd", "EOPD, the paper's loss (eopd, `loss.variant=eopd`)"),
            ("opd", "OPD (eopd)"), ("eopd-gkd", "GKD, λ 1 (eopd; forward KL over the teacher's top-16)"),
            ("eopd-gkd@trl-async", "the same, `mode=async`"),
            ("eopd-trl-gkd", "TRL's objective in eopd (GKD, λ 1, β 1, `loss.support=full`)"),
            ("eopd-trl-gkd-async", "the same, `mode=async` (sampling beside training, one version of policy lag)"),
            ("trl-gkd", "TRL's GKDTrainer (λ 1, β 1)"))


def _seconds(values: list[float]) -> str:
    """Mean (min–max) of training seconds, or "–"."""
    if not values:
        return "–"
    mean = statistics.fmean(values)
    return f"{mean:.0f}" if len(values) == 1 else f"{mean:.0f} ({min(values):.0f}–{max(values):.0f})"


def _ratio(values: list[float]) -> str:
    """Mean (min–max) of the training-time ratios to TRL's GKDTrainer, paired by seed and machine, or ""."""
    if not values:
        return ""
    mean = statistics.fmean(values)
    return f"; {mean:.2f}x TRL's" + ("" if len(values) == 1 else f" ({min(values):.2f}–{max(values):.2f})")


def _accuracy(values: list[float | None], note: str = "") -> str:
    text = spread(values)
    return text if text == "–" else text + note


def table(e2e: dict, initial_eval: dict, experiment: list[dict]) -> str:
    """The README's results block: the table and the lines under it. `e2e` is the head-to-head report
    (bench/results/e2e_trl.json), `initial_eval` its evaluation of the teacher and the starting student,
    `experiment` `read_facts` of the 24-iteration runs (KD's, and one run that evaluated the teacher and
    the starting student on the variants set)."""
    k, systems = e2e["eval_n"], e2e["summary"]["systems"]
    if e2e["summary"]["reference"] != "trl-gkd":
        raise ValueError(f"{E2E}: the report's reference is {e2e['summary']['reference']}; the table divides by TRL's "
                         "GKDTrainer (`bench.bench_e2e --phase report --reference trl-gkd`)")
    missing = [name for name, _ in E2E_ROWS if name not in systems]
    if missing:
        raise KeyError(f"{E2E}: summary.systems has no {', '.join(missing)}")
    kd = [f for f in experiment if f["variant"] == "kd"]
    if not kd:
        raise KeyError(f"{EXPERIMENT}: no run with loss.variant kd")
    n = max(int(key.split("@")[1]) for key in kd[0]["sets"]["held-out"]["final"] if key.startswith("pass@"))
    other = f" (Avg@{n}²)"

    def variants_of(model: str) -> list[float | None]:
        return [f["sets"]["variants"][model]["avg"] for f in experiment if model in f["sets"].get("variants", {})]

    models = initial_eval["models"]
    graded = {m["n_samples"] for m in models.values() if "n_samples" in m}
    if graded != {k}:
        raise ValueError(f"{E2E_INITIAL}: the teacher and the starting student were graded with {sorted(graded)} answers "
                         f"per problem, the head-to-head's report with {k}: not one archive's")
    rows = [("teacher (SmolLM2-135M-Instruct; one evaluation)", spread([models["teacher"]["avg_at_k"]]),
             _accuracy(variants_of("teacher")[:1], other), "–")]
    for name, label in E2E_ROWS:
        s = systems[name]
        ratio = _ratio(s.get("train_ratios", [])) if name != e2e["summary"]["reference"] else ""
        rows.append((label, spread(s["final_avg"]), spread(s["final_variants_avg"]), _seconds(s["train_s"]) + "¹" + ratio))
        if name == "eopd-gkd":  # KD after the other eopd losses
            rows.append(("KD (eopd)²", _accuracy([f["sets"]["held-out"]["final"]["avg"] for f in kd], f", Avg@{n}"),
                         "not evaluated", _seconds([f["train_s"] for f in kd if f["train_s"] is not None])))
    rows.append(("starting student (the teacher minus one layer; one evaluation)", spread([models["initial"]["avg_at_k"]]),
                 _accuracy(variants_of("initial")[:1], other), "–"))
    machines = sorted({m for name, _ in E2E_ROWS for m in systems[name]["machines"]})
    settings = e2e["settings"]
    lines = [f"| three seeds each: mean (min–max) | held-out Avg@{k} | variants set Avg@{k} | training (s); time over TRL's, "
             "paired by seed and machine |",
             "|---|---|---|---|", *(f"| {' | '.join(r)} |" for r in rows), "",
             f"¹ The head-to-head ([docs/benchmarks.md](docs/benchmarks.md#head-to-head-with-trl-accuracy-against-"
             f"training-time-python--m-benchbench_e2e-issue-34), `python -m bench.bench_e2e`): the same task, "
             f"{settings['steps']} optimizer steps of {settings['batch_size']} responses for every system, each eopd "
             f"loss at its own default layout unless its row names another, {k} answers per problem. Its runs were timed on {len(machines)} machines "
             f"({'; '.join(machines)}), so a time range mixes machines; the ratio divides each run's time by TRL "
             "GKDTrainer's of the same seed timed on the same machine.",
             f"² KD is not in the head-to-head: its row, and the variants cells marked ², come from the experiment of "
             f"[docs/results.md](docs/results.md) (24 iterations, {n} answers per problem, another day's machine).",
             ]
    return "\n".join(lines) + "\n"


def build() -> str:
    """The block from the archived files."""
    e2e = json.loads(E2E.read_text())
    initial = json.loads(E2E_INITIAL.read_text())
    runs = sorted(p for p in EXPERIMENT.iterdir() if p.name.startswith(("kd-s", "eopd-s0")))
    facts = read_facts(runs)
    if facts is None:
        raise FileNotFoundError(f"{EXPERIMENT}: a run directory without run.yaml")
    return table(e2e, initial, facts)


def main(argv: list[str] | None = None) -> int:
    return doc_blocks.main(argv, README, lambda: {BLOCK: build()}, COMMAND)


if __name__ == "__main__":
    raise SystemExit(main())
