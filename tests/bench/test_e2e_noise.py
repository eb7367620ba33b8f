"""bench/e2e_noise.py: the head-to-head's noise arithmetic (pure) and its section from a small archive
written here."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from bench import e2e_noise
from bench.e2e_noise import gap, grading_se, rows, seeds_needed, section_text, system_noise, t975


def test_grading_se_is_the_binomial_error_of_the_per_problem_means():
    assert grading_se([8, 0, 8, 0], 8) == 0.0  # every problem always or never right: no sampling error
    # one problem, 4 of 8 right: unbiased variance of its mean 4 * 4 / (64 * 7)
    assert grading_se([4], 8) == pytest.approx(math.sqrt(16 / (64 * 7)))
    counts = [3, 5, 8, 1]
    naive = math.sqrt(sum(statistics.variance([1] * c + [0] * (8 - c)) / 8 for c in counts)) / len(counts)
    assert grading_se(counts, 8) == pytest.approx(naive)


def test_gap_is_welchs_interval():
    a, b = [0.50, 0.46, 0.52], [0.44, 0.47, 0.40]
    g = gap(a, b)
    va, vb = statistics.variance(a) / 3, statistics.variance(b) / 3
    assert g["diff"] == pytest.approx(statistics.mean(a) - statistics.mean(b))
    assert g["se"] == pytest.approx(math.sqrt(va + vb))
    assert g["df"] == pytest.approx((va + vb) ** 2 / (va**2 / 2 + vb**2 / 2))
    assert g["half"] == pytest.approx(t975(g["df"]) * g["se"])
    assert t975(2.9) == 4.303 and t975(1000) == 1.96  # rounded down; normal beyond the table


def test_seeds_needed_for_a_three_point_interval():
    assert seeds_needed(0.05, 0.05) == math.ceil(1.96**2 * 0.005 / 0.0009)
    assert seeds_needed(0.0, 0.0) == 2


def _run(system, seed, accs, timed="2026-12-01T00:00:00"):
    return {"system": system, "seed": seed, "machine": {"timed_at": timed},
            "checkpoints": [{"label": f"c{i}", "train_s": 10.0 * i, "heldout": {"avg_at_k": a}} for i, a in enumerate(accs)]}


def test_section_from_an_archive(tmp_path):
    runs = [_run("trl-gkd", s, a) for s, a in enumerate(([0.40, 0.46], [0.45, 0.50], [0.50, 0.56]))]
    runs += [_run("eopd-trl-gkd", s, a) for s, a in enumerate(([0.50, 0.44], [0.52, 0.47], [0.55, 0.50]))]
    runs.append(_run("eopd-trl-gkd", 0, [0.1, 0.1], timed="2026-11-01T00:00:00"))  # older: ignored
    for r in runs[:6]:
        d = tmp_path / f"{r['system']}-s{r['seed']}"
        d.mkdir()
        (d / "eval.json").write_text(json.dumps({"models": {"c1": {"correct_per_prompt": [4, 8, 0, 2]}}}))
    noise = system_noise(runs, tmp_path, 8)
    assert noise["eopd-trl-gkd"]["final"] == [0.44, 0.47, 0.50] and noise["eopd-trl-gkd"]["previous"] == [0.50, 0.52, 0.55]
    assert noise["trl-gkd"]["grading_se"] == [grading_se([4, 8, 0, 2], 8)] * 3
    rs = rows(noise, "trl-gkd")
    assert [r["system"] for r in rs] == ["trl-gkd", "eopd-trl-gkd"]
    assert rs[1]["gap"]["diff"] == pytest.approx(0.47 - 0.5067, abs=1e-3)
    assert rs[1]["change"] == pytest.approx([-0.06, -0.05, -0.05])
    text = section_text(rs, "trl-gkd", 8, 4)
    assert "| TRL GKDTrainer (in-process teacher) | 3 | 0.507 |" in text
    assert "every seed fell over the last 16 steps (-6.0, -5.0, -5.0 points" in text
    assert "1 of 1 gaps have a 95% interval wider than ±3 points" in text


def test_main_prints_the_published_archive(capsys):
    assert e2e_noise.main([]) == 0
    out = capsys.readouterr().out
    assert "## Head to head: how large a gap three seeds can see" in out and "| TRL GKDTrainer" in out
