"""experiment_table: mean and range over seeds per variant and model, last-quarter training means."""

from __future__ import annotations

import json

import pytest

from eopd_trainer.eval.experiment_table import last_quarter, main


def fake_run(path, variant, seed, final_avg, gates):
    path.mkdir()
    (path / "run.yaml").write_text(f"loss: {{variant: {variant}}}\nseed: {seed}\n")
    models = {name: {"entropy_bins": [0.0, 0.5, 1.0, 8.0], "entropy_hist_student": [5, 3, 2 + seed],
                     "avg_at_k": avg, "pass_at_k": {"1": avg, "4": min(1.0, 2 * avg)}, "n_samples": 4,
                     "strict": {"avg_at_k": 0.0}, "flexible": {"avg_at_k": avg}, "high_entropy_share_student": 0.1,
                     "high_entropy_share_teacher": 0.2, "fkl_high_entropy": 0.5}
              for name, avg in (("teacher", 0.6), ("initial", 0.1), ("final", final_avg))}
    (path / "eval.json").write_text(json.dumps({"models": models}))
    (path / "eval-variants.json").write_text(json.dumps({"models": {"final": models["final"]}}))
    (path / "train_metrics.jsonl").write_text("".join(
        json.dumps({"kind": "iteration", "iteration": i + 1, "iter/gate_ratio": g, "iter/clip_frac": 0.05,
                    "iter/approx_kl": 0.01, "iter/student_entropy": 2.0 - 0.1 * i, "iter/fkl_gated_mean": 1.5 - 0.1 * i,
                    "iter/teacher_entropy": 1.0}) + "\n" for i, g in enumerate(gates)))
    (path / "run_summary.json").write_text(json.dumps({"train_s": 500.0 + seed, "total_s": 700.0 + seed}))
    return path


def test_tables_aggregate_over_seeds(tmp_path, capsys):
    a = fake_run(tmp_path / "a", "eopd", 0, 0.4, [0.5, 0.5, 0.5, 0.2])
    b = fake_run(tmp_path / "b", "eopd", 1, 0.3, [0.5, 0.5, 0.5, 0.4])
    c = fake_run(tmp_path / "c", "opd", 0, 0.2, [0.1] * 8)
    assert last_quarter(a, "gate_ratio") == 0.2 and last_quarter(c, "gate_ratio") == 0.1
    assert main([str(a), str(b), str(c), "--json", str(tmp_path / "f.json")]) == 0
    out = capsys.readouterr().out
    assert "| eopd / final | 2 | 0.350 (0.300–0.400) | 0.350 (0.300–0.400) | 0.700 (0.600–0.800) |" in out
    assert "| opd / final | 1 | 0.200 | 0.200 | 0.400 |" in out
    assert "### variants set" in out and "| eopd | 2 | 0.300 (0.200–0.400) | 0.050 (0.050–0.050)" in out
    assert len(json.loads((tmp_path / "f.json").read_text())) == 3
    assert main([str(tmp_path / "missing")]) == 2


def test_teacher_and_initial_pooled_and_variants_paired_by_seed(tmp_path, capsys):
    runs = [fake_run(tmp_path / "e0", "eopd", 0, 0.40, [0.3] * 4), fake_run(tmp_path / "o0", "opd", 0, 0.30, [0.3] * 4),
            fake_run(tmp_path / "e1", "eopd", 1, 0.20, [0.3] * 4), fake_run(tmp_path / "o1", "opd", 1, 0.25, [0.3] * 4)]
    assert main([str(r) for r in runs]) == 0
    out = capsys.readouterr().out
    # one teacher row over the four runs, not one per variant
    assert "| teacher | 4 | 0.600 (0.600–0.600) |" in out and "eopd / teacher" not in out
    # eopd - opd per seed: +0.10 (seed 0), -0.05 (seed 1); Pass@4 = 2 * avg: +0.20, -0.10
    assert "| eopd − opd | 2 | 0.025 (-0.050–0.100) | 0.050 (-0.100–0.200) |" in out
    assert "minus eopd's" not in out
    # --paired names the reference(s): the other direction, and each reference's own table
    assert main([*map(str, runs), "--paired", "eopd", "--paired", "opd"]) == 0
    out = capsys.readouterr().out
    assert "| opd − eopd | 2 | -0.025 (-0.100–0.050) | -0.050 (-0.200–0.100) |" in out
    assert "| eopd − opd | 2 |" in out
    assert main([*map(str, runs), "--paired", "edpo"]) == 0  # a typo: said on stderr, no table
    captured = capsys.readouterr()
    assert "minus edpo" not in captured.out and "--paired edpo: no run of that variant here (variants: eopd, opd)" in captured.err
    # times from run_summary.json: training and whole run, per variant over its seeds
    assert "| eopd | 2 | 0.300 (0.300–0.300) | 0.050 (0.050–0.050) | 0.010 (0.010–0.010) | – | 500.500 (500.000–501.000) | 700.500 (700.000–701.000) |" in out



