"""The toy experiment (paper sec. 3.2): the command end to end, determinism, and its pieces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eopd_trainer import toy
from eopd_trainer.toy import ToyConfig, capacity_limited, main, run_toy

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def toy_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("toy")
    assert main(["--seeds", "3", "--out", str(out)]) == 0
    return out


def test_command_writes_results_with_the_named_keys(toy_out: Path):
    res = json.loads((toy_out / "toy_results.json").read_text())
    steps = res["config"]["steps"]
    assert res["config"]["seeds"] == [0, 1, 2]
    for sc in ("A", "B"):
        e = res["scenarios"][sc]
        for key in ("top1_change_count_mean", "top1_change_count_std", "teacher_entropy", "top10_change_rate"):
            assert key in e, key
        assert len(e["top10_change_rate"]) == steps
        assert all(0.0 <= r <= 1.0 for r in e["top10_change_rate"])
        assert len(e["top1_change_counts"]) == 3
        assert e["top1_change_count_mean"] == pytest.approx(np.mean(e["top1_change_counts"]))
        assert e["top1_change_count_std"] == pytest.approx(np.std(e["top1_change_counts"]))
        assert {"top1_change_count_mean", "top10_change_rate"} <= set(e["eopd"])
    assert res["scenarios"]["A"]["temperature"] == 0.3 and res["scenarios"]["B"]["temperature"] == 1.0


def test_high_entropy_teacher_is_unstable_under_reverse_kl(toy_out: Path):
    """Table 1's finding: scenario B's top-1 changes far more often than A's, and B's top-10 set
    never settles while A's does."""
    sc = json.loads((toy_out / "toy_results.json").read_text())["scenarios"]
    a, b = sc["A"], sc["B"]
    assert b["teacher_entropy"] > a["teacher_entropy"]
    assert b["top1_change_count_mean"] > 5 * a["top1_change_count_mean"]
    assert min(b["top1_change_counts"]) > max(a["top1_change_counts"])
    assert b["top10_change_rate_tail_mean"] > 5 * a["top10_change_rate_tail_mean"]


def test_eopd_recovers_the_teachers_top10_in_scenario_b(toy_out: Path):
    b = json.loads((toy_out / "toy_results.json").read_text())["scenarios"]["B"]
    assert b["eopd"]["fkl_applied"]
    assert b["eopd"]["final_top10_overlap_mean"] > b["final_top10_overlap_mean"]
    assert b["eopd"]["top10_change_rate_tail_mean"] < b["top10_change_rate_tail_mean"]
    assert b["eopd"]["final_fkl_mean"] < b["final_fkl_mean"]


def test_tau_between_the_teacher_entropies_gates_b_only(toy_out: Path):
    """The tau_mid run (3.0, between A's ~2.1 and B's ~3.9 nats): A gets no FKL, so it is the
    reverse-KL run exactly; B gets it, so it is the tau = 0.8 EOPD run exactly (the toy's update
    depends on tau only through the gate)."""
    res = json.loads((toy_out / "toy_results.json").read_text())
    tau_mid = res["config"]["tau_mid"]
    a, b = res["scenarios"]["A"], res["scenarios"]["B"]
    assert max(a["teacher_entropy_per_seed"]) < tau_mid < min(b["teacher_entropy_per_seed"])
    assert a["eopd_tau_mid"]["tau"] == tau_mid and a["eopd"]["tau"] == res["config"]["tau"]
    assert a["eopd_tau_mid"]["fkl_applied_per_seed"] == [False] * 3
    assert b["eopd_tau_mid"]["fkl_applied_per_seed"] == [True] * 3
    per_run = ("top1_change_counts", "top10_change_rate_per_seed", "final_fkl_mean", "final_top10_overlap_mean")
    for key in per_run:
        assert a["eopd_tau_mid"][key] == a[key], key
        assert b["eopd_tau_mid"][key] == b["eopd"][key], key
    assert a["eopd"]["top1_change_counts"] != a["top1_change_counts"]  # at tau = 0.8, A is gated


def test_tau_mid_option():
    cfg = ToyConfig(steps=40, tau_mid=100.0)
    results, runs = toy.experiment(1, cfg)
    b = results["scenarios"]["B"]
    assert b["eopd_tau_mid"]["fkl_applied_per_seed"] == [False] and b["eopd"]["fkl_applied_per_seed"] == [True]
    assert b["eopd_tau_mid"]["top1_change_counts"] == b["top1_change_counts"]


def test_figures_are_written(toy_out: Path):
    for name in ("toy_top10_change_rate.png", "toy_distributions.png"):
        data = (toy_out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_runs_are_deterministic_and_paired():
    cfg = ToyConfig(steps=60)
    r1, r2 = run_toy(1, 1.0, "rkl", cfg), run_toy(1, 1.0, "rkl", cfg)
    assert r1.top1_changes == r2.top1_changes
    np.testing.assert_array_equal(r1.student_logits, r2.student_logits)
    np.testing.assert_array_equal(r1.top10_change_rate, r2.top10_change_rate)
    # A and B of a seed share the teacher logits: same ranking of the teacher's probabilities
    a = run_toy(1, 0.3, "rkl", cfg)
    np.testing.assert_array_equal(np.argsort(a.teacher_probs), np.argsort(r1.teacher_probs))


def test_eopd_with_a_closed_gate_is_the_reverse_kl_run():
    cfg = ToyConfig(steps=80, tau=100.0)
    rkl, eopd = run_toy(2, 1.0, "rkl", cfg), run_toy(2, 1.0, "eopd", cfg)
    assert not eopd.gated
    np.testing.assert_array_equal(rkl.student_logits, eopd.student_logits)


def test_teacher_construction_and_capacity_limit():
    # the documented draw: z ~ N(0, 1), five random entries set to 1.7 .. 2.5, softmax(z / T)
    rng = np.random.default_rng(4)
    z = rng.standard_normal(80)
    modes = rng.choice(80, size=5, replace=False)
    z[modes] = [1.7, 1.9, 2.1, 2.3, 2.5]
    for temp in (0.3, 1.0):
        r = run_toy(4, temp, "rkl", ToyConfig(steps=1))
        expected = np.exp(z / temp) / np.exp(z / temp).sum()
        np.testing.assert_allclose(r.teacher_probs, expected, rtol=1e-12)
        assert r.teacher_entropy == pytest.approx(-(expected * np.log(expected)).sum())
    p = capacity_limited(np.arange(80, dtype=float), 10)
    assert (p > 0).sum() == 10 and p.sum() == pytest.approx(1.0) and p[70:].all()


def test_bad_method_rejected():
    with pytest.raises(ValueError):
        run_toy(0, 1.0, "sgd")


def test_import_does_no_work():
    code = "import sys, eopd_trainer.toy; assert 'matplotlib' not in sys.modules and 'torch' not in sys.modules"
    src = str(Path(toy.__file__).resolve().parents[1])
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": src, "PATH": ""})


def test_plain_table_without_rich(monkeypatch, capsys):
    results, _ = toy.experiment(2, ToyConfig(steps=30))
    monkeypatch.setitem(sys.modules, "rich.console", None)  # makes `from rich.console import ...` fail
    toy.print_table(results)
    out = capsys.readouterr().out
    assert "(A) Low" in out and "(B) High" in out and "Top-1 changes, RKL" in out
