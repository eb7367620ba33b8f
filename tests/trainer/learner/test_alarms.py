"""Issue 48, ask 4: the alarms' pure logic (learner/alarms.py), their place in the iteration
records, `eopd run`'s progress line and `eopd report`, and `train.stop_on`'s validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eopd_trainer.config import ConfigError, load_config
from eopd_trainer.eval.report_alarms import alarms_section, run_alarms
from eopd_trainer.job.progress import Progress
from eopd_trainer.learner.alarms import ALARMS, Alarm, check_alarms, entropy_band, stop_reason
from eopd_trainer.learner.records import IterationLog

CONFIGS = Path(__file__).resolve().parents[3] / "configs"

HEALTHY = {"loss": 0.3, "pg_loss": -0.1, "fkl_loss": 0.4, "topk_rkl_loss": 0.0, "divergence_loss": 0.0,
           "student_entropy": 1.6, "teacher_entropy": 1.2, "truncated_frac": 0.25}


def names(summary):
    return [a.name for a in check_alarms(summary)]


def test_healthy_iteration_raises_nothing():
    assert check_alarms(HEALTHY) == []
    assert check_alarms({}) == []  # nothing measured, nothing to say


def test_the_collapse_of_issue_48_raises_every_alarm():
    """eopd_topk_rkl before the tail bucket, iteration 17-32: loss -0.034, student 7.3 nats against
    a teacher at 2.7, every answer at the 16-token limit."""
    collapse = {**HEALTHY, "pg_loss": 0.0, "fkl_loss": 0.01, "topk_rkl_loss": -0.044, "loss": -0.034,
                "student_entropy": 7.3, "teacher_entropy": 2.7, "truncated_frac": 1.0}
    alarms = check_alarms(collapse)
    assert [a.name for a in alarms] == list(ALARMS)
    assert "topk_rkl_loss -0.044" in alarms[0].message
    assert "7.300" in alarms[1].message and "[0.850, 6.400]" in alarms[1].message
    assert "100%" in alarms[2].message


def test_negative_divergence_reads_the_divergence_terms_only():
    assert names({**HEALTHY, "pg_loss": -3.0, "loss": -2.0}) == []  # the surrogate may be negative
    assert names({**HEALTHY, "fkl_loss": -5e-5}) == []  # rounding
    for key in ("fkl_loss", "topk_rkl_loss", "divergence_loss"):
        assert names({**HEALTHY, key: -0.01}) == ["negative_divergence"]


@pytest.mark.parametrize("teacher", [0.0, 0.8, 2.7])
def test_entropy_band_edges(teacher):
    lo, hi = entropy_band(teacher)
    assert (lo, hi) == (teacher / 2 - 0.5, 2 * teacher + 1)
    for h, fires in ((hi, False), (hi + 1e-3, True), (max(lo, 0.0), False), (lo - 1e-3, lo - 1e-3 >= 0)):
        if h < 0:
            continue
        assert (names({"student_entropy": h, "teacher_entropy": teacher}) == ["entropy_band"]) == fires


def test_truncation_when_nearly_every_response_is_cut():
    assert names({"truncated_frac": 0.81}) == []  # a healthy far-student iteration (docs/results/runs-far/gkd1.0-s2)
    assert names({"truncated_frac": 0.9}) == ["truncation"]


def test_stop_reason_takes_the_first_listed_alarm():
    alarms = [Alarm("entropy_band", "too broad"), Alarm("truncation", "all long")]
    assert stop_reason(alarms, [], 3) is None
    assert stop_reason(alarms, ["truncation"], 3) == "train.stop_on: alarm truncation at iteration 3: all long"
    assert stop_reason(alarms, ["truncation", "entropy_band"], 3).startswith("train.stop_on: alarm entropy_band")


def test_stop_on_is_validated_by_name():
    assert load_config(CONFIGS / "tiny.yaml").train.stop_on == []
    cfg = load_config(CONFIGS / "tiny.yaml", ["train.stop_on=[truncation,entropy_band]"])
    assert cfg.train.stop_on == ["truncation", "entropy_band"]
    with pytest.raises(ConfigError, match="stop_on"):
        load_config(CONFIGS / "tiny.yaml", ["train.stop_on=[entropy]"])


def _iteration_records(alarming: bool):
    step = {**HEALTHY, **({"student_entropy": 9.0} if alarming else {})}
    stats = {"queue_backlog": 0, "staleness_mean": 0.0, "staleness_max": 0.0, "truncated_frac": 0.0}
    return IterationLog.records(4, [step, step], stats, 1.0, 2.0, 8, stage="eopd")


def test_iteration_record_carries_its_alarms():
    assert "alarms" not in _iteration_records(False)[-1][2]
    extra = _iteration_records(True)[-1][2]
    assert list(extra["alarms"]) == ["entropy_band"] and extra["kind"] == "iteration"
    json.dumps(extra)  # written as is into train_metrics.jsonl


def _write_metrics(path: Path, alarming_iterations: list[int], stop: str | None):
    with path.open("w") as fh:
        for it in range(1, 4):
            step, values, extra = _iteration_records(it in alarming_iterations)[-1]
            fh.write(json.dumps({"step": step, **{**extra, "iteration": it}, **values}) + "\n")
        if stop:
            fh.write(json.dumps({"step": 9, "iteration": 3, "kind": "stop", "reason": stop}) + "\n")


def test_progress_warns_once_per_alarm_and_keeps_the_stop_reason(tmp_path, capsys):
    path = tmp_path / "train_metrics.jsonl"
    _write_metrics(path, [2, 3], "train.stop_on: alarm entropy_band at iteration 3: x")
    progress = Progress(path, total=3)
    progress.close()
    err = capsys.readouterr().err
    assert err.count("alarm entropy_band") == 1 and "iteration 2: alarm entropy_band" in err
    assert progress.stopped_by == "train.stop_on: alarm entropy_band at iteration 3: x"
    assert progress.done == 3


def test_report_lists_the_alarms_and_the_stop(tmp_path):
    quiet, loud = tmp_path / "quiet", tmp_path / "loud"
    for d in (quiet, loud):
        d.mkdir()
    _write_metrics(quiet / "train_metrics.jsonl", [], None)
    _write_metrics(loud / "train_metrics.jsonl", [2, 3], "train.stop_on: alarm entropy_band at iteration 3: x")
    assert "No alarm fired" in alarms_section([quiet])
    fired, stopped = run_alarms(loud)
    assert [i for i, _ in fired["entropy_band"]] == [2, 3] and stopped.startswith("train.stop_on")
    html = alarms_section([quiet, loud])
    assert "entropy_band" in html and "2, 3" in html and "stopped" in html
