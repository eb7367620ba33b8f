"""The figures of an experiment (docs/results.md): runs grouped by loss variant, each curve the
mean over the group's seeds with its min–max band.

    python -m eopd_trainer.eval.experiment_figures runs/exp/eopd-s0 runs/exp/opd-s0 ... --out DIR [--prefix P]

Writes four PNG files into DIR:
- `<P>pass_at_k.png`: Pass@k (headline grading, held-out set) of each variant's final student
  against k, with the teacher and the initial student (paper fig. 2);
- `<P>training.png`: over training iterations, per variant: the gate ratio (share of response
  tokens with teacher entropy >= tau, paper appendix E), the student's token entropy, the forward
  KL at those high-entropy positions, and the PPO clip fraction;
- `<P>entropy_share.png`: the share of held-out response tokens with entropy >= 1 nat, the model's
  own and the teacher's at the same positions (paper section 5.3);
- `<P>entropy_histograms.png`: the distribution of the token entropy of held-out responses, the
  teacher's, the initial student's and each loss's final students' own, counts pooled over the
  runs (paper fig. 3: does a loss collapse the student's entropy?).

The teacher and the initial student are the same models in every run of an experiment: their
lines pool every run that evaluated them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from .experiment_table import run_facts
from .run_files import read_eval, read_iterations

#: (panel title, iteration key) of the training figure.
TRAINING_PANELS = (
    ("gate ratio (share of tokens with H_teacher >= tau)", "iter/gate_ratio"),
    ("student token entropy (nats)", "iter/student_entropy"),
    ("FKL at high-entropy positions", "iter/fkl_gated_mean"),
    ("PPO clip fraction", "iter/clip_frac"),
)


def band(series: list[list[float]]) -> tuple[list[float], list[float], list[float]]:
    """Mean, min and max across runs, position by position over the common length.
    `series`: one list of values per run."""
    n = min((len(s) for s in series), default=0)
    cols = [[s[i] for s in series] for i in range(n)]
    return ([statistics.fmean(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols])


def group_facts(facts_of: dict[Path, dict]) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """(variant -> held-out eval rows of its final students, model -> rows of the teacher and the
    initial student pooled over every run that evaluated them), from each run's `run_facts`."""
    finals: dict[str, list[dict]] = {}
    shared: dict[str, list[dict]] = {"teacher": [], "initial": []}
    for facts in facts_of.values():
        models = facts["sets"].get("held-out", {})
        if "final" in models:
            finals.setdefault(facts["variant"], []).append(models["final"])
        for name in shared:
            if name in models:
                shared[name].append(models[name])
    return finals, shared


def pooled_histograms(runs_models: list[tuple[str, dict]]) -> tuple[list[float], dict[str, list[float]]]:
    """(bin edges, label -> share of tokens per bin) of the models' own token entropy on held-out
    responses. `runs_models`: one (variant, models) pair per run, models being its held-out
    `eval.json` models (name -> metrics with `entropy_bins` and the counts `entropy_hist_student`).
    The teacher and the initial student pool every run that evaluated them ("teacher", "initial");
    a loss's final students pool its runs (the variant's name). Counts are summed before dividing,
    so a run with more tokens weighs more. Models without a histogram are skipped; runs whose bins
    differ from the first one's are an error."""
    edges: list[float] = []
    counts: dict[str, list[int]] = {}
    for variant, models in runs_models:
        for name, m in models.items():
            if "entropy_bins" not in m or name not in ("teacher", "initial", "final"):
                continue
            if not edges:
                edges = list(m["entropy_bins"])
            elif list(m["entropy_bins"]) != edges:
                raise ValueError(f"entropy bins differ between runs: {m['entropy_bins']} vs {edges}")
            label = variant if name == "final" else name
            acc = counts.setdefault(label, [0] * (len(edges) - 1))
            counts[label] = [a + c for a, c in zip(acc, m["entropy_hist_student"], strict=True)]
    return edges, {k: [c / max(sum(v), 1) for c in v] for k, v in counts.items()}


def _ks(rows: list[dict]) -> list[int]:
    return sorted({int(k.split("@")[1]) for r in rows for k in r if k.startswith("pass@")})


def _pass_series(rows: list[dict], ks: list[int]) -> list[list[float]]:
    return [[r.get(f"pass@{k}") for k in ks] for r in rows if all(r.get(f"pass@{k}") is not None for k in ks)]


