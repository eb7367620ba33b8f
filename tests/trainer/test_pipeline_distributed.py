"""The learner as 2 processes (torchrun, gloo on CPU) with ZeRO stage 2, against the real pipeline."""

from __future__ import annotations

import json

import pytest
from eopd_trainer.queue.streams import Keys

from tests.trainer.pipeline_helpers import (
    committed_state,
    describe,
    overrides,
    spawn_learner,
    spawn_worker,
    trained_ids,
    wait_exit,
)
from tests.trainer.redis_helpers import running_redis

pytestmark = pytest.mark.integration


def test_two_process_zero2_run(tmp_path, tiny_teacher):
    run_dir = tmp_path / "run"
    with running_redis() as redis_server:
        ov = overrides(run_dir, redis_server.url, tiny_teacher.target, "zero2", "train.zero_stage=2", "train.iterations=2")
        worker = spawn_worker(ov, "w0")
        learner = spawn_learner(ov, nproc=2)
        try:
            assert wait_exit(learner, 400, worker) == 0, describe(learner, worker)
            assert wait_exit(worker, 60) == 0, describe(worker)
        finally:
            learner.stop()
            worker.stop()
        assert redis_server.client().xpending(Keys("zero2").rollouts, "learner")["pending"] == 0
    state = committed_state(run_dir)
    assert state["iteration"] == 2 and state["optimizer_steps"] == state["global_steps"] == 4
    assert len(trained_ids(state)) == 16
    tag = run_dir / "checkpoints" / "iter000002"
    # ZeRO-2 partitions the optimizer state: one shard per rank.
    shards = sorted(p.name for p in tag.glob("*optim_states.pt"))
    assert len(shards) == 2, shards
    assert (tag / "hf" / "config.json").is_file() and (tag / "hf" / "model.safetensors").is_file()
    assert (run_dir / "weights" / "v000002.safetensors").is_file()
    log = learner.log()
    assert "training finished: 2 iterations, 16 rollouts trained" in log
    # Step metrics are over both ranks' micro-batches (all-reduced): the first step of each iteration
    # sees ratio 1 on every token of the mini-batch (sync: the worker sampled with these weights).
    steps = [r for r in map(json.loads, (run_dir / "train_metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    assert len(steps) == 4 and all(r["lr"] > 0 for r in steps)
    for first in steps[::2]:
        assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and abs(first["approx_kl"]) < 1e-4, first


@pytest.mark.parametrize("extra", [["train.zero_stage=3"], ["train.zero_stage=1", "train.precision=bf16"]],
                         ids=["zero3-fp32", "zero1-bf16"])
def test_other_zero_stages_and_bf16(extra, tmp_path, tiny_teacher):
    """ZeRO-3 (logits path, gathered parameters for weight sync and export) and bf16 training."""
    run_dir = tmp_path / "run"
    with running_redis() as redis_server:
        ov = overrides(run_dir, redis_server.url, tiny_teacher.target, "variants", "train.iterations=2", *extra)
        worker = spawn_worker(ov, "w0")
        learner = spawn_learner(ov)
        try:
            assert wait_exit(learner, 300, worker) == 0, describe(learner, worker)
            assert wait_exit(worker, 60) == 0, describe(worker)
        finally:
            learner.stop()
            worker.stop()
    state = committed_state(run_dir)
    assert state["iteration"] == 2 and len(trained_ids(state)) == 16
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "iter000002" / "hf")
    assert model.get_output_embeddings().weight.shape == (49152, 64)  # full, not a ZeRO-3 partition
