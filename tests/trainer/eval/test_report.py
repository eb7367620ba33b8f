"""`eopd report` on synthetic run directories (pure logic, no models): the teacher's row and the
strict / flexible columns of the Table-2 table, the side-by-side sample responses (HTML-escaped),
the training-health curves with their reference lines, and old runs with missing keys."""

from __future__ import annotations

import html
import json
import re

import pytest


def _model(avg, *, headline="strict", samples=None, kl=0.9):
    m = {"n_samples": 4, "prompts": 8, "headline": headline, "avg_at_k": avg,
         "pass_at_k": {"1": avg, "2": min(1.0, 2 * avg), "4": min(1.0, 3 * avg)},
         "strict": {"avg_at_k": avg, "pass_at_k": {"1": avg}, "boxed_frac": 0.5},
         "flexible": {"avg_at_k": avg + 0.125, "pass_at_k": {"1": avg + 0.125}},
         "number_frac": 0.75, "entropy_bins": [0.0, 1.0, 2.0], "entropy_hist_student": [3, 1],
         "entropy_hist_teacher": [2, 2], "high_entropy_share_student": 0.25, "high_entropy_share_teacher": 0.5,
         "fkl_high_entropy": 1.5, "reverse_kl": kl}
    if samples is not None:
        m["samples"] = samples
    return m


def _sample(prompt, answer, response, correct):
    return {"prompt": prompt, "answer": answer, "response": response, "correct": correct,
            "correct_strict": False, "correct_flexible": correct}


def _write_run(run_dir, *, variant="eopd", iterations=3):
    run_dir.mkdir()
    (run_dir / "run.yaml").write_text(f"loss:\n  variant: {variant}\n")
    with (run_dir / "train_metrics.jsonl").open("w") as fh:
        for it in range(1, iterations + 1):
            fh.write(json.dumps({"step": it, "kind": "step", "iteration": it, "loss": 1.0}) + "\n")
            fh.write(json.dumps({"step": it, "kind": "iteration", "iteration": it, "iter/loss": 3.0 - it,
                                 "iter/gate_ratio": 0.5, "iter/clip_frac": 0.05 * it, "iter/approx_kl": 0.001 * it,
                                 "iter/approx_kl_k3": 0.0005 * it}) + "\n")
    q = ["What is 7 + 5?", "Is 3 < 4 & 5 > 2?"]
    models = {  # eval.json order: initial, final, then the teacher added by a later `eopd eval --model teacher`
        "initial": _model(0.0, samples=[_sample(q[0], "12", "no idea", False), _sample(q[1], "1", "hm", False)]),
        "final": _model(0.25, samples=[_sample(q[0], "12", "7 + 5 = 12", True),
                                       _sample(q[1], "1", "<script>alert(1)</script>", False)]),
        "teacher": _model(0.625, kl=0.0, samples=[_sample(q[0], "12", "It is \\boxed{12}", True)]),
    }
    (run_dir / "eval.json").write_text(json.dumps({"models": models}))
    return run_dir


def _render(tmp_path, *runs):
    from eopd_trainer.cli import main

    out = tmp_path / "r.html"
    assert main(["report", *map(str, runs), "--out", str(out)]) == 0
    return out.read_text()