def test_seed_by_seed_tables(tmp_path, capsys):
    """experiment_seeds: each run's values in seed order, paired differences per seed (bold where
    ahead in every seed), first-quarter -> last-quarter training means."""
    from eopd_trainer.eval.experiment_seeds import first_quarter_mean, main as seeds_main

    assert first_quarter_mean([{"iter/x": v} for v in (4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)], "x") == 3.0
    assert first_quarter_mean([{}], "x") is None
    # given out of seed order: the tables put seed 0 first
    runs = [fake_run(tmp_path / "e1", "eopd", 1, 0.20, [0.3] * 4), fake_run(tmp_path / "e0", "eopd", 0, 0.40, [0.3] * 4),
            fake_run(tmp_path / "o0", "opd", 0, 0.30, [0.3] * 4), fake_run(tmp_path / "o1", "opd", 1, 0.25, [0.3] * 4),
            fake_run(tmp_path / "k0", "kd", 0, 0.50, [0.3] * 4), fake_run(tmp_path / "k1", "kd", 1, 0.30, [0.3] * 4)]
    assert seeds_main([*map(str, runs), "--paired", "opd", "--paired", "eopd"]) == 0
    out = capsys.readouterr().out
    assert "| loss | seeds 0 / 1: Avg@4 | Pass@4 | variants Avg@4 |" in out
    assert "| eopd | 0.400 / 0.200 | 0.800 / 0.400 | 0.400 / 0.200 | 0.50 / 0.50 | 10% / 10% | 500-501 |" in out
    # eopd - opd: +0.10 (seed 0), -0.05 (seed 1); kd - opd: +0.20, +0.05, ahead in every seed: bold
    assert "| eopd − opd | +2.5 (+10.0, -5.0) | +5.0 (+20.0, -10.0) | +2.5 (+10.0, -5.0) |" in out
    assert "| kd − opd | **+12.5 (+20.0, +5.0)** |" in out
    assert "| opd − eopd | -2.5 (-10.0, +5.0) |" in out
    # 4 iterations: first quarter = the first, last quarter = the last
    assert "| eopd | 2.00→1.70 / 2.00→1.70 | 1.50→1.20 / 1.50→1.20 | 0.30 / 0.30 | 1.00 / 1.00 |" in out
    assert seeds_main([*map(str, runs), "--paired", "edpo"]) == 0
    captured = capsys.readouterr()
    assert "minus edpo" not in captured.out and "--paired edpo: no run of that variant here" in captured.err
    assert seeds_main([str(tmp_path / "missing")]) == 2

