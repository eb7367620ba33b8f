"""The mapped weights buffer's trust (issue 49 ask 4; docs/reliability.md, "The mapped weights
buffer"): any process of the run's user can write it, checksum included. Attacker and victim are
real: a learner's BufferWriter publishes, another process of the same user writes NaN into a
tensor and fixes the checksum (the attack that made a worker load NaN weights and the run die),
and the worker's load is refused naming the tensors, its model untouched; a diverged learner's
NaN weights are refused alike."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from eopd_trainer.queue.policy_load import load_policy
from eopd_trainer.queue.weights import WeightsUnavailable
from eopd_trainer.queue.weights_buffer import BufferWriter, non_finite, read_buffer
from tests.procs import ROOT

ATTACKER = """
import json, math, mmap, os, struct, sys
# the attacker's own code, the standard library only: the published header and layout are all it needs
HEADER, HEADER_BYTES, ALIGN = struct.Struct("<8sqqq16sqq"), 64, 64
align = lambda n: (n + ALIGN - 1) // ALIGN * ALIGN
path, name = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_RDWR)  # the same user: the 0600 file opens
mm = mmap.mmap(fd, os.fstat(fd).st_size)
magic, seq, version, iteration, layout, n, total = HEADER.unpack_from(mm, 0)
start = offset = align(HEADER_BYTES + n)
for tensor, dtype, shape in json.loads(bytes(mm[HEADER_BYTES:HEADER_BYTES + n])):
    assert dtype == "torch.float32", dtype
    count = math.prod(shape)
    if tensor == name:
        mm[offset:offset + 4 * count] = struct.pack(f"<{count}f", *[float("nan")] * count)
    offset += align(4 * count)
words = struct.unpack(f"<{(len(mm) - start) // 8}q", mm[start:])
total = (sum(words) + 2**63) % 2**64 - 2**63  # the checksum: a wrapping sum of 8-byte words
HEADER.pack_into(mm, 0, magic, seq, version, iteration, layout, n, total)
mm.flush()
print("poisoned", name, flush=True)
"""


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)


def test_nan_weights_written_by_another_process_of_the_user_are_refused(tmp_path):
    torch.manual_seed(0)
    learner, worker = Small(), Small()
    writer = BufferWriter(tmp_path, learner)
    pv = writer.publish(learner, version=1, iteration=1)
    load_policy(worker, pv, weights_dir=tmp_path)  # the genuine version loads
    before = {k: v.clone() for k, v in worker.state_dict().items()}
    res = subprocess.run([sys.executable, "-I", "-c", ATTACKER, pv.uri, "body.weight"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "poisoned body.weight" in res.stdout, res.stderr[-2000:]
    # the checksum matches the poisoned bytes: only the finiteness check stands between them and the model
    with pytest.raises(WeightsUnavailable, match=r"non-finite values \(NaN or inf\) in 1 tensors \(body\.weight\): "
                       r"refused, the model keeps its weights"):
        load_policy(worker, pv, weights_dir=tmp_path)
    assert all(torch.equal(worker.state_dict()[k], v) for k, v in before.items())
    writer.close()


def test_a_diverged_learners_weights_are_refused_too(tmp_path):
    learner = Small()
    with torch.no_grad():
        learner.head.weight[3, 2] = float("inf")
        learner.body.bias[0] = float("nan")
    writer = BufferWriter(tmp_path, learner)
    pv = writer.publish(learner, version=2, iteration=2)
    with pytest.raises(WeightsUnavailable, match=r"in 2 tensors \(body\.bias, head\.weight\)"):
        read_buffer(pv)
    writer.close()


def test_large_finite_half_precision_weights_are_not_refused():
    """fp16's sum is taken in fp32: 1e5 weights of 1000 sum to 1e8, past fp16's 65504."""
    tensors = {"w": torch.full((100_000,), 1000.0, dtype=torch.float16), "b": torch.ones(4, dtype=torch.bfloat16),
               "ids": torch.arange(5), "empty": torch.empty(0)}
    assert non_finite(tensors) == []
    tensors["b"][1] = float("-inf")
    assert non_finite(tensors) == ["b"]
