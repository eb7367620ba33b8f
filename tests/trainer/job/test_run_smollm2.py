"""The default preset (slow tier), its two claims each on what it needs (issue 50 ask 3: CI time):

- the premise, on the real models: the teacher and the initial student evaluated on the same
  held-out problems, the teacher far above the student it distils into (a change of task, prompt
  or student that breaks this makes the main job unable to show any distillation). It needs no
  training: `eopd prepare` writes the preset's data and builds its pruned 29-layer student, then
  `eopd eval` grades both (the main job's own commands);
- exact resume on this preset's mechanics (the lr schedule with warm-up, the generated data, a
  pruned `student-init` built from its spec, `checkpoint.keep: 1`), on tiny random models of the
  same tokenizer (the claim is about the run's state, not about SmolLM2's weights): every process
  killed during iteration 2 (committed: 1), resumed, evaluated; the weights are those of the
  uninterrupted run (the tiny preset's kill points: test_run_resume.py).

Two iterations of 8 responses (the default loss's 8 prompts x 1 sample), two optimizer steps per
iteration, in sync mode, committed one by one. The compiled statistics path on SmolLM2 is the README's serve
commands' test (tests/teacher/cli/test_cli.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.procs import ROOT
from tests.trainer.job.test_run_resume import WEIGHTS_ATOL, Run, max_weight_difference
from tests.trainer.pipeline_helpers import committed_state, trained_ids

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PRESET = ROOT / "configs" / "smollm2-cpu.yaml"
# No variants set: the generated training split then excludes the held-out problems only, the same in every run.
SHORT = ("train.iterations=2", "checkpoint.every=1", "data.generate.variants=0")
# mode=sync: bitwise equality is sync mode's claim; the preset's default loss runs async, whose
# rollouts sample with whatever policy version a worker holds when it gets to them (docs/run.md).
COMMON = (*SHORT, "train.batch_size=8", "train.mini_batch_size=4", "train.micro_batch_size=4", "mode=sync")
# The resume claim's models: SmolLM2's tokenizer (every preset model shares it), the student pruned
# from its spec into student-init as the preset's is (tiny-random has 2 layers: one dropped).
TINY_MODELS = ("teacher.model=tiny-random@0", "student.model=tiny-random@1[drop=1]")
PREMISE_PROMPTS = 24


def _eopd(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    return subprocess.run([sys.executable, "-m", "eopd_trainer.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def premise(tmp_path_factory) -> Path:
    """The preset prepared (data, the pruned student), then the teacher and the initial student on
    24 held-out problems x 4 samples: the eval.json of that run directory."""
    run_dir = tmp_path_factory.mktemp("smollm2") / "premise"
    res = _eopd("prepare", "--config", str(PRESET), f"run_dir={run_dir}", "data.generate.variants=0", timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    res = _eopd("eval", "--run-dir", str(run_dir), "--model", "teacher", "--model", "initial",
                f"eval.max_prompts={PREMISE_PROMPTS}", "eval.n_samples=4", "eval.cache=false", timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    return run_dir / "eval.json"


@pytest.mark.timeout(1800)  # its fixture: two SmolLM2 evaluations, minutes on a loaded 2-core machine
def test_smollm2_cpu_teacher_is_far_above_the_initial_student(premise):
    models = json.loads(premise.read_text())["models"]
    teacher, initial = models["teacher"], models["initial"]
    assert teacher["headline"] == "flexible" and teacher["prompts"] == PREMISE_PROMPTS and teacher["n_samples"] == 4
    # Measured (24 prompts x 4 samples): teacher ~0.6, initial student ~0.15.
    assert teacher["avg_at_k"] >= 0.45, teacher["samples"]
    assert teacher["avg_at_k"] - initial["avg_at_k"] >= 0.25, (teacher["avg_at_k"], initial["avg_at_k"])
    assert set(models) == {"teacher", "initial"}
    # The teacher answers in the prompt's format and the student is fluent: numbers in nearly every answer.
    assert teacher["number_frac"] >= 0.9 and initial["number_frac"] >= 0.8
    # ... and the student graded is the preset's: pruned to 29 of SmolLM2's 30 layers
    student = json.loads((premise.parent / "student-init" / "config.json").read_text())
    assert student["num_hidden_layers"] == 29


@pytest.mark.chaos
def test_smollm2_cpu_sigkilled_mid_iteration_then_resumed(tmp_path):
    evals = ("eval.models=[final]", "eval.max_prompts=4", "eval.n_samples=2")
    reference = tmp_path / "reference"
    r = Run(reference, *COMMON, *TINY_MODELS, "eval.enabled=false", name="reference", config=PRESET)
    assert r.wait(900) == 0, r.stderr()[-4000:]
    run_dir = tmp_path / "run"
    r = Run(run_dir, *COMMON, *TINY_MODELS, *evals,
            "faults=[{point: learner.after_step, iteration: 2, step: 1, action: hang}]", name="1", config=PRESET)
    r.wait_for("injected fault hang at learner.after_step", r.learner, timeout=600)
    r.kill_all()
    assert committed_state(run_dir)["iteration"] == 1
    r = Run(run_dir, *COMMON, *TINY_MODELS, *evals, "--resume", name="2", config=PRESET)
    assert r.wait(900) == 0, r.stderr()[-4000:]
    assert "queue recovered (redis-server): 0 tasks and 8 scored rollouts" in r.stderr()
    state = committed_state(run_dir)
    ids = trained_ids(state)
    assert state["iteration"] == 2 and [list(ids.values()).count(i) for i in (1, 2)] == [8, 8]
    assert set(ids) == set(trained_ids(committed_state(reference)))
    assert state["optimizer_steps"] == state["global_steps"] == 4
    # the preset's mechanics, not the tiny preset's: warm-up over 2 steps, the pruned student, keep 1
    run = yaml.safe_load((run_dir / "run.yaml").read_text())
    assert run["train"]["warmup_steps"] == 2 and run["checkpoint"]["keep"] == 1 and run["data"]["generate"]["train"] == 512
    assert json.loads((run_dir / "student-init" / "config.json").read_text())["num_hidden_layers"] == 1
    difference = max_weight_difference(run_dir, reference)
    print(f"smollm2-cpu preset, tiny models: max |weights - uninterrupted weights| = {difference:.3g}")
    assert difference <= WEIGHTS_ATOL
    assert set(json.loads((run_dir / "eval.json").read_text())["models"]) == {"final"}


@pytest.mark.chaos
def test_smollm2_cpu_default_async_mode_sigkilled_then_resumed(tmp_path):
    """The preset as `bash scripts/main.sh` runs it (its default loss in async mode, 8 prompts x 1
    response an iteration, `per_loss.eopd_rkl`), every process killed during iteration 2: the resumed
    run finishes from the committed iteration 1, trains each sampled rollout once and no rollout more
    than one policy version old. Not bitwise equal to an uninterrupted run: in async mode the version
    a rollout is sampled with depends on timing (the sync test above holds that claim)."""
    evals = ("eval.models=[final]", "eval.max_prompts=4", "eval.n_samples=2")
    given = (*SHORT, *TINY_MODELS, *evals)  # the preset's own layout and mode for its default loss
    run_dir = tmp_path / "run"
    r = Run(run_dir, *given, "faults=[{point: learner.after_step, iteration: 2, step: 1, action: hang}]", name="1",
            config=PRESET)
    r.wait_for("injected fault hang at learner.after_step", r.learner, timeout=600)
    r.kill_all()
    assert committed_state(run_dir)["iteration"] == 1
    r = Run(run_dir, *given, "--resume", name="2", config=PRESET)
    assert r.wait(900) == 0, r.stderr()[-4000:]
    assert "queue recovered (redis-server):" in r.stderr()
    run = yaml.safe_load((run_dir / "run.yaml").read_text())
    assert (run["mode"], run["rollout"]["n_samples"], run["loss"]["variant"], run["loss"]["support"]) == ("async", 1, "eopd_rkl", "full")
    state = committed_state(run_dir)
    ids = trained_ids(state)  # each rollout trained once (it asserts so)
    assert state["iteration"] == 2 and [list(ids.values()).count(i) for i in (1, 2)] == [8, 8]
    assert state["optimizer_steps"] == state["global_steps"] == 2  # one step an iteration
    records = [json.loads(line) for line in (run_dir / "train_metrics.jsonl").read_text().splitlines()]
    staleness = [r["iter/staleness_max"] for r in records if r["kind"] == "iteration"]
    assert len(staleness) == 2 and all(0 <= s <= 1 for s in staleness), staleness
    assert set(json.loads((run_dir / "eval.json").read_text())["models"]) == {"final"}
