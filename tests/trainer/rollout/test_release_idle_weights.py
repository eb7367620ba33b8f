"""`rollout.release_idle_weights` (issue 50 ask 5): in sync mode a worker with no task frees its copy
of the policy until it loads the next version (rollout/samplers/parked.py, rollout/versions.py).

Real parts: a tiny random Llama in the transformers sampler, the learner's weights through the real
mapped buffer (`BufferWriter`), resident memory read from /proc. The tracker's decisions (what is
released when, what is loaded again) with the sampler and the queue as stand-ins, as in
test_versions_torn.py. End to end, the tiny run's worker releases its weights after every version
in sync mode and never in async mode (tests/trainer/job/test_run_e2e.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch
from eopd_trainer.config import load_config
from eopd_trainer.queue.messages import PolicyVersion
from eopd_trainer.queue.weights_buffer import BufferWriter
from eopd_trainer.rollout.samplers import transformers_sampler as ts
from eopd_trainer.rollout.samplers.parked import park, unpark
from eopd_trainer.rollout.versions import VersionTracker

from tests.procs import ROOT
from tests.trainer.rollout.test_step_logprobs import PROMPTS, Tok
from tests.trainer.rollout.test_versions_torn import _Metrics, _pv, _Queue
from tests.trainer.test_pipeline_units import tiny_causal_lm


def parameter_bytes(model: torch.nn.Module) -> int:
    """The bytes the parameters of `model` hold now (0 for a parked model)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_park_frees_every_parameter_and_unpark_gives_back_the_shapes():
    model = tiny_causal_lm("llama")
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: one parameter, freed once
    shapes = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    parked = park(model)
    assert parameter_bytes(model) == 0 and len(parked) == len(shapes)
    assert all(b.numel() == buffers[n].numel() for n, b in model.named_buffers())  # buffers kept
    unpark(parked)
    assert {n: (p.shape, p.dtype) for n, p in model.named_parameters()} == shapes
    assert model.lm_head.weight is model.model.embed_tokens.weight


PARK_AND_MEASURE = """
import torch
from eopd_common.memory import resident_bytes, return_large_frees
from eopd_trainer.rollout.samplers.parked import park, unpark
return_large_frees()
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)  # every page touched
before = resident_bytes()
parked = park(model)
after = resident_bytes()
unpark(parked)
print(before, after)
"""


def test_parking_hands_the_memory_back():
    """A 64 MiB model in a fresh process (as a worker is: large tensors mmapped from the start,
    `return_large_frees`): its resident memory falls by nearly all of it."""
    res = subprocess.run([sys.executable, "-c", PARK_AND_MEASURE], capture_output=True, text=True, timeout=120, check=True)
    before, after = map(int, res.stdout.split())
    assert before - after > 0.9 * 64 * 2**20, (before, after)


def test_a_released_sampler_refuses_to_sample_until_a_version_loads_and_then_samples_as_before(tmp_path):
    """The sampler after release and a load of the learner's weights from the mapped buffer samples
    the same tokens with the same log-probs as before the release."""
    learner = tiny_causal_lm("llama")
    worker_model = tiny_causal_lm("llama")
    writer = BufferWriter(tmp_path, learner)
    pv = writer.publish(learner, version=1, iteration=1)
    sampler = ts.TransformersSampler("tiny", model=worker_model, tokenizer=Tok(), old_logprobs="generate")
    sampler.load_weights(pv)
    before = sampler.sample(PROMPTS, [7], temperature=1.0, top_p=1.0, max_new_tokens=6)
    assert sampler.release_weights() and not sampler.holds_weights and parameter_bytes(worker_model) == 0
    with pytest.raises(RuntimeError, match="released"):
        sampler.sample(PROMPTS, [7], temperature=1.0, top_p=1.0, max_new_tokens=6)
    sampler.load_weights(pv)
    assert sampler.holds_weights
    after = sampler.sample(PROMPTS, [7], temperature=1.0, top_p=1.0, max_new_tokens=6)
    assert [s.response_ids for s in after] == [s.response_ids for s in before]
    for a, b in zip(after, before, strict=True):
        assert a.logprobs.tolist() == b.logprobs.tolist()
    writer.close()


def test_a_sampler_off_the_cpu_keeps_its_weights():
    sampler = ts.TransformersSampler("tiny", model=tiny_causal_lm("llama"), tokenizer=Tok(), old_logprobs="generate")
    sampler.model = sampler.model.to("meta")  # a device other than the CPU (no GPU here)
    assert not sampler.release_weights() and sampler.holds_weights


class _ReleasingSampler:
    engine = "test"

    def __init__(self, can_release: bool = True):
        self.can_release = can_release
        self.calls: list[int] = []
        self.released = 0

    def load_weights(self, pv: PolicyVersion) -> None:
        self.calls.append(pv.version)

    def release_weights(self) -> bool:
        self.released += 1
        return self.can_release


def _tracker(sampler, pv: PolicyVersion, mode: str, release_idle: bool = True) -> VersionTracker:
    return VersionTracker(sampler, _Queue(pv), _Metrics(), mode=mode, weights_poll_s=0.001, stop=asyncio.Event(),
                          release_idle=release_idle)


def test_sync_worker_releases_while_waiting_and_loads_the_announced_version_again():
    sampler = _ReleasingSampler()
    tracker = _tracker(sampler, _pv(1), "sync")
    tracker.release_while_waiting()  # nothing loaded from an announcement yet (the spec's weights): kept
    assert sampler.released == 0
    assert asyncio.run(tracker.ensure(1)) and sampler.calls == [1]
    tracker.release_while_waiting()
    tracker.release_while_waiting()  # once
    assert sampler.released == 1 and tracker.parked
    # a task for the same version (a replaced task): the same announcement is loaded again
    assert asyncio.run(tracker.ensure(1)) and sampler.calls == [1, 1] and not tracker.parked
    tracker.release_while_waiting()
    tracker.queue.pv = _pv(2)  # the learner's next version
    assert asyncio.run(tracker.ensure(2)) and sampler.calls == [1, 1, 2] and tracker.version == 2


@pytest.mark.parametrize(("mode", "setting", "can_release"), [("async", True, True), ("sync", False, True),
                                                              ("sync", True, False)])
def test_weights_are_kept_in_async_mode_when_turned_off_or_when_the_sampler_cannot(mode, setting, can_release):
    """Async mode samples while the learner trains; `release_idle_weights: false`; a sampler that
    cannot release (vLLM owns its weights) says so and is not reloaded for nothing."""
    sampler = _ReleasingSampler(can_release)
    tracker = _tracker(sampler, _pv(1), mode, release_idle=setting)
    assert asyncio.run(tracker.ensure(1))
    tracker.release_while_waiting()
    assert not tracker.parked
    assert asyncio.run(tracker.ensure(1)) and sampler.calls == [1]


def test_the_setting_is_on_by_default():
    assert load_config(ROOT / "configs" / "smollm2-cpu.yaml").rollout.release_idle_weights
