"""`eopd report RUN_DIR [RUN_DIR ...] [--out report.html]`: one self-contained HTML file.

From each run directory: the learner's `train_metrics.jsonl` (iteration records) and the
evaluation's `eval.json`. Figures (PNG, embedded as base64): training curves (loss terms, gate
ratio, FKL at high-entropy positions, student and teacher entropy), entropy histograms of teacher
and students (paper fig. 3), Pass@k curves; and a table shaped like the paper's Table 2 (Avg@k,
Pass@k per model, with the high-entropy statistics).
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import itertools
import json
import math
import sys
from pathlib import Path

CURVES = (
    ("Loss terms", ("iter/loss", "iter/pg_loss", "iter/fkl_loss")),
    ("FKL gate ratio (share of positions with teacher entropy >= tau)", ("iter/gate_ratio",)),
    ("FKL at high-entropy positions", ("iter/fkl_gated_mean",)),
    ("Entropy (nats)", ("iter/student_entropy", "iter/teacher_entropy")),
)


def read_iterations(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "train_metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "iteration"]


def read_eval(run_dir: Path) -> dict:
    path = Path(run_dir) / "eval.json"
    return json.loads(path.read_text()) if path.is_file() else {"models": {}}


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _label(run_dir: Path) -> str:
    return Path(run_dir).name


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
                xs = [r["iteration"] for r in recs if key in r]
                ys = [r[key] for r in recs if key in r]
                if xs:
                    ax.plot(xs, ys, marker=".", label=f"{_label(run)} {key.removeprefix('iter/')}")
        ax.set_xlabel("iteration")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        out.append((title, _png(fig)))

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
            (line,) = ax.plot(centres, shares["student"], drawstyle="steps-mid", label=f"{_label(run)}/{name}")
            if name != "teacher":  # the teacher at the same positions (the model's own samples)
                ax.plot(centres, shares["teacher"], drawstyle="steps-mid", linestyle="--", color=line.get_color(),
                        label=f"teacher on {_label(run)}/{name}'s samples")
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
        for name, m in ev["models"].items():
            ks = sorted(int(k) for k in m.get("pass_at_k", {}))
            if ks:
                ax.plot(ks, [m["pass_at_k"][str(k)] for k in ks], marker="o", label=f"{_label(run)}/{name}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("Pass@k")
    ax.set_title("Pass@k on held-out prompts (temperature 1.0, top-p 0.8)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    out.append(("Pass@k", _png(fig)))
    return out


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{100 * v:.1f}" if abs(v) <= 1.0 else f"{v:.3f}"
    return html.escape(str(v))


def table(runs: list[Path]) -> str:
    """Rows: run/model; columns: Avg@k, Pass@k (percent), then entropy and KL statistics."""
    head = ("run / model", "loss", "Avg@n", "Pass@1", "Pass@n", "H≥1 share student", "H≥1 share teacher",
            "FKL at H_T≥τ", "reverse KL", "n × prompts")
    rows = []
    for run in runs:
        ev = read_eval(run)
        variant = ""
        cfg_path = Path(run) / "run.yaml"
        if cfg_path.is_file():
            import yaml

            variant = (yaml.safe_load(cfg_path.read_text()) or {}).get("loss", {}).get("variant", "")
        for name, m in ev["models"].items():
            n = m["n_samples"]
            rows.append((f"{_label(run)} / {name}", variant if name != "teacher" else "–", m["avg_at_k"],
                         m["pass_at_k"].get("1"), m["pass_at_k"].get(str(n)), m.get("high_entropy_share_student"),
                         m.get("high_entropy_share_teacher"), m.get("fkl_high_entropy"), m.get("reverse_kl"),
                         f"{n} × {m['prompts']}"))
    body = "".join("<tr>" + "".join(f"<td>{_fmt(c)}</td>" for c in r) + "</tr>" for r in rows)
    return ("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>" + body + "</table>"
            + "<p>Avg@n, Pass@k and the shares in percent; KL in nats (exact, full vocabulary, on the model's own "
            "first sample per prompt).</p>")


def render(runs: list[Path]) -> str:
    figs = figures(runs)
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>eopd report</title>",
             ("<style>body{font-family:sans-serif;max-width:1000px;margin:auto}table{border-collapse:collapse}"
              "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}</style></head><body>"),
             "<h1>eopd report</h1><p>Runs: " + ", ".join(html.escape(str(r)) for r in runs) + "</p>",
             "<h2>Held-out evaluation (shaped like the paper's Table 2)</h2>", table(runs), "<h2>Figures</h2>"]
    for title, data in figs:
        parts.append(f"<h3>{html.escape(title)}</h3><img alt='{html.escape(title)}' src='data:image/png;base64,{data}'>")
    parts.append("</body></html>")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eopd report", description="One HTML report (embedded PNG figures) of runs.")
    p.add_argument("runs", nargs="+", type=Path, help="run directories")
    p.add_argument("--out", type=Path, default=None, help="output file (default: <first run>/report.html)")
    args = p.parse_args(argv)
    missing = [r for r in args.runs if not r.is_dir()]
    if missing:
        print(f"eopd report: not a directory: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    out = args.out or args.runs[0] / "report.html"
    out.write_text(render(args.runs))
    print(out)
    return 0
