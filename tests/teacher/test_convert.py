"""Request validation at the service boundary: every bad field gets a message naming it."""

from __future__ import annotations

import pytest

from eopd.v1 import teacher_pb2 as pb
from eopd_teacher.convert import scores_from_pb, scores_to_pb
from eopd_teacher.types import ModelInfo
from eopd_teacher.validation import InvalidRequest, RequestTooLarge
from tests.teacher.wire import items_from_request

INFO = ModelInfo("m", "r", vocab_size=100, max_context_length=50, dtype="float32", engine="transformers", default_top_k=16,
                 max_top_k=20, tokenizer_fingerprint="f", max_sequences_per_request=4, max_tokens_per_request=120)


def req(*seqs, **kw) -> pb.ScoreRequest:
    return pb.ScoreRequest(request_id=kw.pop("request_id", "r1"), sequences=[pb.Sequence(id=i, token_ids=t, score_from=f) for i, t, f in seqs], **kw)


def test_valid_request_defaults():
    (item,) = items_from_request(req(("a", [1, 2, 3], 1)), INFO)
    assert item.top_k == 16 and item.temperature == 1.0 and item.num_scored == 2 and item.token_ids.tolist() == [1, 2, 3]
    (item,) = items_from_request(req(("a", [1, 2, 3], 2), top_k=5, temperature=0.5), INFO)
    assert item.top_k == 5 and item.temperature == 0.5 and item.num_scored == 1


@pytest.mark.parametrize(
    "request_, match",
    [
        (req(), r"^sequences: at least one"),
        (req(("a", [1, 200, 3], 1)), r"sequences\[0\]\.token_ids\[1\]: token id 200 is outside the vocabulary \[0, 100\)"),
        (req(("a", [1, -1], 1)), r"sequences\[0\]\.token_ids\[1\]: token id -1"),
        (req(("a", [], 0)), r"sequences\[0\]\.token_ids: empty sequence, id 'a'"),
        (req(("a", [5], 0)), r"sequences\[0\]\.token_ids: 1 token"),
        (req(("a", [1, 2], 0)), r"sequences\[0\]\.score_from: 0 must be in \[1, 1\]"),
        (req(("ok", [1, 2], 1), ("b", [1, 2, 3], 3)), r"sequences\[1\]\.score_from: 3 .*id 'b'"),
        (req(("a", list(range(51)), 1)), r"sequences\[0\]\.token_ids: 51 tokens exceed the model's context of 50"),
        (req(("a", [1, 2], 1), top_k=21), r"top_k: 21 exceeds the maximum 20"),
        (req(("a", [1, 2], 1), ("a", [3, 4], 1)), r"sequences\[1\]\.id: duplicate sequence id 'a'"),
        (req(("", [1, 2], 1)), r"sequences\[0\]\.id: must be non-empty"),
        (req(("a", [1, 2], 1), temperature=-1.0), r"temperature: -1.0 must be 0"),
        (req(("a", [1, 2], 1), temperature=float("nan")), r"temperature: nan"),
        (req(("a", [1, 2], 1), temperature=float("inf")), r"temperature: inf"),
        (req(("a", [1, 2], 1), request_id="x" * 300), r"request_id: longer than 256"),
    ],
)
def test_invalid_argument_names_the_field(request_, match):
    with pytest.raises(InvalidRequest, match=match):
        items_from_request(request_, INFO)


def test_stream_requires_request_id():
    with pytest.raises(InvalidRequest, match="request_id: must be non-empty"):
        items_from_request(req(("a", [1, 2], 1), request_id=""), INFO, require_request_id=True)


def test_size_limits_are_resource_exhausted():
    with pytest.raises(RequestTooLarge, match="5 sequences exceed the limit of 4"):
        items_from_request(req(*[(str(i), [1, 2], 1) for i in range(5)]), INFO)
    with pytest.raises(RequestTooLarge, match="150 tokens exceed the limit of 120"):
        items_from_request(req(*[(str(i), [1] * 50, 1) for i in range(3)]), INFO)


def test_scores_roundtrip_shapes():
    import numpy as np

    from eopd_teacher.types import SequenceScores

    s = SequenceScores("x", np.array([-1.0, -2.0], np.float32), np.array([0.5, 1.5], np.float32),
                       np.array([[1, 2, 3], [4, 5, 6]], np.int32), np.array([[-0.1, -0.2, -0.3], [-1, -2, -3]], np.float32))
    wire = pb.SequenceScores.FromString(scores_to_pb(s).SerializeToString())
    back = scores_from_pb(wire)
    assert back.topk_ids.shape == (2, 3) and back.topk_ids.tolist() == s.topk_ids.tolist()
    assert back.topk_logprobs.tolist() == s.topk_logprobs.tolist() and back.token_logprobs.tolist() == [-1.0, -2.0]
