"""docs/results.md's tables that are laid out from the archived runs, written between their markers;
`--check` writes nothing and fails (exit 1) when one differs from what the archives say now.

    python -m scripts.results_tables [--check]

The numbers come from `experiment_table.run_facts` (eval.json, eval-variants.json, run.yaml,
train_metrics.jsonl, run_summary.json of each run under docs/results/runs*/); scripts/results_near.py
and scripts/results_far.py only lay them out as the document shows them (scripts/results_layout.py:
how numbers are written): the losses named and ordered as in the text, the initial student's row from
the run that evaluated it, differences in points with a true minus sign, and bold where the text next
to each table says what bold means. `experiment_table` and `experiment_seeds` print the same numbers
in their generic layout.
"""

from __future__ import annotations

import json
from pathlib import Path

from eopd_trainer.eval.experiment_table import read_facts

from scripts import doc_blocks, layout_ablation
from scripts.results_far import far_choice, far_initial, far_means, far_paired, far_per_run, far_training
from scripts.results_near import (default_run, eopd_vs_opd, fkl_ablations, gkd_layouts, samples, teacher_metrics,
                                  teachers, variants_table, warmup)

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "results.md"
RUNS = ROOT / "docs" / "results" / "runs"
RUNS_FAR = ROOT / "docs" / "results" / "runs-far"
#: GKD's runs at its own layout (TRL's: 8 prompts x 1 response per step, configs/smollm2-cpu.yaml's per_loss.gkd),
#: the same 384 responses as the runs of RUNS; their losses are named with LAYOUT_SUFFIX in the tables.
RUNS_GKD = ROOT / "docs" / "results" / "runs-gkd-trl"
LAYOUT_SUFFIX = "@trl"
FAR_CHOICE = ROOT / "docs" / "results" / "far-student" / "choice.json"
COMMAND = "python -m scripts.results_tables"
GKD_LAMBDAS = ("0.5", "0.8", "1.0")


def with_gkd_layout(near: list[dict]) -> list[dict]:
    """`near` and the facts of RUNS_GKD, whose losses are named with LAYOUT_SUFFIX (gkd1.0@trl)."""
    gkd = read_facts(sorted(RUNS_GKD.iterdir()))
    if gkd is None:
        raise FileNotFoundError(f"{RUNS_GKD}: a run directory without run.yaml")
    return near + [{**f, "variant": f["variant"] + LAYOUT_SUFFIX} for f in gkd]


def blocks() -> dict[str, str]:
    """Every generated block of docs/results.md, by name, from the archived runs."""
    far = read_facts(sorted(RUNS_FAR.iterdir()))
    if far is None:
        raise FileNotFoundError(f"{RUNS_FAR}: a run directory without run.yaml")
    near = read_facts(sorted(RUNS.iterdir()))
    if near is None:
        raise FileNotFoundError(f"{RUNS}: a run directory without run.yaml")
    both = with_gkd_layout(near)
    return {"eopd-vs-opd": eopd_vs_opd(near), "fkl-ablations": fkl_ablations(near),
            "table-2": variants_table(near, {"kd": "KD", "grpo": "GRPO", "opd": "OPD", "eopd": "EOPD"},
                                      models=True, teacher_share=False),
            "gkd": variants_table(both, {f"gkd{lam}{LAYOUT_SUFFIX}": f"GKD λ = {lam}" for lam in GKD_LAMBDAS}
                                  | {"kd": "KD", "eopd": "EOPD", "opd": "OPD"}, models=False, teacher_share=True),
            "gkd-layouts": gkd_layouts(both, GKD_LAMBDAS, LAYOUT_SUFFIX),
            "warmup": warmup(near), "teachers": teachers(near), "teacher-metrics": teacher_metrics(near),
            "default-run": default_run(near), "samples": samples(near),
            "far-choice": far_choice(json.loads(FAR_CHOICE.read_text())),
            "far-initial": far_initial(*(f for f in near + far if f["variant"] == "eopd" and f["seed"] == 0
                                         and "initial" in f["sets"]["held-out"])),
            "far-per-run": far_per_run(far), "far-means": far_means(far), "far-paired": far_paired(far),
            "far-training": far_training(far), "layout-ablation": layout_tables(layout_ablation.ARCHIVE),
            "layout-far": "\n".join((layout_tables(layout_ablation.ARCHIVE_FAR),
                                      layout_ablation.distance_table(layout_ablation.ARCHIVE_FAR)))}


def layout_tables(archive: Path) -> str:
    """The layout ablation's table of one archive and its seen/unseen split (scripts/layout_ablation.py)."""
    return "\n".join(x for x in (layout_ablation.table(archive), layout_ablation.seen_table(archive)) if x)


def main(argv: list[str] | None = None) -> int:
    return doc_blocks.main(argv, DOC, blocks, COMMAND)


if __name__ == "__main__":
    raise SystemExit(main())
