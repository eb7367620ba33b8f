"""A full disk while checkpointing, on every machine (the tmpfs variant in test_pipeline_infra.py
needs root): the `checkpoint.write` fault point raises ENOSPC inside CheckpointManager.save after a
REAL DeepSpeed engine (CPU, gloo, one process) has written part of the checkpoint. The save fails
with a clear error, the partial directory is removed, the previous checkpoint stays committed,
byte-identical, and loads into a fresh engine with its weights."""

from __future__ import annotations

import errno
import hashlib
from pathlib import Path

import pytest
import torch

from eopd_trainer.learner.state import LearnerState
from tests.trainer.pipeline_helpers import TINY

pytestmark = [pytest.mark.integration, pytest.mark.chaos]



def _engine(seed: int):
    import deepspeed
    from eopd_trainer.config import load_config
    from eopd_trainer.learner.distributed import build_ds_config, lr_scheduler_factory

    cfg = load_config(TINY, ["train.zero_stage=0", "train.grad_clip=0"])
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                           config=build_ds_config(cfg, 1, 8),
                                           lr_scheduler=lr_scheduler_factory(cfg, 8))
    return engine


def _step(engine, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(engine.gradient_accumulation_steps()):
        loss = engine(torch.randn(engine.train_micro_batch_size_per_gpu(), 8, generator=gen)).pow(2).mean() + 1.0
        engine.backward(loss)
        engine.step()


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_enospc_inside_the_checkpoint_writer_keeps_the_previous_checkpoint(process_group, tmp_path):
    from eopd_trainer.config import FaultConfig
    from eopd_trainer.faults import Faults
    from eopd_trainer.learner.checkpoint import CheckpointError, CheckpointManager, committed_tag

    ckpt = tmp_path / "checkpoints"
    faults = Faults([FaultConfig(point="checkpoint.write", action="raise", iteration=2)])
    manager = CheckpointManager(ckpt, keep=3, export_hf=False, rank=0, barrier=lambda: None, faults=faults)
    engine = _engine(0)
    _step(engine, 1)
    manager.save(engine, 1, LearnerState.from_json({"iteration": 1, "policy_version": 1}))
    saved = _params(engine)
    before = _digest(ckpt / "iter000001")
    assert committed_tag(ckpt) == "iter000001" and before

    _step(engine, 2)
    assert not all(torch.equal(a, b) for a, b in zip(saved, _params(engine)))  # the step changed the weights
    with pytest.raises(CheckpointError) as e:
        manager.save(engine, 2, LearnerState.from_json({"iteration": 2, "policy_version": 2}))
    msg = str(e.value)
    assert "No space left on device" in msg and f"writing checkpoint {ckpt / 'iter000002'} failed" in msg, msg
    assert f"last committed checkpoint ({ckpt / 'iter000001'}) is intact" in msg, msg
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.ENOSPC
    assert not (ckpt / "iter000002").exists()  # the partial shards are gone (the space is freed)
    assert not list(ckpt.glob("COMMITTED.tmp*"))
    assert committed_tag(ckpt) == "iter000001"
    assert _digest(ckpt / "iter000001") == before

    # Loadable: a fresh engine (other initial weights) resumes from it with iteration 1's weights.
    fresh = _engine(123)
    assert not all(torch.equal(a, b) for a, b in zip(saved, _params(fresh)))
    state = CheckpointManager(ckpt, keep=3, export_hf=False, rank=0, barrier=lambda: None).load(fresh)
    assert state.iteration == 1
    assert all(torch.equal(a, b) for a, b in zip(saved, _params(fresh)))
    # and the next save (the fault fired for iteration 2 only) commits again.
    manager.save(engine, 3, LearnerState.from_json({"iteration": 3, "policy_version": 3}))
    assert committed_tag(ckpt) == "iter000003"
