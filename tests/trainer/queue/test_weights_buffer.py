"""`weight_sync: mapped` (queue/weights_buffer.py, issue 31 ask 3): the learner's tensors through one
mapped buffer, read under its sequence lock. Real files and mappings (tmp directories), real torch
modules, and a writer in another process rewriting the buffer while this one reads: a read returns
one complete version or WeightsUnavailable, never a mix. End to end: the tiny run (test_run_e2e.py)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import stat
import time

import pytest
import torch

from eopd_trainer.queue.policy_load import load_policy
from eopd_trainer.queue.weights import WeightsUnavailable
from eopd_trainer.queue.weights_buffer import BufferWriter, WeightsTorn, buffer_holds, buffer_path, read_buffer


class Small(torch.nn.Module):
    def __init__(self, dtype=torch.float32, width: int = 8):
        super().__init__()
        self.embed = torch.nn.Embedding(16, width, dtype=dtype)
        self.body = torch.nn.Linear(width, width, dtype=dtype)
        self.head = torch.nn.Linear(width, 16, bias=False, dtype=dtype)
        self.head.weight = self.embed.weight  # tied: exported once, as export_state_dict does
        self.register_buffer("scale", torch.ones(width, dtype=dtype))


def filled(model: torch.nn.Module, value: float) -> torch.nn.Module:
    with torch.no_grad():
        for t in model.state_dict().values():
            t.fill_(value)
    return model


def test_a_published_version_loads_into_a_model_of_another_dtype(tmp_path):
    learner = Small(torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():
        for t in learner.state_dict().values():
            t.copy_(torch.randn_like(t, dtype=torch.float32))
    writer = BufferWriter(tmp_path, learner)
    pv = writer.publish(learner, version=3, iteration=3)
    assert (pv.format, pv.uri, pv.version, pv.sha256) == ("mapped", str(buffer_path(tmp_path)), 3, "seq:2")
    assert stat.S_IMODE(os.stat(pv.uri).st_mode) == 0o600 and buffer_holds(pv)
    tensors = read_buffer(pv)
    assert set(tensors) == {"embed.weight", "body.weight", "body.bias", "scale"}  # head.weight: the tied alias
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    worker = Small(torch.float32)
    load_policy(worker, pv, weights_dir=tmp_path)
    for name, t in learner.state_dict().items():
        assert torch.equal(worker.state_dict()[name], t.float()), name
    assert worker.head.weight is worker.embed.weight
    writer.close()


def test_a_restarted_learner_continues_the_sequence_and_stale_announcements_are_refused(tmp_path):
    model = Small()
    first = BufferWriter(tmp_path, filled(model, 1.0)).publish(model, 1, 1)
    second_writer = BufferWriter(tmp_path, model)  # a restarted learner: the same file, the sequence goes on
    second = second_writer.publish(filled(model, 2.0), 1, 1)  # the same version number, other weights
    assert (first.sha256, second.sha256) == ("seq:2", "seq:4")
    assert not buffer_holds(first) and buffer_holds(second)
    worker = filled(Small(), 7.0)
    with pytest.raises(WeightsUnavailable, match="holds sequence 4 .* announcement names 2"):
        load_policy(worker, first)
    assert all(bool((t == 7.0).all()) for t in worker.state_dict().values())  # untouched
    load_policy(worker, second)
    assert all(bool((t == 2.0).all()) for t in worker.state_dict().values())
    # a learner that died while writing left an odd number: the next one starts after it
    second_writer.mm[8:16] = (5).to_bytes(8, "little")
    assert BufferWriter(tmp_path, model).publish(model, 2, 2).sha256 == "seq:8"


def test_bad_announcements_and_foreign_layouts_are_named(tmp_path):
    model = Small()
    pv = BufferWriter(tmp_path, model).publish(model, 1, 1)
    with pytest.raises(WeightsUnavailable, match="names no sequence number"):
        read_buffer(dataclasses.replace(pv, sha256="abc"))
    with pytest.raises(WeightsUnavailable, match="not found"):
        read_buffer(dataclasses.replace(pv, uri=str(tmp_path / "missing.buf")))
    with pytest.raises(WeightsUnavailable, match="the announcement says"):
        read_buffer(dataclasses.replace(pv, num_bytes=pv.num_bytes + 1))
    with pytest.raises(WeightsUnavailable, match="not inside the run's weights directory"):
        load_policy(model, pv, weights_dir=tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="size mismatch"):
        load_policy(Small(width=4), pv)  # same names, other shapes
    wider = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="unexpected tensors"):
        load_policy(wider, pv)


WIDTH = 1024  # ~4.3 MB of float32: a copy takes long enough for the writer to overlap some reads


def _rewrite(path: str, seconds: float) -> None:
    """Another process: the learner publishing version v with every value v, back to back with a pause
    of a few milliseconds (without it, on an idle 2-core machine every read overlapped a write and
    only one version was ever read whole; a learner publishes once an iteration)."""
    model = Small(width=WIDTH)
    writer = BufferWriter(path, model)
    until, v = time.monotonic() + seconds, 0
    while time.monotonic() < until:
        v += 1
        writer.publish(filled(model, float(v)), version=v, iteration=v)
        time.sleep(0.005 * (v % 3))  # 0, 5 or 10 ms: some reads still overlap a write


def test_a_read_beside_a_writer_is_one_whole_version_or_refused(tmp_path):
    model = Small(width=WIDTH)
    pv0 = BufferWriter(tmp_path, filled(model, 0.0)).publish(model, 0, 0)
    writer = multiprocessing.get_context("spawn").Process(target=_rewrite, args=(str(tmp_path), 3.0))
    writer.start()
    versions, refused = set(), 0
    try:
        while writer.is_alive() or not versions:
            header = open(pv0.uri, "rb").read(32)
            seq, version = int.from_bytes(header[8:16], "little"), int.from_bytes(header[16:24], "little", signed=True)
            if version <= 0 and writer.is_alive():
                continue  # the writer is still starting
            try:
                tensors = read_buffer(dataclasses.replace(pv0, version=version, sha256=f"seq:{seq}"))
            except WeightsUnavailable:
                refused += 1  # the buffer was being written (an odd number) or was rewritten while read
                continue
            values = torch.cat([t.flatten() for t in tensors.values()])
            assert bool((values == float(version)).all()), f"version {version}: a mix of {values.unique()[:5].tolist()}"
            versions.add(version)
    finally:
        writer.join(60)
    assert writer.exitcode == 0 and len(versions) >= 2, (len(versions), refused)  # the writer progressed (4 seen under CI load)
    assert refused > 0  # reads did overlap writes (and were refused, not returned mixed)


def test_a_load_straight_into_the_model_beside_a_writer_is_one_whole_version_or_refused(tmp_path):
    """`load_policy` copies the mapped buffer straight into the model (no staging copy of the policy,
    issue 50 ask 5): after every load that returns, the model holds one whole version; a copy that
    overlapped a rewrite raises WeightsTorn (the model then holds no whole version: the worker samples
    nothing until the next load, rollout/versions.py), a buffer being written WeightsUnavailable."""
    model = Small(width=WIDTH)
    pv0 = BufferWriter(tmp_path, filled(model, 0.0)).publish(model, 0, 0)
    writer = multiprocessing.get_context("spawn").Process(target=_rewrite, args=(str(tmp_path), 3.0))
    writer.start()
    worker = Small(width=WIDTH)
    versions, torn, refused = set(), 0, 0
    try:
        while writer.is_alive() or not versions:
            header = open(pv0.uri, "rb").read(32)
            seq, version = int.from_bytes(header[8:16], "little"), int.from_bytes(header[16:24], "little", signed=True)
            if version <= 0 and writer.is_alive():
                continue
            try:
                load_policy(worker, dataclasses.replace(pv0, version=version, sha256=f"seq:{seq}"))
            except WeightsTorn:
                torn += 1
                continue
            except WeightsUnavailable:
                refused += 1
                continue
            values = torch.cat([t.flatten() for t in worker.state_dict().values()])
            assert bool((values == float(version)).all()), f"version {version}: a mix of {values.unique()[:5].tolist()}"
            versions.add(version)
    finally:
        writer.join(60)
    assert writer.exitcode == 0 and len(versions) >= 2, (len(versions), torn, refused)
    assert torn + refused > 0  # loads did overlap writes (and were refused, not kept mixed)


def test_a_copy_that_does_not_sum_to_the_learners_checksum_is_torn_and_the_read_refused(tmp_path):
    """The torn path itself, deterministically: bytes of a tensor changed in the buffer with the sequence
    number left as announced (as a rewrite seen out of order would leave them). The direct load has
    copied them into the model when the checksum refuses them: WeightsTorn; `read_buffer` refuses its
    own copy with the model untouched."""
    import mmap

    model = filled(Small(), 1.0)
    writer = BufferWriter(tmp_path, model)
    pv = writer.publish(model, version=1, iteration=1)
    worker = filled(Small(), 7.0)
    load_policy(worker, pv)  # the genuine bytes load
    with open(pv.uri, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
        _, _, _, start, nbytes = next(e for e in writer.entries if e[0] == "scale")
        offset = start + nbytes - 4  # the scale buffer's last float32
        mm[offset:offset + 4] = torch.tensor([2.0]).numpy().tobytes()
    with pytest.raises(WeightsTorn, match="rewritten while it was copied into the model"):
        load_policy(worker, pv)
    assert float(worker.state_dict()["scale"][-1]) == 2.0  # written: the tracker must not sample from it
    with pytest.raises(WeightsUnavailable, match="rewritten while it was read"):
        read_buffer(pv)
    writer.close()
