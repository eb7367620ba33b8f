"""Admission edges of `validation.score_items` (through `tests/teacher/wire.py`) (issue 17, section 5), pure logic on real
protobuf messages: the documented minimum temperature as it arrives on the wire (float32), and the
answer-size bound, which must hold for any ids (counted in UTF-8 bytes, as they travel)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from eopd.v1 import teacher_pb2 as pb
from eopd_teacher.convert import scores_to_pb
from eopd_teacher.types import ModelInfo, SequenceScores
from eopd_teacher.validation import (
    MAX_ID_CHARS,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    InvalidRequest,
    RequestTooLarge,
    response_bytes_bound,
    utf8_id_bytes,
)
from tests.teacher.wire import items_from_request

VOCAB = (1 << 31) - 1  # the largest int32 vocabulary: every top-k id is a 5-byte varint
INFO = ModelInfo("m", "r", vocab_size=VOCAB, max_context_length=4096, dtype="float32", engine="transformers", default_top_k=16,
                 max_top_k=64, tokenizer_fingerprint="f", max_sequences_per_request=4096, max_tokens_per_request=1 << 19)
EMOJI_ID = "\U0001F600" * MAX_ID_CHARS  # 256 characters, 1,024 UTF-8 bytes


def _wire(req: pb.ScoreRequest) -> pb.ScoreRequest:
    """The request as the server receives it (serialized and parsed: float fields become float32)."""
    return pb.ScoreRequest.FromString(req.SerializeToString())


def _req(ids: list[str], n_tokens: int, top_k: int, rid: str = "", temperature: float = 0.0) -> pb.ScoreRequest:
    return pb.ScoreRequest(request_id=rid, top_k=top_k, temperature=temperature, sequences=[
        pb.Sequence(id=sid, token_ids=list(range(1, n_tokens + 1)), score_from=1) for sid in ids])


def test_documented_temperature_range_is_accepted_as_sent():
    """1e-4 and 1e4, the documented bounds, pass as float32 (1e-4 arrives as 9.99999974e-05, which a
    float64 comparison refused); just outside them is refused, naming the field."""
    low = _wire(_req(["a"], 3, 4, temperature=MIN_TEMPERATURE))
    assert low.temperature < MIN_TEMPERATURE  # what the server sees: below 1e-4 in float64
    (item,) = items_from_request(low, INFO)
    assert item.temperature == pytest.approx(MIN_TEMPERATURE, rel=1e-6)
    (item,) = items_from_request(_wire(_req(["a"], 3, 4, temperature=MAX_TEMPERATURE)), INFO)
    assert item.temperature == MAX_TEMPERATURE
    for bad in (9.9e-5, 1.001e4):
        with pytest.raises(InvalidRequest, match=r"^temperature: .* must be 0 \(meaning 1.0\) or in \[0.0001, 10000.0\]"):
            items_from_request(_wire(_req(["a"], 3, 4, temperature=bad)), INFO)


def _fake_scores(req: pb.ScoreRequest, top_k: int, rng: np.random.Generator) -> pb.ScoreResponse:
    """The largest answer these ids and positions can make: top-k ids near 2^31 (5-byte varints)."""
    results = []
    for seq in req.sequences:
        n = len(seq.token_ids) - seq.score_from
        results.append(scores_to_pb(SequenceScores(
            seq_id=seq.id,
            token_logprobs=rng.standard_normal(n).astype(np.float32),
            entropies=rng.random(n).astype(np.float32),
            topk_ids=rng.integers(VOCAB - 1000, VOCAB, size=(n, top_k), dtype=np.int64).astype(np.int32),
            topk_logprobs=rng.standard_normal((n, top_k)).astype(np.float32),
        )))
    return pb.ScoreResponse(request_id=req.request_id, results=results)


def _random_id(rng: random.Random) -> str:
    alphabet = ["a", "\u00e9", "\u4e2d", "\U0001F600", "\U0001F468\u200d\U0001F469"]  # 1 to 11 UTF-8 bytes
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, MAX_ID_CHARS)))
    return text[:MAX_ID_CHARS]


def test_answer_never_exceeds_its_bound_whatever_the_ids():
    """For requests with ids of 1 to 4-byte characters (emoji included), short and long sequences
    and top_k 1..64, the serialized answer (the largest it can be) is within the bound the server
    admits requests by; the bound is tight enough to be useful (within 2x of the real size)."""
    rng = random.Random(0)
    np_rng = np.random.default_rng(0)
    for _ in range(60):
        top_k = rng.choice([1, 2, 16, 64])
        ids = [f"{i}-{_random_id(rng)}"[:MAX_ID_CHARS] for i in range(rng.randint(1, 40))]
        rid = _random_id(rng)
        req = _wire(_req(ids, rng.randint(2, 40), top_k, rid=rid))
        items = items_from_request(req, INFO)
        answer = _fake_scores(req, top_k, np_rng).ByteSize()
        bound = response_bytes_bound(sum(it.num_scored for it in items), top_k, len(items),
                                     id_bytes=utf8_id_bytes(rid, ids))
        assert answer <= bound < 2 * answer + 4096, (answer, bound)
    # And with the largest ids (256 emoji each) and no id bytes given: the default assumes the worst.
    req = _wire(_req([f"{i}" + EMOJI_ID[1:] for i in range(8)], 3, 1, rid=EMOJI_ID))
    answer = _fake_scores(req, 1, np_rng).ByteSize()
    assert answer <= response_bytes_bound(16, 1, 8)


def test_a_request_whose_ids_make_the_answer_too_large_is_refused_before_scoring():
    """900 sequences with 256-emoji ids (1,024 bytes each), 2 scored positions at top_k 16: the
    request (~0.94 MB) fits a 1 MiB message limit, the answer (~1.2 MB) does not. The old bound
    (ids counted as 256 bytes) admitted it, to fail after scoring; it is now refused up front,
    RESOURCE_EXHAUSTED-class, naming the bound and the limit. Half as many sequences are admitted."""
    limit = 1 << 20
    ids = [f"{i:03d}" + EMOJI_ID[3:] for i in range(900)]
    req = _wire(_req(ids, 3, 16, rid="emoji"))
    assert req.ByteSize() < limit
    answer = _fake_scores(req, 16, np.random.default_rng(1)).ByteSize()
    assert answer > limit
    old_bound = 2 * 900 * (8 + 9 * 16) + 900 * (MAX_ID_CHARS + 64) + MAX_ID_CHARS + 16
    assert old_bound < limit  # what the server used to admit by
    with pytest.raises(RequestTooLarge, match=rf"over the server's message limit of {limit} bytes \(request_id 'emoji'\); split"):
        items_from_request(req, INFO, max_response_bytes=limit)
    half = _wire(_req(ids[:450], 3, 16, rid="half"))
    assert len(items_from_request(half, INFO, max_response_bytes=limit)) == 450
    assert _fake_scores(half, 16, np.random.default_rng(2)).ByteSize() <= limit
