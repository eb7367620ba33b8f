"""The paper preset cannot rot (issue 31): `configs/qwen3-paper.yaml` runs end to end on the CPU with
tiny random Qwen3-shaped models that have Qwen3's vocabulary size (151936) and special-token ids
(<|endoftext|> 151643 ends the base student, <|im_end|> 151645 the instruct teacher, ChatML chat
template), built in code by `bench.random_models`. Only paths, sizes, iterations and the student's
device are overridden: the preset's async mode, its token remap and tokenizer check, chat template,
ZeRO-2, bf16 training and bf16 teacher all run as written."""

from __future__ import annotations

import json

import pytest
import yaml

from bench.random_models import IM_END, write_random_model
from tests.procs import ROOT
from tests.trainer.job.test_run_e2e import eopd

pytestmark = pytest.mark.integration

PAPER = ROOT / "configs" / "qwen3-paper.yaml"
DATA = ROOT / "tests" / "data"


def test_paper_preset_runs_end_to_end_on_tiny_qwen3_shaped_models(tmp_path):
    teacher = write_random_model(tmp_path / "Qwen3-8B", role="teacher", seed=0)
    student = write_random_model(tmp_path / "Qwen3-1.7B-Base", role="student", seed=1)
    run_dir = tmp_path / "run"
    res = eopd("run", "--config", str(PAPER), f"run_dir={run_dir}", f"teacher.model={teacher}", f"student.model={student}",
               "student.device=cpu", f"data.train_files=[{DATA / 'tiny_prompts.jsonl'}]",
               f"data.eval_files=[{DATA / 'tiny_heldout.jsonl'}]", "data.field=prompt", "rollout.max_response_length=16",
               "rollout.generation_batch_size=8", "train.batch_size=4", "train.mini_batch_size=2",
               "train.micro_batch_size=1", "train.iterations=2", "checkpoint.every=1", "eval.n_samples=2",
               "eval.max_new_tokens=16", "eval.batch_size=8", "eval.max_prompts=4", "queue.max_backlog=64",
               "logging.progress=false", timeout=600)
    assert res.returncode == 0, res.stderr[-5000:]
    run = yaml.safe_load((run_dir / "run.yaml").read_text())
    assert (run["mode"], run["loss"]["variant"], run["train"]["zero_stage"], run["train"]["precision"]) == ("async", "eopd", 2, "bf16")
    assert run["max_staleness"] == 1
    assert {int(k): v for k, v in run["teacher"]["token_remap"].items()} == {151643: IM_END} and run["data"]["chat_template"] is True

    rollout_log = (run_dir / "logs" / "rollout-w0.log").read_text()
    assert "special tokens moved by teacher.token_remap (eos '<|endoftext|>' -> '<|im_end|>'" in rollout_log
    teacher_log = (run_dir / "logs" / "teacher.log").read_text()
    assert "(bfloat16, vocab 151936," in teacher_log  # the preset's teacher.dtype

    rows = [json.loads(line) for line in (run_dir / "train_metrics.jsonl").read_text().splitlines()]
    iters = [r for r in rows if r.get("kind") == "iteration"]
    assert [r["iteration"] for r in iters] == [1, 2]
    assert all(0.0 <= r["iter/gate_ratio"] <= 1.0 and r["iter/n_tokens"] > 0 for r in iters)
    assert (run_dir / "checkpoints" / "COMMITTED").is_file()
    ev = json.loads((run_dir / "eval.json").read_text())
    assert set(ev["models"]) == {"initial", "final", "teacher"} and ev["models"]["final"]["prompts"] == 4
