"""What a client sends and what a failed request looks like: `SequenceInput`, `ScoreBatch`,
`build_request` (callers' sequences to a protobuf `ScoreRequest`) and `RequestFailed`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from eopd.v1 import teacher_pb2 as pb


@dataclass(frozen=True)
class SequenceInput:
    """A sequence to score: positions [score_from, len(token_ids)) are scored."""

    id: str
    token_ids: Sequence[int] | np.ndarray
    score_from: int


@dataclass(frozen=True)
class ScoreBatch:
    """One request of a stream."""

    request_id: str
    sequences: Sequence[SequenceInput]
    top_k: int = 0
    temperature: float = 0.0


def _as_input(i: int, s) -> SequenceInput:
    if isinstance(s, SequenceInput):
        return s
    if isinstance(s, dict):
        return SequenceInput(str(s.get("id", i)), s["token_ids"], int(s["score_from"]))
    sid, ids, score_from = s
    return SequenceInput(str(sid), ids, int(score_from))


def build_request(sequences: Iterable, *, top_k: int = 0, temperature: float = 0.0, request_id: str = "") -> pb.ScoreRequest:
    """A ScoreRequest from SequenceInput, (id, token_ids, score_from) tuples or dicts."""
    seqs = [_as_input(i, s) for i, s in enumerate(sequences)]
    return pb.ScoreRequest(
        request_id=request_id,
        top_k=top_k,
        temperature=temperature,
        sequences=[
            pb.Sequence(id=s.id, token_ids=np.asarray(s.token_ids, dtype=np.int64).tolist(), score_from=s.score_from)
            for s in seqs
        ],
    )


class RequestFailed(Exception):
    """A request of a stream that failed on its own (answered in band by the server), or whose
    retries ran out: `request_id`, `code` (grpc.StatusCode) and `details` (the server's message)."""

    def __init__(self, request_id: str, code: grpc.StatusCode, details: str):
        super().__init__(f"request {request_id!r} failed: {code.name}: {details}")
        self.request_id = request_id
        self.code = code
        self.details = details


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _status_code(number: int) -> grpc.StatusCode:
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)
