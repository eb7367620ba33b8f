"""Hidden states and the output head over real gRPC (the teacher server as a subprocess over TCP):
GetOutputHead streams the head in chunks under the message limit with the fingerprint ModelInfo
and every Score answer name; the statistics computed from the returned hidden states equal the
ones the teacher sends (unary and ScoreStream, bf16 and fp32); a teacher that cannot return hidden
states refuses the field by name."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from eopd.v1 import teacher_pb2 as pb
from eopd.v1 import teacher_pb2_grpc as pb_grpc
from eopd_common.output_head import OutputHead, head_statistics, unpack_hidden
from eopd_teacher.client import ScoreBatch, TeacherClient
from eopd_teacher.types import ModelInfo, ScoreRequest, ScoreSequence
from eopd_teacher.validation import InvalidRequest, score_items
from tests.procs import running_teacher

pytestmark = pytest.mark.integration

MESSAGE_LIMIT = 1 << 20  # 1 MiB: the tiny-random head (12.6 MB in fp32) travels in 512 KiB chunks
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}  # as tests/teacher/engines/test_hidden_states.py


@pytest.fixture(scope="module")
def teacher():
    with running_teacher("tiny-random", "--max-message-bytes", str(MESSAGE_LIMIT), "--no-compile-statistics") as proc:
        yield proc


def _seqs(seed: int, count: int, vocab: int = 49152):
    rng = np.random.default_rng(seed)
    return [(f"h{seed}-{i}", rng.integers(0, vocab, n).tolist(), int(n // 2)) for i, n in enumerate(rng.integers(4, 40, count))]


def _check(head: OutputHead, seqs, results, dtype: str, temperature: float = 1.0) -> None:
    for (sid, ids, score_from), r in zip(seqs, results, strict=True):
        assert r.seq_id == sid and r.hidden_dtype == dtype and r.output_head_fingerprint == head.fingerprint
        n = len(ids) - score_from
        h = unpack_hidden(r.hidden_states, r.hidden_size, dtype, rows=n)
        st = head_statistics(head, h, torch.tensor(ids[score_from:]), torch.full((n,), 1.0 / temperature), r.top_k)
        for got, sent in ((st.entropies, r.entropies), (st.token_logprobs, r.token_logprobs), (st.topk_logprobs, r.topk_logprobs)):
            np.testing.assert_allclose(got.numpy(), sent, atol=TOLERANCE[dtype], rtol=0)


def test_the_output_head_streams_in_chunks_under_the_message_limit(teacher):
    with grpc.insecure_channel(teacher.target) as ch:
        chunks = list(pb_grpc.TeacherServiceStub(ch).GetOutputHead(pb.GetOutputHeadRequest()))
    assert len(chunks) > 1 and all(c.ByteSize() < MESSAGE_LIMIT for c in chunks)
    assert chunks[0].HasField("info") and not any(c.HasField("info") for c in chunks[1:])
    info = chunks[0].info
    assert (info.vocab_size, info.hidden_size, info.dtype, info.has_bias) == (49152, 64, "float32", False)
    assert sum(len(c.data) for c in chunks) == info.num_bytes == 49152 * 64 * 4
    with TeacherClient(teacher.target) as c:
        model = c.info()
        head = c.output_head()
    assert model.hidden_size == 64 and model.output_head_fingerprint == head.fingerprint == info.fingerprint
    assert head.weight.shape == (49152, 64)


def test_unary_and_stream_answers_carry_hidden_states_that_reproduce_the_statistics(teacher):
    with TeacherClient(teacher.target) as c:
        head = c.output_head()
        seqs = _seqs(0, 4)
        _check(head, seqs, c.score(seqs, top_k=8, temperature=0.8, hidden_states="bfloat16"), "bfloat16", 0.8)
        plain = c.score(seqs, top_k=8, temperature=0.8)
        assert all(r.hidden_states is None and r.output_head_fingerprint == "" for r in plain)  # opt-in only
        batches = [ScoreBatch(f"r{i}", _seqs(10 + i, 2), top_k=4, hidden_states="float32") for i in range(3)]
        answers = dict(c.score_stream(iter(batches)))
    for b in batches:
        _check(head, b.sequences, answers[b.request_id], "float32")


def test_hidden_states_over_the_message_limit_are_refused_before_scoring(teacher):
    # 3 x 2,000 positions of fp32 hidden states (256 B each: 1.5 MB) do not fit 1 MiB; without them they do.
    seqs = [(f"long{i}", list(range(2001)), 1) for i in range(3)]
    with TeacherClient(teacher.target, retry_timeout=0) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.score(seqs, top_k=1, hidden_states="float32")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "message limit" in err.value.details()


def test_a_teacher_without_an_output_head_refuses_the_field_by_name():
    info = ModelInfo("m", "r", 100, 64, "float32", "vllm", 16, 64, "f", 8, 1000)  # no hidden_size, no fingerprint
    req = ScoreRequest([ScoreSequence("a", np.arange(5), 1)], hidden_states="bfloat16")
    with pytest.raises(InvalidRequest, match=r"hidden_states: not served by this teacher \(engine 'vllm'"):
        score_items(req, info)
    served = ModelInfo(**{**info.__dict__, "hidden_size": 64, "output_head_fingerprint": "ab"})
    with pytest.raises(InvalidRequest, match=r"hidden_states: 'unknown\(7\)' is not one of"):
        score_items(ScoreRequest(req.sequences, hidden_states="unknown(7)"), served)
    (item,) = score_items(req, served)
    assert item.hidden_dtype == "bfloat16"
