"""The README's results table, laid out from the archived runs it quotes; `--check` writes nothing and
fails (exit 1) when the README's table differs from what the archives say now.

    python -m scripts.readme_table [--check]

Sources, one per row (read-only; they are the record):

- EOPD, OPD, GKD (lambda 1) and TRL's GKDTrainer: the head-to-head benchmark's report,
  `bench/results/e2e_trl.json` (`python -m bench.bench_e2e`; per-run files in `bench/results/e2e/`):
  the same task, 32 iterations, the same optimizer steps, each final student on the held-out and the
  variants set at Avg@4.
- The teacher and the starting student on the held-out set: that benchmark's `initial/eval.json`.
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
E2E_INITIAL = ROOT / "bench" / "results" / "e2e" / "initial" / "eval.json"
EXPERIMENT = ROOT / "docs" / "results" / "runs"
COMMAND = "python -m scripts.readme_table"
BLOCK = "results-table"
#: The head-to-head's systems in the table, in order, with the README's names.
E2E_ROWS = (("eopd", "**EOPD** (eopd, the default loss)"), ("opd", "OPD (eopd)"),
            ("eopd-gkd", "GKD, λ 1 (eopd)"), ("trl-gkd", "TRL's GKDTrainer"))


def _seconds(values: list[float]) -> str:
    """Mean (min–max) of training seconds, or "–"."""
    if not values:
        return "–"
    mean = statistics.fmean(values)
    return f"{mean:.0f}" if len(values) == 1 else f"{mean:.0f} ({min(values):.0f}–{max(values):.0f})"


def _accuracy(values: list[float | None], note: str = "") -> str:
    text = spread(values)
    return text if text == "–" else text + note


def table(e2e: dict, initial_eval: dict, experiment: list[dict]) -> str:
    """The README's results block: the table and the lines under it. `e2e` is the head-to-head report
    (bench/results/e2e_trl.json), `initial_eval` its evaluation of the teacher and the starting student,
    `experiment` `read_facts` of the 24-iteration runs (KD's, and one run that evaluated the teacher and
    the starting student on the variants set)."""
    k, systems = e2e["eval_n"], e2e["summary"]["systems"]
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
    rows = [("teacher (SmolLM2-135M-Instruct; one evaluation)", spread([models["teacher"]["avg_at_k"]]),
             _accuracy(variants_of("teacher")[:1], other), "–")]
    for name, label in E2E_ROWS:
        s = systems[name]
        rows.append((label, spread(s["final_avg"]), spread(s["final_variants_avg"]), _seconds(s["train_s"]) + "¹"))
        if name == "eopd-gkd":  # KD after the other eopd losses
            rows.append(("KD (eopd)²", _accuracy([f["sets"]["held-out"]["final"]["avg"] for f in kd], f", Avg@{n}"),
                         "not evaluated", _seconds([f["train_s"] for f in kd if f["train_s"] is not None])))
    rows.append(("starting student (the teacher minus one layer; one evaluation)", spread([models["initial"]["avg_at_k"]]),
                 _accuracy(variants_of("initial")[:1], other), "–"))
    machines = sorted({m for name, _ in E2E_ROWS for m in systems[name]["machines"]})
    settings = e2e["settings"]
    lines = [f"| three seeds each: mean (min–max) | held-out Avg@{k} | variants set Avg@{k} | training (s) |",
             "|---|---|---|---|", *(f"| {' | '.join(r)} |" for r in rows), "",
             f"¹ The head-to-head ([docs/benchmarks.md](docs/benchmarks.md#head-to-head-with-trl-accuracy-against-"
             f"training-time-python--m-benchbench_e2e-issue-34), `python -m bench.bench_e2e`): the same task, "
             f"{settings['iterations']} iterations ({settings['steps']} optimizer steps of {settings['batch_size']} "
             f"responses), {k} answers per problem. Its runs were timed on {len(machines)} machines "
             f"({'; '.join(machines)}), so a time range mixes machines; that page pairs times by machine.",
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
