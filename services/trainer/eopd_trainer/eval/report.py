"""`eopd report RUN_DIR [RUN_DIR ...] [--out report.html]`: one self-contained HTML file.

From each run directory: the learner's `train_metrics.jsonl` (iteration records) and the
evaluation's `eval.json`. Figures (PNG, embedded as base64): training curves (loss terms, the gate
ratio of the paper's appendix E, FKL at high-entropy positions, student and teacher entropy, and
training health: PPO clip fraction and approximate KL to the rollout policy, each with a reference
line), entropy histograms of teacher and students (paper fig. 3), Pass@k curves (the teacher
included); a table shaped like the paper's Table 2 (the headline Avg@n / Pass@k per model, the
teacher's row first, strict and flexible Avg@n beside them, the high-entropy statistics); and the
sample responses of teacher, initial and final student side by side on the same prompts.

Every field is read with a default, so the eval.json and train_metrics.jsonl of older runs render
(with "–" or empty curves where a key is missing).
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import itertools
import sys
from pathlib import Path

from .report_alarms import alarms_section
from .report_stages import mark_warmup, stages_line, warmup_iterations
from .report_tables import samples_table, table
from .run_files import SAMPLE_MODELS, extra_sets, ordered_models, read_eval, read_iterations, run_label

# Importable from here as before (tests, experiment_table.py, experiment_figures.py).
__all__ = ["CURVES", "REFERENCES", "SAMPLE_MODELS", "extra_sets", "figure_name", "figures", "main", "read_eval",
           "read_iterations", "render", "samples_table", "stages_line", "table", "warmup_iterations", "write_figures"]

CURVES = (
    ("Loss terms", ("iter/loss", "iter/pg_loss", "iter/fkl_loss")),
    ("Gate ratio (paper appendix E): share of response tokens with teacher entropy ≥ τ", ("iter/gate_ratio",)),
    ("FKL at high-entropy positions", ("iter/fkl_gated_mean",)),
    ("Entropy (nats)", ("iter/student_entropy", "iter/teacher_entropy")),
    ("Training health: PPO clip fraction (share of tokens whose ratio was clipped)", ("iter/clip_frac",)),
    ("Training health: approximate KL(rollout policy ‖ current student), per token", ("iter/approx_kl",
                                                                                      "iter/approx_kl_k3")),
)
#: Reference lines (y, label) of some curves: rules of thumb for PPO-style updates, not limits the
#: learner enforces. Clip fraction above ~0.2 and approximate KL above ~0.01 (Spinning Up's PPO
#: target_kl) mean the updates move the policy far from the one that sampled the rollouts.
REFERENCES = {
    CURVES[4][0]: (0.2, "reference 0.2"),
    CURVES[5][0]: (0.01, "reference 0.01 (a common PPO target_kl)"),
}


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def figures(runs: list[Path]) -> list[tuple[str, str]]:
    """(title, base64 PNG) for every figure of the report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    iters = {r: read_iterations(r) for r in runs}
    for title, keys in CURVES:
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for run, recs in iters.items():
            for key in keys:
                xs = [r["iteration"] for r in recs if key in r and "iteration" in r]
                ys = [r[key] for r in recs if key in r and "iteration" in r]
                if xs:
                    ax.plot(xs, ys, marker=".", label=f"{run_label(run)} {key.removeprefix('iter/')}")
        mark_warmup(ax, iters)
        if title in REFERENCES:
            y, label = REFERENCES[title]
            ax.axhline(y, color="grey", linestyle=":", linewidth=1.2, label=label)
        ax.set_xlabel("iteration")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        out.append((title, _png(fig)))

    out += teacher_figures(iters)
    evals = {r: read_eval(r) for r in runs}
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for run, ev in evals.items():
        for name, m in ev["models"].items():
            if "entropy_bins" not in m:
                continue
            bins = m["entropy_bins"]
            centres = [(a + b) / 2 for a, b in itertools.pairwise(bins)]
            shares = {who: [c / max(sum(m[f"entropy_hist_{who}"]), 1) for c in m[f"entropy_hist_{who}"]]
                      for who in ("student", "teacher")}
            (line,) = ax.plot(centres, shares["student"], drawstyle="steps-mid", label=f"{run_label(run)}/{name}")
            if name != "teacher":  # the teacher at the same positions (the model's own samples)
                ax.plot(centres, shares["teacher"], drawstyle="steps-mid", linestyle="--", color=line.get_color(),
                        label=f"teacher on {run_label(run)}/{name}'s samples")
    ax.set_xlabel("token entropy (nats)")
    ax.set_ylabel("share of tokens")
    ax.set_yscale("log")
    ax.set_title("Token-level entropy on held-out prompts (paper fig. 3)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    out.append(("Entropy histograms", _png(fig)))

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for run, ev in evals.items():
        for name, m in ordered_models(ev["models"]):
            ks = sorted(int(k) for k in m.get("pass_at_k", {}))
            if ks:  # the teacher (the ceiling) dashed
                ax.plot(ks, [m["pass_at_k"][str(k)] for k in ks], marker="o", linestyle="--" if name == "teacher"
                        else "-", label=f"{run_label(run)}/{name} ({m.get('headline', 'strict')})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("Pass@k (headline grading)")
    ax.set_title("Pass@k on held-out prompts (temperature 1.0, top-p 0.8), teacher dashed")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    out.append(("Pass@k", _png(fig)))
    return out


BY_TEACHER = (("token_share", "share of the iteration's response tokens"), ("gate_ratio", "gate ratio"),
              ("teacher_entropy", "teacher entropy (nats)"),
              ("reverse_kl", "reverse KL to the teacher (sampled tokens: old log-prob - teacher log-prob)"),
              ("fkl_gated_mean", "FKL at high-entropy positions (a mixture's teachers)"))


def teacher_figures(iters: dict[Path, list[dict]]) -> list[tuple[str, str]]:
    """Per teacher (a run with `teachers:`, issue 32): each `iter/by_teacher/<name>/<statistic>`
    over the iterations, one line per run and teacher; nothing for single-teacher runs."""
    import matplotlib.pyplot as plt

    out = []
    for stat, what in BY_TEACHER:
        keys = sorted({k for recs in iters.values() for r in recs for k in r
                       if k.startswith("iter/by_teacher/") and k.endswith(f"/{stat}")})
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for run, recs in iters.items():
            for key in keys:
                xs = [r["iteration"] for r in recs if key in r and "iteration" in r]
                if xs:
                    ax.plot(xs, [r[key] for r in recs if key in r and "iteration" in r], marker=".",
                            label=f"{run_label(run)} {key.split('/')[2]}")
        mark_warmup(ax, iters)
        ax.set_xlabel("iteration")
        title = f"Per teacher: {what}"
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        out.append((title, _png(fig)))
    return out


def render(runs: list[Path]) -> str:
    figs = figures(runs)
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>eopd report</title>",
             ("<style>body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:collapse}"
              "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}tr.teacher{background:#f4f4f4}"
              "table.samples td{vertical-align:top}td.text{text-align:left;white-space:pre-wrap;font-size:85%}"
              "td.ok .mark{color:#17702b;font-weight:bold}td.bad .mark{color:#a31515;font-weight:bold}"
              ".detail{color:#666}</style></head><body>"),
             "<h1>eopd report</h1><p>Runs: " + ", ".join(html.escape(str(r)) for r in runs) + "</p>",
             stages_line(runs),
             "<h2>Held-out evaluation (shaped like the paper's Table 2)</h2>", table(runs), alarms_section(runs), "<h2>Figures</h2>"]
    for title, data in figs:
        parts.append(f"<h3>{html.escape(title)}</h3><img alt='{html.escape(title)}' src='data:image/png;base64,{data}'>")
    parts.append("<h2>Sample responses</h2><p>Each model's first sampled response to the first held-out prompts "
                 "(temperature and top-p of the evaluation), marked by the headline grading, the strict and "
                 "flexible gradings in brackets.</p>")
    for run in runs:
        parts.append(f"<h3>{html.escape(run_label(run))}</h3>{samples_table(run)}")
    parts.append("</body></html>")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eopd report", description="One HTML report (embedded PNG figures) of runs.")
    p.add_argument("runs", nargs="+", type=Path, help="run directories")
    p.add_argument("--out", type=Path, default=None, help="output file (default: <first run>/report.html)")
    p.add_argument("--figures", type=Path, default=None,
                   help="also write every figure as a PNG file into this directory (e.g. for docs/)")
    p.add_argument("--prefix", default="", help="file-name prefix of those PNG files")
    args = p.parse_args(argv)
    missing = [r for r in args.runs if not r.is_dir()]
    if missing:
        print(f"eopd report: not a directory: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    out = args.out or args.runs[0] / "report.html"
    out.write_text(render(args.runs))
    print(out)
    if args.figures is not None:
        for path in write_figures(args.runs, args.figures, args.prefix):
            print(path)
    return 0


def figure_name(title: str) -> str:
    """A file name for a figure title: lower case, words joined by '_', at most 6 words."""
    words = "".join(c.lower() if c.isalnum() else " " for c in title).split()
    return "_".join(words[:6]) or "figure"


def write_figures(runs: list[Path], out_dir: Path, prefix: str = "") -> list[Path]:
    """Every figure of the report as `<out_dir>/<prefix><name>.png`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for title, data in figures(runs):
        path = out_dir / f"{prefix}{figure_name(title)}.png"
        path.write_bytes(base64.b64decode(data))
        paths.append(path)
    return paths