def test_experiment_figures_written(tmp_path):
    from eopd_trainer.eval.experiment_figures import band, main as figures_main

    assert band([[1.0, 2.0, 3.0], [3.0, 4.0]]) == ([2.0, 3.0], [1.0, 2.0], [3.0, 4.0])
    runs = [fake_run(tmp_path / f"{v}{s}", v, s, 0.3 + 0.05 * s, [0.4, 0.3, 0.2]) for v in ("eopd", "opd") for s in (0, 1)]
    assert figures_main([*map(str, runs), "--out", str(tmp_path / "figs"), "--prefix", "exp_"]) == 0
    names = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert names == ["exp_entropy_histograms.png", "exp_entropy_share.png", "exp_pass_at_k.png", "exp_training.png"]
    assert all((tmp_path / "figs" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
    assert figures_main([str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2


def test_entropy_histograms_pool_counts_per_loss_and_shared_model():
    from eopd_trainer.eval.experiment_figures import pooled_histograms

    def models(teacher, final):
        return {"teacher": {"entropy_bins": [0, 1, 2], "entropy_hist_student": teacher},
                "final": {"entropy_bins": [0, 1, 2], "entropy_hist_student": final}, "initial": {"avg_at_k": 0.1}}

    edges, shares = pooled_histograms([("eopd", models([3, 1], [1, 1])), ("eopd", models([0, 4], [2, 0])),
                                       ("opd", {"final": {"entropy_bins": [0, 1, 2], "entropy_hist_student": [9, 1]}})])
    assert edges == [0, 1, 2]
    # counts summed before dividing: the teacher 3+0, 1+4 of 8; eopd's finals 1+2, 1+0 of 4
    assert shares == {"teacher": [3 / 8, 5 / 8], "eopd": [3 / 4, 1 / 4], "opd": [0.9, 0.1]}
    with pytest.raises(ValueError, match="entropy bins differ"):
        pooled_histograms([("a", models([1, 1], [1, 1])), ("b", {"final": {"entropy_bins": [0, 2, 4],
                                                                               "entropy_hist_student": [1, 1]}})])


def test_gkd_lambdas_and_warmup_are_separate_rows(tmp_path, capsys):
    """Runs of one loss.variant at different GKD lambdas, or after a KD warm-up, are different
    columns of the paper's tables: grouped by the name scripts/experiment.sh gives them."""
    from eopd_trainer.eval.run_files import loss_label

    assert loss_label({"loss": {"variant": "gkd", "gkd_lambda": 0.5}}) == "gkd0.5"
    assert loss_label({"loss": {"variant": "eopd"}, "train": {"warmup_kd_iterations": 4}}) == "eopd+warmup4"
    assert loss_label({"loss": {"variant": "kd"}, "train": {"warmup_kd_iterations": 0}}) == "kd"
    # teacher modifiers (issue 32), as scripts/experiment.sh names them
    template = {"model": "smollm2-135m", "prompt_template": "{prompt}\nThe answer is {answer}."}
    assert loss_label({"loss": {"variant": "eopd"}, "teacher": template, "student": {"model": "/r/student-init"}}) == "eopd+privileged"
    own = {"model": "/r/student-init", "prompt_template": "{prompt} {answer}"}
    assert loss_label({"loss": {"variant": "eopd"}, "teacher": own, "student": {"model": "/r/student-init"}}) == "eopd+self"
    routed = {"field": "kind", "routes": {"more": "hinted"}, "default": "teacher", "mixture": {}}
    assert loss_label({"loss": {"variant": "eopd"}, "route": routed, "train": {"warmup_kd_iterations": 4}}) == "eopd+routed+warmup4"
    assert loss_label({"loss": {"variant": "eopd"}, "route": {"mixture": {"teacher": 0.5, "hinted": 0.5}}}) == "eopd+mixture"
    assert loss_label({"loss": {"variant": "eopd"}, "teacher": {"model": "smollm2-135m", "prompt_template": ""},
                       "route": {"field": "", "routes": {}, "mixture": {}}}) == "eopd"
    runs = []
    for name, lam, avg in (("g5", 0.5, 0.2), ("g8", 0.8, 0.3)):
        run = fake_run(tmp_path / name, "gkd", 0, avg, [0.3] * 4)
        (run / "run.yaml").write_text(f"loss: {{variant: gkd, gkd_lambda: {lam}}}\nseed: 0\n")
        runs.append(run)
    assert main([str(r) for r in runs]) == 0
    out = capsys.readouterr().out
    assert "| gkd0.5 / final | 1 | 0.200 |" in out and "| gkd0.8 / final | 1 | 0.300 |" in out


def test_teacher_generated_share_is_the_mean_over_iterations(tmp_path, capsys):
    run = fake_run(tmp_path / "g", "gkd", 0, 0.3, [0.3] * 4)
    (run / "run.yaml").write_text("loss: {variant: gkd, gkd_lambda: 0.5}\nseed: 0\n")
    (run / "train_metrics.jsonl").write_text("".join(
        json.dumps({"kind": "iteration", "iteration": i + 1, "iter/teacher_origin_frac": f}) + "\n"
        for i, f in enumerate([0.25, 0.5, 0.75, 0.5])))
    assert main([str(run)]) == 0
    assert "| gkd0.5 | 1 | – | – | – | 0.500 | 500.000 | 700.000 |" in capsys.readouterr().out


def test_every_loss_has_its_own_colour_and_none_is_the_initial_students_grey():
    from matplotlib.colors import to_rgb

    from eopd_trainer.eval.experiment_figures import colours

    names = [f"v{i}" for i in range(12)]
    c = colours(["teacher", "initial"], ["teacher", *names])
    assert to_rgb(c["teacher"]) == (0.0, 0.0, 0.0) and c["initial"] == "dimgrey"
    rgb = [to_rgb(c[n]) for n in names]
    assert len(set(rgb)) == len(names)
    assert not any(r == g == b for r, g, b in rgb)  # no grey among the losses