def _rows(text):
    return [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr[^>]*>(.*?)</tr>", text.split("<h2>")[1])]


def test_table_has_the_teacher_row_first_and_both_gradings(tmp_path):
    text = _render(tmp_path, _write_run(tmp_path / "run"))
    head = re.findall(r"<th>(.*?)</th>", text.split("<h2>")[1])
    assert head[:8] == ["run / model", "loss", "headline", "Avg@n", "Pass@1", "Pass@n", "strict Avg@n",
                        "flexible Avg@n"]
    rows = [r for r in _rows(text) if r]
    assert [r[0] for r in rows] == ["run / teacher", "run / initial", "run / final"]
    teacher = dict(zip(head, rows[0], strict=True))
    assert teacher["loss"] == "– (teacher)" and teacher["headline"] == "strict"
    assert (teacher["Avg@n"], teacher["Pass@1"], teacher["Pass@n"]) == ("62.5", "62.5", "100.0")
    assert (teacher["strict Avg@n"], teacher["flexible Avg@n"]) == ("62.5", "75.0")
    assert teacher["reverse KL"] == "0.000"  # KL in nats, never as a percentage
    final = dict(zip(head, rows[2], strict=True))
    assert final["loss"] == "eopd" and final["reverse KL"] == "0.900" and final["with a number"] == "75.0"
    assert "<b>headline</b>" in text


def test_samples_table_side_by_side_and_escaped(tmp_path):
    text = _render(tmp_path, _write_run(tmp_path / "run"))
    section = text.split("<h2>Sample responses</h2>")[1]
    table = section.split("<table class='samples'>")[1].split("</table>")[0]
    assert re.findall(r"<th>(.*?)</th>", table) == ["prompt", "gold answer", "teacher", "initial", "final"]
    rows = re.findall(r"<tr>(.*?)</tr>", table)[1:]
    assert len(rows) == 2  # the same prompts, one row each
    assert "What is 7 + 5?" in rows[0] and "It is \\boxed{12}" in rows[0] and "7 + 5 = 12" in rows[0]
    assert rows[0].count("✓ correct") == 2 and rows[0].count("✗ wrong") == 1  # teacher, final right; initial
    assert "Is 3 &lt; 4 &amp; 5 &gt; 2?" in rows[1]
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in rows[1] and "<script>" not in text
    assert rows[1].count("<td class='text'>–</td>") == 1  # the teacher was not evaluated on that prompt
    assert "(strict ✗ · flexible ✓)" in rows[0]


def test_training_health_curves_with_reference_lines(tmp_path, monkeypatch):
    from eopd_trainer.eval import report

    drawn = []

    def capture(fig):
        ax = fig.axes[0]
        drawn.append((ax.get_title(), {line.get_label(): list(line.get_ydata()) for line in ax.lines}))
        import matplotlib.pyplot as plt

        plt.close(fig)
        return "png"

    monkeypatch.setattr(report, "_png", capture)
    run = _write_run(tmp_path / "run")
    report.figures([run])
    by_title = dict(drawn)
    titles = [t for t, _ in report.CURVES]
    clip = next(t for t in titles if "clip fraction" in t)
    kl = next(t for t in titles if "approximate KL" in t)
    gate = next(t for t in titles if "Gate ratio" in t)
    assert "appendix E" in gate and by_title[gate]["run gate_ratio"] == [0.5, 0.5, 0.5]
    assert by_title[clip]["run clip_frac"] == pytest.approx([0.05, 0.10, 0.15])
    assert by_title[clip]["reference 0.2"] == [0.2, 0.2]
    assert by_title[kl]["run approx_kl"] == pytest.approx([0.001, 0.002, 0.003])
    assert by_title[kl]["run approx_kl_k3"] == pytest.approx([0.0005, 0.001, 0.0015])
    assert any(label.startswith("reference 0.01") for label in by_title[kl])
    passk = by_title[next(t for t in by_title if t.startswith("Pass@k"))]
    assert list(passk) == ["run/teacher (strict)", "run/initial (strict)", "run/final (strict)"]


def test_old_runs_without_the_new_keys_render(tmp_path):
    """An eval.json and train_metrics.jsonl from before strict/flexible, samples, the teacher row
    and the clip / approx-KL metrics: every section renders, with "–" and empty curves."""
    from eopd_trainer.eval.report import CURVES

    old = tmp_path / "old"
    old.mkdir()
    (old / "train_metrics.jsonl").write_text(json.dumps({"kind": "iteration", "iteration": 1, "iter/loss": 1.0}) + "\n")
    (old / "eval.json").write_text(json.dumps({"models": {"final": {
        "n_samples": 4, "prompts": 8, "avg_at_k": 0.25, "pass_at_k": {"1": 0.25, "2": 0.4, "4": 0.6},
        "examples": [{"response": "x", "answer": "1", "correct": False}]}}}))
    bare = tmp_path / "bare"  # no eval.json, no metrics at all
    bare.mkdir()
    (bare / "eval.json").write_text("{}")
    text = _render(tmp_path, old, bare)
    imgs = re.findall(r"<img alt='([^']+)' src='data:image/png;base64,", text)
    assert [html.unescape(t) for t in imgs] == [t for t, _ in CURVES] + ["Entropy histograms", "Pass@k"]
    row = next(r for r in _rows(text) if r and r[0] == "old / final")
    assert row[2:8] == ["strict", "25.0", "25.0", "60.0", "–", "–"]
    assert "No sample responses in eval.json" in text


def test_other_sets_get_their_rows_and_figures_can_be_written(tmp_path):
    from eopd_trainer.cli import main

    run = _write_run(tmp_path / "run")
    variants = {"models": {"final": _model(0.5), "teacher": _model(0.75, kl=0.0)}}
    (run / "eval-variants.json").write_text(json.dumps(variants))
    text = _render(tmp_path, run)
    labels = [r[0] for r in _rows(text) if r]
    assert "run / teacher [variants set]" in labels and "run / final [variants set]" in labels
    assert labels.index("run / final") < labels.index("run / teacher [variants set]")  # held-out set first
    figs = tmp_path / "figs"
    assert main(["report", str(run), "--out", str(tmp_path / "r2.html"), "--figures", str(figs), "--prefix", "x_"]) == 0
    names = sorted(p.name for p in figs.iterdir())
    assert len(names) == 8 and all(n.startswith("x_") and n.endswith(".png") for n in names)
    assert "x_pass_k.png" in names and (figs / "x_pass_k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
