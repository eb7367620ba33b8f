"""`bench_divergences --quick` (issue 48): one real `eopd run` of a divergence member on the tiny
preset, summarised from its metrics: the entropy band per iteration, the smallest divergence term,
the alarms. The SmolLM2 runs (`python -m bench.bench_divergences`) are the lead's."""

from __future__ import annotations

import json

import pytest

from tests.procs import ROOT

pytestmark = pytest.mark.integration


def test_divergences_quick_on_the_tiny_preset(tmp_path):
    """TRL's objective (gkd, beta 1, the full vocabulary) end to end: the workers ask the teacher for its
    hidden states (bf16, set by the loss alone), the rollouts carry them through Redis, the learner
    fetches the teacher's output head and projects them."""
    from bench.bench_divergences import MEMBERS, main

    assert not any(o.startswith("teacher.hidden_states") for o in MEMBERS["gkd_rkl_full"])  # the loss asks for them
    out = tmp_path / "divergences.json"
    assert main(["--quick", "--members", "gkd_rkl_full", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["preset"] == "tiny.yaml" and data["iterations"] == 1
    (m,) = data["members"]
    assert m["member"] == "gkd_rkl_full" and "error" not in m, m.get("error")
    assert m["iterations"] == 1
    it = m["per_iteration"][0]
    lo, hi = it["band"]
    assert it["teacher_entropy"] > 0 and lo < hi and it["in_band"] == (lo <= it["student_entropy"] <= hi)
    assert m["min_divergence_term"] is not None and m["min_divergence_term"] >= 0  # a true divergence
    assert "truncation" in m["alarms"]  # the tiny random student never stops before the length limit


def test_member_of_reads_the_loss_overrides_a_run_carries():
    from bench.bench_divergences import member_of

    assert member_of({"loss": {"variant": "eopd", "support": "teacher_topk"}}) == "eopd"
    assert member_of({"loss": {"variant": "eopd_rkl", "support": "full"}}) == "eopd_rkl_full"
    assert member_of({"loss": {"variant": "eopd_rkl", "support": "teacher_topk"}}) == "eopd_rkl_teacher"
    assert member_of({"loss": {"variant": "gkd", "gkd_lambda": 1.0, "gkd_beta": 1.0, "support": "full"}}) == "gkd_rkl_full"
    assert member_of({"loss": {"variant": "gkd", "gkd_lambda": 0.5, "gkd_beta": 1.0, "support": "full"}}) is None
    assert member_of({"loss": {"variant": "gkd", "gkd_lambda": 1.0, "gkd_beta": 0.0, "support": "teacher_topk"}}) is None
    assert member_of({}) is None


def test_from_runs_summarises_an_archived_run_without_running_it(tmp_path):
    """The archived SmolLM2 run of `eopd_topk_rkl` (bench/results/divergences-smollm2-s0, 16 iterations):
    its member, seed and numbers come back from its files; a run of no member's loss is named as such."""
    from bench.bench_divergences import main

    archived = ROOT / "bench" / "results" / "divergences-smollm2-s0" / "eopd_topk_rkl"
    other = tmp_path / "gkd-run"
    other.mkdir()
    (other / "run.yaml").write_text("seed: 3\nloss: {variant: kd}\n")
    (other / "train_metrics.jsonl").write_text(json.dumps({"kind": "iteration", "iteration": 1, "iter/student_entropy": 1.0,
                                                           "iter/teacher_entropy": 1.0, "iter/loss": 0.5}) + "\n")
    out = tmp_path / "divergences.json"
    assert main(["--quick", "--from-runs", str(archived), str(other), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    first, second = data["members"]
    assert first["member"] == "eopd_topk_rkl" and first["seed"] == 0 and first["iterations"] == 16
    assert first["all_in_band"] and first["min_divergence_term"] >= 0 and "error" not in first
    assert first["run"] == "bench/results/divergences-smollm2-s0/eopd_topk_rkl"
    assert second["member"] == "?" and "no member's" in second["error"] and second["iterations"] == 1
    assert second["per_iteration"][0]["in_band"]  # band [0, 3] around a teacher at 1 nat
    with pytest.raises(SystemExit):
        main(["--quick", "--from-runs", str(tmp_path / "nothing")])
