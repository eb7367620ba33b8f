"""The tables of `eopd report`: the held-out evaluation shaped like the paper's Table 2 (`table`)
and the sample responses of the models side by side (`samples_table`), as HTML."""

from __future__ import annotations

import html
import math
from pathlib import Path

from .run_files import extra_sets, ordered_models, read_eval, run_label, run_variant


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
        variant = run_variant(run)
        for name, m in ordered_models(read_eval(run, set_name)["models"]):
            n = m.get("n_samples")
            where = f"{run_label(run)} / {name}" + (f" [{set_name} set]" if set_name else "")
            if m.get("cache", {}).get("reused"):  # eval/cache.py: the same evaluation made before
                where += f" (reused from cache {m['cache'].get('key', '?')})"
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
    models = [(name, m["samples"]) for name, m in ordered_models(read_eval(run)["models"]) if m.get("samples")]
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
