"""bench/e2e_time_split.py: the head-to-head's time split, on hand-written records (pure logic; the
records' real producers are checked in tests/trainer/job/test_run_e2e.py and the TRL tier)."""

from __future__ import annotations

import pytest

from bench import e2e_time_split as ts


def _iteration(i: int, t: float, iteration_s: float, collect_s: float, steps_s: float, checkpoint_s: float = 0.0) -> dict:
    return {"kind": "iteration", "iteration": i, "step": i, "time": t, "iter/iteration_s": iteration_s,
            "iter/collect_s": collect_s, "iter/steps_s": steps_s, "iter/checkpoint_s": checkpoint_s}


def test_worker_times_reads_the_last_done_line():
    log = ("x\nworker w0 done: 3 rollouts published; sampling 1.00 s in 2 rounds, weight loads 0.50 s in 1\n"
           "worker w0 done: 8 rollouts published; sampling 12.25 s in 8 rounds, weight loads 3.50 s in 7\n")
    assert ts.worker_times(log) == (12.25, 3.5)
    with pytest.raises(ValueError, match="sampling S s"):
        ts.worker_times("worker w0 done: 8 rollouts published\n")


def test_eopd_split_phases_sum_to_the_training_clock():
    launched = 1000.0
    records = [{"kind": "step", "step": 1, "time": 1010.0},
               _iteration(1, 1020.0, 10.0, 6.0, 3.0),  # started at 1010: 10 s of start-up
               _iteration(2, 1032.0, 12.0, 5.0, 4.0, checkpoint_s=2.0)]
    split = ts.eopd_split(records, launched, sampling_s=7.0, weight_load_s=1.5)
    assert split["start_s"] == pytest.approx(10.0)
    assert split["learner_steps_s"] == pytest.approx(7.0) and split["collect_s"] == pytest.approx(11.0)
    assert split["publish_s"] == pytest.approx(22.0 - 11.0 - 7.0 - 2.0)
    assert split["teacher_and_handoff_s"] == pytest.approx(11.0 - 7.0 - 1.5)
    assert split["optimizer_steps"] == 2 and split["iterations"] == 2
    # start-up + the iterations less the checkpoint writes: the training clock of the last checkpoint
    clock = 1032.0 - launched - 2.0
    assert ts._total(split) == pytest.approx(clock)
    with pytest.raises(ValueError, match="before the time split"):
        ts.eopd_split([{k: v for k, v in records[1].items() if k != "iter/steps_s"}], launched, 0.0, 0.0)


def test_trl_split_and_the_table():
    timeline = {"train_started": 1005.0, "global_step": 2,
                "checkpoints": [{"step": 2, "time": 1030.0, "saved_s_before": 1.0}],
                "time_split": {"generate": {"s": 8.0, "calls": 2}, "teacher_forward": {"s": 4.0, "calls": 2}}}
    trl = ts.trl_split(timeline, launched=1000.0)
    assert trl == {"system": "trl", "optimizer_steps": 2, "start_s": 5.0, "generate_s": 8.0, "teacher_forward_s": 4.0,
                   "student_step_s": pytest.approx(24.0 - 12.0)}
    assert ts._total(trl) == pytest.approx(1030.0 - 1.0 - 1000.0)
    eopd = ts.eopd_split([_iteration(1, 1020.0, 10.0, 6.0, 3.0), _iteration(2, 1032.0, 12.0, 5.0, 4.0)], 1000.0, 7.0, 1.5)
    text = ts.table(eopd, trl)
    assert "| **total** | **16.00** | **14.50** | **+1.50** (1.10x) |" in text
    assert "| the student's forward, loss, backward, optimizer step | 3.50 | 6.00 | -2.50 |" in text
    with pytest.raises(ValueError, match="GKD's time split"):
        ts.trl_split({**timeline, "time_split": {}}, 1000.0)


def test_section_pairs_by_seed_and_machine():
    def run(system, seed, boot, split):
        return {"system": system, "seed": seed, "machine": {"boot_id": boot, "cpu": "X"}, "time_split": split}
    eopd = ts.eopd_split([_iteration(1, 1020.0, 10.0, 6.0, 3.0)], 1000.0, 4.0, 1.0)
    trl = {"system": "trl", "optimizer_steps": 1, "start_s": 5.0, "generate_s": 4.0, "teacher_forward_s": 2.0,
           "student_step_s": 3.0}
    runs = [run("trl-gkd", 0, "aaaaaaaa-1", trl), run("eopd-trl-gkd", 0, "aaaaaaaa-1", eopd),
            run("eopd-gkd", 0, "bbbbbbbb-1", eopd), run("eopd-rkl-full", 1, "aaaaaaaa-1", eopd)]
    assert [(a["system"], b["system"]) for a, b in ts.pairs(runs)] == [("eopd-trl-gkd", "trl-gkd")]
    text = ts.section_text(runs)
    assert "**eopd-trl-gkd**, seed 0" in text and "eopd-gkd" not in text
    assert ts.section_text(runs[1:]).endswith("No run pair with a time split yet.")


def test_an_async_run_keeps_the_overlapped_seconds_off_its_clock():
    """mode: async (the worker samples while the learner steps): the wait less the sampling once gave
    eopd-trl-gkd-async's seed 0 a teacher share of -320 s; now the sampling and the weight loads are
    beside the clock, the learner's wait stands on the teacher's row, and the total is still the clock."""
    launched = 1000.0
    records = [_iteration(1, 1020.0, 10.0, 1.0, 8.0), _iteration(2, 1030.0, 10.0, 0.5, 9.0)]
    split = ts.eopd_split(records, launched, sampling_s=15.0, weight_load_s=2.0, mode="async")
    assert split["mode"] == "async" and split["teacher_and_handoff_s"] is None
    assert ts._total(split) == pytest.approx(1030.0 - launched)  # start 10 + wait 1.5 + steps 17 + publish 1.5
    trl = {"system": "trl", "optimizer_steps": 2, "start_s": 5.0, "generate_s": 8.0, "teacher_forward_s": 4.0,
           "student_step_s": 12.0}
    text = ts.table(split, trl)
    assert "| sampling the student's responses | (7.50 beside) | 4.00 | -4.00 |" in text
    assert "async: the learner's wait for a scored batch" in text and "| 0.75 | 2.00 | -1.25 |" in text
    assert "| publishing the new weights (learner) and loading them (sampler) | 0.75 (1.00 beside) | - | +0.75 |" in text
    assert "| **total** | **15.00** | **14.50** | **+0.50** (1.03x) |" in text
    assert ts.eopd_split(records, launched, 15.0, 2.0)["teacher_and_handoff_s"] == pytest.approx(1.5 - 17.0)  # sync
    with pytest.raises(ValueError, match="mode must be"):
        ts.eopd_split(records, launched, 15.0, 2.0, mode="overlap")
    runs = [{"system": s, "seed": 0, "machine": {"boot_id": "aaaaaaaa", "cpu": "X"}, "time_split": x}
            for s, x in (("trl-gkd", trl), ("eopd-trl-gkd-async", split))]
    assert "**eopd-trl-gkd-async**, seed 0, on X (boot aaaaaaaa, ? GFLOP/s), 2 iterations, async mode:" in ts.section_text(runs)
