"""What a client sends and what a failed request looks like: `SequenceInput`, `ScoreBatch`,
`build_request` (callers' sequences to a protobuf `ScoreRequest`), `build_generate_request`
(prompts to a `GenerateRequest`) and `RequestFailed`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from eopd.v1 import teacher_pb2 as pb

from ..convert import HIDDEN_TO_PB


@dataclass(frozen=True)
class SequenceInput:
    """A sequence to score: positions [score_from, len(token_ids)) are scored. `candidate_ids`
    (optional, `[n, m]` ints, n = len(token_ids) - score_from, -1 as filler) names m extra ids per
    scored position whose log-probs come back as `SequenceScores.candidate_logprobs [n, m]`."""

    id: str
    token_ids: Sequence[int] | np.ndarray
    score_from: int
    candidate_ids: np.ndarray | None = None


@dataclass(frozen=True)
class ScoreBatch:
    """One request of a stream."""

    request_id: str
    sequences: Sequence[SequenceInput]
    top_k: int = 0
    temperature: float = 0.0
    # "bfloat16" / "float32": the answer also carries the final hidden states (SequenceScores.hidden_states).
    hidden_states: str = ""


def _as_input(i: int, s) -> SequenceInput:
    if isinstance(s, SequenceInput):
        return s
    if isinstance(s, dict):
        return SequenceInput(str(s.get("id", i)), s["token_ids"], int(s["score_from"]), s.get("candidate_ids"))
    sid, ids, score_from, *cand = s
    return SequenceInput(str(sid), ids, int(score_from), cand[0] if cand else None)


def _sequence_pb(s: SequenceInput) -> pb.Sequence:
    out = pb.Sequence(id=s.id, token_ids=np.asarray(s.token_ids, dtype=np.int64).tolist(), score_from=s.score_from)
    if s.candidate_ids is not None:
        cand = np.asarray(s.candidate_ids, dtype=np.int64)
        if cand.ndim != 2:
            raise ValueError(f"candidate_ids of sequence {s.id!r} must be [n, m], got shape {cand.shape}")
        out.num_candidates = int(cand.shape[1])
        out.candidate_ids.extend(cand.ravel().tolist())
    return out


def build_request(sequences: Iterable, *, top_k: int = 0, temperature: float = 0.0, request_id: str = "",
                  hidden_states: str = "") -> pb.ScoreRequest:
    """A ScoreRequest from SequenceInput, (id, token_ids, score_from[, candidate_ids]) tuples or dicts;
    `hidden_states` "bfloat16" or "float32" asks for the final hidden states too ("" none)."""
    if hidden_states not in HIDDEN_TO_PB:
        raise ValueError(f"hidden_states: {hidden_states!r} is not one of {sorted(HIDDEN_TO_PB)}")
    seqs = [_as_input(i, s) for i, s in enumerate(sequences)]
    return pb.ScoreRequest(
        request_id=request_id,
        top_k=top_k,
        temperature=temperature,
        sequences=[_sequence_pb(s) for s in seqs],
        hidden_states=HIDDEN_TO_PB[hidden_states],
    )


def build_generate_request(
    prompts, *, num_samples: int = 1, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
    stop_token_ids=(), seed: int | None = None, top_k: int = 0, score_temperature: float = 1.0, request_id: str = "",
    hidden_states: str = "",
) -> pb.GenerateRequest:
    """A GenerateRequest from `prompts`: a list of token-id lists (ids "0", "1", ...) or a dict
    {prompt id: token ids}. temperature 0 is greedy; the client always sends the values given
    (1.0 for temperature), never the proto's 0-means-default."""
    pairs = prompts.items() if isinstance(prompts, dict) else ((str(i), ids) for i, ids in enumerate(prompts))
    req = pb.GenerateRequest(
        request_id=request_id,
        prompts=[pb.Prompt(id=str(pid), token_ids=np.asarray(ids, dtype=np.int64).tolist()) for pid, ids in pairs],
        num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
        stop_token_ids=[int(t) for t in stop_token_ids], top_k=top_k, score_temperature=score_temperature,
        hidden_states=HIDDEN_TO_PB[hidden_states],
    )
    if seed is not None:
        req.seed = int(seed)
    return req


class RequestFailed(Exception):
    """A request of a stream that failed on its own (answered in band by the server), or whose
    retries ran out: `request_id`, `code` (grpc.StatusCode) and `details` (the server's message)."""

    def __init__(self, request_id: str, code: grpc.StatusCode, details: str):
        super().__init__(f"request {request_id!r} failed: {code.name}: {details}")
        self.request_id = request_id
        self.code = code
        self.details = details


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def status_code(number: int) -> grpc.StatusCode:
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)