def colours(shared, variants: list[str]) -> dict[str, object]:
    """One colour per label in every figure: the shared models (teacher, initial) black and grey,
    each loss its own in order of first appearance: matplotlib's tab10, then tab20's light shades,
    both without their greys (which would read as the initial student's)."""
    from matplotlib import colormaps

    fixed = dict(zip(["teacher", "initial"], ["black", "dimgrey"]))
    out = {n: fixed.get(n, "grey") for n in shared}
    names = list(dict.fromkeys(v for v in variants if v not in out))
    palette = [c for i, c in enumerate(colormaps["tab10"].colors) if i != 7]
    palette += [c for i, c in enumerate(colormaps["tab20"].colors) if i % 2 and i != 15]
    out.update({n: palette[i % len(palette)] for i, n in enumerate(names)})
    return out


def write_figures(runs: list[Path], out_dir: Path, prefix: str = "") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    facts_of = {run: run_facts(run) for run in runs}
    finals, shared = group_facts(facts_of)
    written = []

    by_variant: dict[str, list[Path]] = {}
    for run in runs:
        by_variant.setdefault(facts_of[run]["variant"], []).append(run)
    colour = colours(shared, [*finals, *by_variant])

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, rows, style in ([(n, r, "--") for n, r in shared.items()] + [(v, r, "-") for v, r in finals.items()]):
        ks = _ks(rows)
        series = _pass_series(rows, ks)
        if not series:
            continue
        mean, lo, hi = band(series)
        ax.plot(ks, mean, marker="o", linestyle=style, color=colour[label], label=f"{label} ({len(series)} runs)")
        ax.fill_between(ks, lo, hi, color=colour[label], alpha=0.15)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("Pass@k (held-out)")
    ax.set_title("Pass@k: final student per loss, teacher and initial student dashed (mean, min–max)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    written.append(_save(plt, fig, out_dir / f"{prefix}pass_at_k.png"))

    fig, axes = plt.subplots(2, 2, figsize=(10, 6.4))
    for ax, (title, key) in zip(axes.flat, TRAINING_PANELS):
        for variant, group in by_variant.items():
            series = [[r[key] for r in read_iterations(run) if key in r] for run in group]
            mean, lo, hi = band([s for s in series if s])
            if mean:
                xs = list(range(1, len(mean) + 1))
                ax.plot(xs, mean, color=colour[variant], label=f"{variant} ({len(group)} runs)")
                ax.fill_between(xs, lo, hi, color=colour[variant], alpha=0.15)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    written.append(_save(plt, fig, out_dir / f"{prefix}training.png"))

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    groups = [(n, r) for n, r in shared.items() if r] + list(finals.items())
    for i, (label, rows) in enumerate(groups):
        for j, (who, bar_colour) in enumerate((("h1_student", "tab:blue"), ("h1_teacher", "tab:orange"))):
            vals = [r[who] for r in rows if r.get(who) is not None]
            if vals:
                mean = statistics.fmean(vals)
                ax.bar(i + (j - 0.5) * 0.38, mean, width=0.36, color=bar_colour,
                       yerr=[[mean - min(vals)], [max(vals) - mean]], capsize=3,
                       label=("the model's own" if who == "h1_student" else "the teacher at the same positions")
                       if i == 0 else None)
    ax.set_xticks(range(len(groups)), [g for g, _ in groups], fontsize=8)
    ax.set_ylabel("share of tokens with entropy >= 1")
    ax.set_title("High-entropy tokens on held-out responses (mean, min–max over runs)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    written.append(_save(plt, fig, out_dir / f"{prefix}entropy_share.png"))

    edges, shares = pooled_histograms([(facts_of[run]["variant"], read_eval(run)["models"]) for run in runs])
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    centres = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
    for label, share in shares.items():
        ax.plot(centres, share, drawstyle="steps-mid", color=colour.get(label, "grey"),
                linestyle="--" if label in shared else "-", label=label)
    ax.set_xlabel("token entropy (nats), the model's own on its held-out responses")
    ax.set_ylabel("share of tokens")
    ax.set_yscale("log")
    ax.set_title("Token entropy (paper fig. 3), counts pooled over runs", fontsize=9)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    written.append(_save(plt, fig, out_dir / f"{prefix}entropy_histograms.png"))
    return written


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eopd_trainer.eval.experiment_figures",
                                description="Figures of an experiment: runs grouped by loss variant, mean and "
                                "min-max over seeds.")
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True, help="directory of the PNG files")
    p.add_argument("--prefix", default="", help="file-name prefix")
    args = p.parse_args(argv)
    missing = [r for r in args.runs if not (r / "run.yaml").is_file()]
    if missing:
        print(f"not a run directory (no run.yaml): {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    for path in write_figures(args.runs, args.out, args.prefix):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
