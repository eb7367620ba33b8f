"""The KD warm-up stage in `eopd report`: the warm-up iterations of a run (records with stage
"kd-warmup", `train.warmup_kd_iterations`), shaded on the training curves (`mark_warmup`) and named
in the report's header (`stages_line`)."""

from __future__ import annotations

import html
from pathlib import Path

from .run_files import read_iterations, run_label, run_variant


def warmup_iterations(recs: list[dict]) -> list[int]:
    """The iterations of a run's KD warm-up stage (records with stage "kd-warmup")."""
    return sorted({int(r["iteration"]) for r in recs if r.get("stage") == "kd-warmup" and "iteration" in r})


def mark_warmup(ax, iters: dict) -> None:
    """A shaded span over each run's KD warm-up iterations (one legend entry), on a training curve."""
    labelled = False
    for recs in iters.values():
        warm = warmup_iterations(recs)
        if warm:
            ax.axvspan(min(warm) - 0.5, max(warm) + 0.5, color="tab:orange", alpha=0.12,
                       label=None if labelled else "kd-warmup")
            labelled = True


def stages_line(runs: list[Path]) -> str:
    """The header's line naming each run's training stages, e.g. "run: kd-warmup (iterations 1-2), then eopd"."""
    out = []
    for run in runs:
        recs = read_iterations(run)
        warm = warmup_iterations(recs)
        variant = run_variant(run) or next(
            (r.get("stage") for r in recs if r.get("stage") not in (None, "kd-warmup")), "")
        if warm:
            out.append(f"{run_label(run)}: kd-warmup (iterations {min(warm)}-{max(warm)}, shaded in the training "
                       f"curves), then {variant or '?'}")
    return "<p>Stages: " + html.escape("; ".join(out)) + "</p>" if out else ""
