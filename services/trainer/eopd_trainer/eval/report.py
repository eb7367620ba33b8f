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
import json
import math
import sys
from pathlib import Path

import yaml

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
#: Column order of the side-by-side sample table; other evaluated models follow.
SAMPLE_MODELS = ("teacher", "initial", "final")


def read_iterations(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "train_metrics.jsonl"
    if not path.is_file():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "iteration"]


def read_eval(run_dir: Path, set_name: str | None = None) -> dict:
    """`eval.json` (the run's held-out split) or `eval-<set_name>.json` (another set, e.g. the
    variants written differently)."""
    path = Path(run_dir) / ("eval.json" if set_name is None else f"eval-{set_name}.json")
    ev = json.loads(path.read_text()) if path.is_file() else {}
    ev.setdefault("models", {})
    return ev


def extra_sets(run_dir: Path) -> list[str]:
    """Names of the other evaluated sets of a run (`eval-<name>.json`), sorted."""
    return sorted(p.name[len("eval-"):-len(".json")] for p in Path(run_dir).glob("eval-*.json"))


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
                xs = [r["iteration"] for r in recs if key in r and "iteration" in r]
                ys = [r[key] for r in recs if key in r and "iteration" in r]
                if xs:
                    ax.plot(xs, ys, marker=".", label=f"{_label(run)} {key.removeprefix('iter/')}")
        _mark_warmup(ax, iters)
        if title in REFERENCES:
            y, label = REFERENCES[title]
            ax.axhline(y, color="grey", linestyle=":", linewidth=1.2, label=label)
        ax.set_xlabel("iteration")
        ax.set_title(title, fontsize=9)
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
        for name, m in _ordered(ev["models"]):
            ks = sorted(int(k) for k in m.get("pass_at_k", {}))
            if ks:  # the teacher (the ceiling) dashed
                ax.plot(ks, [m["pass_at_k"][str(k)] for k in ks], marker="o", linestyle="--" if name == "teacher"
                        else "-", label=f"{_label(run)}/{name} ({m.get('headline', 'strict')})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k")
    ax.set_ylabel("Pass@k (headline grading)")
    ax.set_title("Pass@k on held-out prompts (temperature 1.0, top-p 0.8), teacher dashed")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    out.append(("Pass@k", _png(fig)))
    return out


def _ordered(models: dict) -> list[tuple[str, dict]]:
    """The teacher, initial and final first, then the other models in eval.json order."""
    return sorted(models.items(), key=lambda kv: SAMPLE_MODELS.index(kv[0]) if kv[0] in SAMPLE_MODELS else 3)


def _pct(v) -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "–"
    return "nan" if math.isnan(v) else f"{100 * v:.1f}"


def _nats(v) -> str:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return "–"
    return "nan" if math.isnan(v) else f"{v:.3f}"


def _text(v) -> str:
    return "–" if v is None or v == "" else html.escape(str(v))


def warmup_iterations(recs: list[dict]) -> list[int]:
    """The iterations of a run's KD warm-up stage (records with stage "kd-warmup")."""
    return sorted({int(r["iteration"]) for r in recs if r.get("stage") == "kd-warmup" and "iteration" in r})


def _mark_warmup(ax, iters: dict) -> None:
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
        variant = _variant(run) or next((r.get("stage") for r in recs if r.get("stage") not in (None, "kd-warmup")), "")
        if warm:
            out.append(f"{_label(run)}: kd-warmup (iterations {min(warm)}-{max(warm)}, shaded in the training curves), "
                       f"then {variant or '?'}")
    return "<p>Stages: " + html.escape("; ".join(out)) + "</p>" if out else ""


def _variant(run: Path) -> str:
    cfg_path = Path(run) / "run.yaml"
    if not cfg_path.is_file():
        return ""
    return ((yaml.safe_load(cfg_path.read_text()) or {}).get("loss") or {}).get("variant", "")


#: (header, formatter, getter) of the Table-2 columns after "run / model" and "loss".
_COLUMNS = (
    ("headline", _text, lambda m, n: m.get("headline", "strict")),  # eval.json before eval.headline: strict
    ("Avg@n", _pct, lambda m, n: m.get("avg_at_k")),
    ("Pass@1", _pct, lambda m, n: m.get("pass_at_k", {}).get("1")),
    ("Pass@n", _pct, lambda m, n: m.get("pass_at_k", {}).get(str(n))),
    ("strict Avg@n", _pct, lambda m, n: m.get("strict", {}).get("avg_at_k")),
    ("flexible Avg@n", _pct, lambda m, n: m.get("flexible", {}).get("avg_at_k")),
    ("with a number", _pct, lambda m, n: m.get("number_frac")),
    ("H≥1 share student", _pct, lambda m, n: m.get("high_entropy_share_student")),
    ("H≥1 share teacher", _pct, lambda m, n: m.get("high_entropy_share_teacher")),
    ("FKL at H_T≥τ", _nats, lambda m, n: m.get("fkl_high_entropy")),
    ("reverse KL", _nats, lambda m, n: m.get("reverse_kl")),
    ("n × prompts", _text, lambda m, n: f"{n} × {m.get('prompts', '?')}" if n else None),
)


