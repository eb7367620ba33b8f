"""`eopd run` notices when a run goes wrong (issue 48, ask 4; tiny preset, real processes): the tiny
random student never stops before the length limit, so the truncation alarm fires at iteration 1;
it is shown on the progress output, written into the metrics, and with `train.stop_on` the learner
stops the run there with the alarm as the reason, which `eopd run` reports and records."""

from __future__ import annotations

import json

import pytest

from eopd_trainer.learner.alarms import TRUNCATED_SHARE

from tests.trainer.job.test_run_e2e import TINY, eopd

pytestmark = pytest.mark.integration


def test_stop_on_stops_a_tiny_run_with_the_alarm_as_the_reason(tmp_path):
    run_dir = tmp_path / "run"
    res = eopd("run", "--config", str(TINY), f"run_dir={run_dir}", "train.iterations=3", "eval.enabled=false",
               "train.stop_on=[truncation]")
    assert res.returncode == 1, res.stderr[-5000:]
    assert "warning: iteration 1: alarm truncation:" in res.stderr
    assert "stopped: train.stop_on: alarm truncation at iteration 1:" in res.stderr
    rows = [json.loads(line) for line in (run_dir / "train_metrics.jsonl").read_text().splitlines()]
    iterations = [r for r in rows if r.get("kind") == "iteration"]
    assert [r["iteration"] for r in iterations] == [1]  # stopped before iteration 2
    assert iterations[0]["iter/truncated_frac"] >= TRUNCATED_SHARE and "truncation" in iterations[0]["alarms"]
    stop = [r for r in rows if r.get("kind") == "stop"]
    assert len(stop) == 1 and stop[0]["reason"].startswith("train.stop_on: alarm truncation at iteration 1")
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert "train.stop_on: alarm truncation" in summary["invocations"][-1]["outcome"]
    learner = (run_dir / "logs" / "learner.log").read_text()
    assert "stopping the run: train.stop_on: alarm truncation" in learner
