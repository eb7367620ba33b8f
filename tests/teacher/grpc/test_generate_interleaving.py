"""Generation is interleaved with scoring (issue 33, section 2): a small Score from another client,
sent while a long Generate runs on the real teacher (tiny-random, a subprocess over TCP, default
settings), is answered between two bounded steps of the generation (`generate_step_ms`, 50 ms by
default), not after it. Before, a 16-token Score beside a long Generate waited 50 s (0.025 s alone).

Bounds (generous, for a loaded 2-core machine): the Score is answered while the Generate is still
running, within ALONE_MULTIPLE times its median time alone + ALONE_SLACK_S."""

from __future__ import annotations

import statistics
import time

import grpc
import numpy as np
import pytest

from eopd.v1 import teacher_pb2 as pb
from eopd.v1 import teacher_pb2_grpc as pb_grpc
from eopd_teacher.client import TeacherClient

pytestmark = [pytest.mark.integration, pytest.mark.serial]

ALONE_MULTIPLE, ALONE_SLACK_S = 10, 1.0


def test_small_score_beside_a_long_generate_is_served_between_its_steps(tiny_teacher):
    small = [("small", list(range(200, 216)), 1)]
    # 2 prompts x 4 samples x 1000 new tokens: one engine job of 8 rows, many seconds of decoding.
    long_generate = pb.GenerateRequest(request_id="long", prompts=[pb.Prompt(id=str(i), token_ids=[1, 2, 3 + i]) for i in range(2)],
                                       num_samples=4, max_new_tokens=1000, temperature=1.0, seed=3, stop_token_ids=[])
    with TeacherClient(tiny_teacher.target, client_id="victim") as victim, \
            grpc.insecure_channel(tiny_teacher.target) as channel:
        expected = victim.score(small)
        alone = []
        for _ in range(5):
            started = time.perf_counter()
            victim.score(small)
            alone.append(time.perf_counter() - started)

        call = pb_grpc.TeacherServiceStub(channel).Generate(long_generate, timeout=120, metadata=[("x-eopd-client", "generator")])
        try:
            time.sleep(0.5)  # the job has started: the engine is decoding it
            assert call.is_active()
            started = time.perf_counter()
            beside = victim.score(small, timeout=120)
            latency = time.perf_counter() - started
            assert call.is_active(), "the Score waited for the whole generation"
        finally:
            call.cancel()
        print(f"small Score alone {statistics.median(alone):.3f} s, beside a long Generate {latency:.3f} s")
        np.testing.assert_allclose(beside[0].token_logprobs, expected[0].token_logprobs, atol=1e-5, rtol=0)
        assert latency <= ALONE_MULTIPLE * statistics.median(alone) + ALONE_SLACK_S, (latency, alone)
        # The cancelled generation frees the engine at once: the next Score is served.
        assert len(victim.score(small, timeout=30)) == 1
