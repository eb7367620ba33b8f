"""`eopd run` end to end (tiny preset, real processes: redis-server, teacher, worker, DeepSpeed
learner, then the evaluation) for the off-policy and graded data paths: kd (the teacher generates
every response), gkd at lambda 0.5 (a deterministic per-sample draw decides who generates), grpo
(graded by the task grader; no teacher process at all), and eopd after a one-iteration KD warm-up
(with privileged teacher context: teacher.prompt_template).
Each checks the iterations' stages, the share of teacher-generated rollouts the learner trained
(`iter/teacher_origin_frac`, from the decoded rollouts' origin), the number trained, and eval.json."""

from __future__ import annotations

import json

import pytest
from tests.trainer.job.test_run_e2e import TINY, eopd

pytestmark = pytest.mark.integration

B = 8  # tiny: train.batch_size; n_samples 2 -> 4 tasks per iteration


def run_tiny(tmp_path, *overrides: str, iterations: int = 2):
    run_dir = tmp_path / "run"
    res = eopd("run", "--config", str(TINY), f"run_dir={run_dir}", f"train.iterations={iterations}", *overrides,
               timeout=1200)  # a loaded 2-core machine: the learner's DeepSpeed start alone took minutes
    assert res.returncode == 0, res.stderr[-5000:]
    rows = [json.loads(line) for line in (run_dir / "train_metrics.jsonl").read_text().splitlines()]
    iters = [r for r in rows if r.get("kind") == "iteration"]
    assert [r["iteration"] for r in iters] == list(range(1, iterations + 1))
    learner = (run_dir / "logs" / "learner.log").read_text()
    assert f"training finished: {iterations} iterations, {iterations * B} rollouts trained" in learner
    assert "dead letter" not in learner
    assert (run_dir / "eval.json").is_file() and json.loads((run_dir / "eval.json").read_text())["models"]
    return run_dir, res, iters, rows


def test_grpo_runs_without_a_teacher_process(tmp_path):
    run_dir, res, iters, rows = run_tiny(tmp_path, "loss.variant=grpo", "eval.models=[teacher,final]")
    assert not (run_dir / "logs" / "teacher.log").exists()  # no teacher process was started
    assert "no teacher process started" in res.stderr and "used for evaluation only" in res.stderr
    assert "teacher starting on" not in res.stderr
    worker = (run_dir / "logs" / "rollout-w0.log").read_text()
    assert "needs no teacher" in worker
    for r in iters:
        assert r["stage"] == "grpo" and r["iter/teacher_origin_frac"] == 0.0
        assert 0.0 <= r["iter/reward_mean"] <= 1.0  # the share of trained samples the grader found right
    for r in (r for r in rows if r.get("kind") == "step"):
        assert r["fkl_loss"] == 0.0 and r["loss"] == pytest.approx(r["pg_loss"], abs=1e-6)
    assert set(json.loads((run_dir / "eval.json").read_text())["models"]) == {"teacher", "final"}


def test_kd_trains_on_teacher_generated_responses(tmp_path):
    run_dir, res, iters, _ = run_tiny(tmp_path, "loss.variant=kd", "eval.models=[final]")
    for r in iters:
        assert r["stage"] == "kd" and r["iter/teacher_origin_frac"] == 1.0 and r["iter/staleness_max"] == 0.0
        # no policy-gradient term, no behaviour-policy ratio: no clip fraction or approx KL to report
        assert not {"iter/clip_frac", "iter/ratio_mean", "iter/approx_kl"} & set(r), sorted(r)


def test_gkd_mixes_teacher_and_student_samples_as_drawn(tmp_path):
    from eopd_trainer.config.stages import teacher_samples

    run_dir, res, iters, _ = run_tiny(tmp_path, "loss.variant=gkd", "loss.gkd_lambda=0.5", "eval.models=[final]")
    for r in iters:  # sync: iteration i trains tasks 4(i-1) .. 4i-1 (no replacement: no dead letter above)
        seqs = range(4 * (r["iteration"] - 1), 4 * r["iteration"])
        expected = sum(teacher_samples(0.5, seed=0, task_seq=s, num_samples=2) for s in seqs) / B
        assert r["stage"] == "gkd" and r["iter/teacher_origin_frac"] == pytest.approx(expected)


def test_eopd_after_a_kd_warmup_with_privileged_teacher_context(tmp_path):
    """A one-iteration KD warm-up, then eopd, with teacher.prompt_template (issue 32 ask 3): the
    teacher generates the warm-up's responses and scores the student's after its own prompt, which
    holds the answer; every rollout is trained (none dead-lettered). The scores' exactness is
    tests/trainer/rollout/test_teacher_context.py's; the plain teacher's Generate is test_kd_*'s."""
    template = json.dumps("{prompt}\nThe correct final answer is {answer}.")
    run_dir, res, iters, _ = run_tiny(tmp_path, "train.warmup_kd_iterations=1", "eval.models=[final]",
                                      f"teacher.prompt_template={template}", iterations=3)
    assert [r["stage"] for r in iters] == ["kd-warmup", "eopd", "eopd"]
    assert [r["iter/teacher_origin_frac"] for r in iters] == [1.0, 0.0, 0.0]
    assert ["iter/clip_frac" in r for r in iters] == [False, True, True]  # the ratio from the eopd stage on
    assert "stage=kd-warmup" in res.stderr or "kd-warmup" in (run_dir / "logs" / "learner.log").read_text()
    worker = (run_dir / "logs" / "rollout-w0.log").read_text()
    assert ("teacher.prompt_template: the teacher sees its own prompt, e.g. 'What is 26 + 28?\\nThe correct final "
            "answer is 54.'") in worker
    res = eopd("report", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "kd-warmup (iterations 1-1" in (run_dir / "report.html").read_text()


def test_a_record_without_a_template_field_is_refused_before_any_process(tmp_path):
    run_dir = tmp_path / "run"
    res = eopd("run", "--config", str(TINY), f"run_dir={run_dir}", 'teacher.prompt_template="{prompt} {solution}"')
    assert res.returncode == 2, res.stderr[-3000:]
    assert "tiny_prompts.jsonl:1: teacher.prompt_template uses {solution} and the record has no field 'solution'" in res.stderr
    assert not (run_dir / "logs" / "teacher.log").exists()