def table(runs: list[Path]) -> str:
    """Rows: run/model (the teacher first); columns: the headline Avg@n, Pass@1, Pass@n (percent),
    strict and flexible Avg@n, then entropy and KL statistics."""
    head = ("run / model", "loss") + tuple(h for h, _, _ in _COLUMNS)
    rows = []
    for run, set_name in [(r, s) for r in runs for s in [None, *extra_sets(r)]]:
        variant = _variant(run)
        for name, m in _ordered(read_eval(run, set_name)["models"]):
            n = m.get("n_samples")
            where = f"{_label(run)} / {name}" + (f" [{set_name} set]" if set_name else "")
            cells = [_text(where), _text(variant if name != "teacher" else "– (teacher)")]
            cells += [fmt(get(m, n)) for _, fmt, get in _COLUMNS]
            rows.append("<tr" + (" class='teacher'" if name == "teacher" else "") + ">"
                        + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return ("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>" + "".join(rows)
            + "</table><p>Avg@n, Pass@1 and Pass@n are the <b>headline</b> metrics, graded as the <i>headline</i> "
            "column says (<code>eval.headline</code>): <i>strict</i> reads the last <code>\\boxed{}</code>, "
            "<i>flexible</i> the response's last number (lm-evaluation-harness's GSM8K flexible-extract); both are "
            "graded by math-verify, and both Avg@n are shown beside the headline. The teacher's row is the ceiling "
            "(its KL to itself is 0). Rows marked [<i>set</i>] are another held-out set (<code>eval-&lt;set&gt;.json</code>; "
            "[variants set]: the same problems' family written differently from the generator). Percentages: Avg@n, Pass@k, the share of responses with a number and the "
            "entropy shares; KL in nats (exact, full vocabulary, on the model's own first sample per prompt).</p>")


def _sample_cell(s: dict | None) -> str:
    if s is None:
        return "<td class='text'>–</td>"
    ok = bool(s.get("correct"))
    detail = " · ".join(f"{mode} {'✓' if s[f'correct_{mode}'] else '✗'}" for mode in ("strict", "flexible")
                        if f"correct_{mode}" in s)
    mark = f"<span class='mark'>{'✓ correct' if ok else '✗ wrong'}</span>"
    if detail:
        mark += f" <span class='detail'>({html.escape(detail)})</span>"
    return f"<td class='text {'ok' if ok else 'bad'}'>{mark}<br>{html.escape(str(s.get('response', '')))}</td>"


def samples_table(run: Path) -> str:
    """Teacher / initial / final (and any other evaluated model) side by side on the same prompts:
    each model's first response to the first held-out prompts, marked by the headline grading."""
    models = [(name, m["samples"]) for name, m in _ordered(read_eval(run)["models"]) if m.get("samples")]
    if not models:
        return "<p>No sample responses in eval.json (written by an older <code>eopd eval</code>).</p>"
    prompts: dict[tuple[str, str], dict[str, dict]] = {}  # (prompt, answer) -> model -> sample, in order
    for name, samples in models:
        for s in samples:
            prompts.setdefault((str(s.get("prompt", "")), str(s.get("answer", ""))), {})[name] = s
    head = ["prompt", "gold answer"] + [name for name, _ in models]
    rows = []
    for (prompt, answer), by_model in prompts.items():
        rows.append(f"<tr><td class='text'>{_text(prompt)}</td><td>{_text(answer)}</td>"
                    + "".join(_sample_cell(by_model.get(name)) for name, _ in models) + "</tr>")
    return ("<table class='samples'><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
            + "".join(rows) + "</table>")


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
             "<h2>Held-out evaluation (shaped like the paper's Table 2)</h2>", table(runs), "<h2>Figures</h2>"]
    for title, data in figs:
        parts.append(f"<h3>{html.escape(title)}</h3><img alt='{html.escape(title)}' src='data:image/png;base64,{data}'>")
    parts.append("<h2>Sample responses</h2><p>Each model's first sampled response to the first held-out prompts "
                 "(temperature and top-p of the evaluation), marked by the headline grading, the strict and "
                 "flexible gradings in brackets.</p>")
    for run in runs:
        parts.append(f"<h3>{html.escape(_label(run))}</h3>{samples_table(run)}")
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
