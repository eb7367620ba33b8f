"""`eopd run` end to end with the eopd_topk_rkl loss (issue 19, tiny preset, real processes): the
worker takes the student's top-k ids from its old-log-prob pass, the teacher scores them as
per-position candidates, the rollouts carry them and the learner trains on the exact top-k
reverse KL + the gated forward KL."""

from __future__ import annotations

import json

import pytest

from tests.trainer.job.test_run_e2e import TINY, eopd

pytestmark = pytest.mark.integration


def test_tiny_run_with_the_topk_rkl_variant(tmp_path):
    run_dir = tmp_path / "run"
    res = eopd("run", "--config", str(TINY), f"run_dir={run_dir}", "train.iterations=2", "eval.enabled=false",
               "loss.variant=eopd_topk_rkl", "loss.candidate_k=8")
    assert res.returncode == 0, res.stderr[-5000:]
    rows = [json.loads(line) for line in (run_dir / "train_metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("kind") == "step"]
    assert [r["iteration"] for r in rows if r.get("kind") == "iteration"] == [1, 2]
    for r in steps:
        # the reverse KL comes from the candidates (no sampled-token surrogate), plus the gated FKL
        assert r["pg_loss"] == 0.0 and r["topk_rkl_loss"] > 0.0
        assert r["loss"] == pytest.approx(r["topk_rkl_loss"] + r["fkl_loss"], rel=1e-6)
    learner = (run_dir / "logs" / "learner.log").read_text()
    assert "training finished: 2 iterations, 16 rollouts trained" in learner
    assert "dead letter" not in learner
