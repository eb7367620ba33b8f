"""The gRPC shapes <-> core types: `eopd.v1` requests into the service's `ScoreRequest` /
`GenerateRequest`, its answers back (validation is the service's, `validation.py`, with the gRPC
field names).

Shared by both ends of the wire (the gRPC front end and the client); the HTTP API has its own
shapes (`http/openai_compat.py`) and never meets a protobuf message.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from eopd.v1 import teacher_pb2 as pb

from .types import (
    GeneratePrompt,
    GenerateRequest,
    Generation,
    ModelInfo,
    ScoreRequest,
    ScoreSequence,
    SequenceScores,
)

# Trailing metadata on a RESOURCE_EXHAUSTED that retrying cannot cure (the request itself is over a
# per-request limit): `eopd-retryable: 0`.
NOT_RETRYABLE_KEY = "eopd-retryable"
# Request metadata of a ScoreStream client that wants the end of the stream announced in band
# (ScoreResponse.ending) before the status, and half-closes when it is (see teacher.proto).
STREAM_ENDING_KEY = "eopd-stream-ending"


def score_request_from_pb(req: pb.ScoreRequest) -> ScoreRequest:
    return ScoreRequest(
        sequences=[ScoreSequence(s.id, np.asarray(s.token_ids, dtype=np.int64), int(s.score_from), int(s.num_candidates),
                                 np.asarray(s.candidate_ids, dtype=np.int64) if s.candidate_ids else None)
                   for s in req.sequences],
        request_id=req.request_id, top_k=int(req.top_k), temperature=float(req.temperature),
    )


def generate_request_from_pb(req: pb.GenerateRequest) -> GenerateRequest:
    return GenerateRequest(
        prompts=[GeneratePrompt(p.id, np.asarray(p.token_ids, dtype=np.int64)) for p in req.prompts],
        max_new_tokens=int(req.max_new_tokens), request_id=req.request_id, num_samples=int(req.num_samples),
        temperature=float(req.temperature), top_p=float(req.top_p), stop_token_ids=tuple(req.stop_token_ids),
        seed=int(req.seed) if req.HasField("seed") else None, top_k=int(req.top_k),
        score_temperature=float(req.score_temperature),
    )


def scores_to_pb(s: SequenceScores) -> pb.SequenceScores:
    out = pb.SequenceScores(
        id=s.seq_id,
        top_k=s.top_k,
        token_logprobs=s.token_logprobs.tolist(),
        entropies=s.entropies.tolist(),
        topk_ids=s.topk_ids.ravel().tolist(),
        topk_logprobs=s.topk_logprobs.ravel().tolist(),
    )
    if s.candidate_logprobs is not None and s.candidate_logprobs.shape[1]:
        out.num_candidates = int(s.candidate_logprobs.shape[1])
        out.candidate_logprobs.extend(s.candidate_logprobs.ravel().tolist())
    return out


def scores_from_pb(r: pb.SequenceScores) -> SequenceScores:
    """Decodes one result into numpy arrays (`[n]`, `[n, k]`; `candidate_logprobs [n, m]`, m = 0 when
    none were asked)."""
    k = max(int(r.top_k), 1)
    lp = np.asarray(r.token_logprobs, dtype=np.float32)
    return SequenceScores(
        seq_id=r.id,
        token_logprobs=lp,
        entropies=np.asarray(r.entropies, dtype=np.float32),
        topk_ids=np.asarray(r.topk_ids, dtype=np.int32).reshape(-1, k),
        topk_logprobs=np.asarray(r.topk_logprobs, dtype=np.float32).reshape(-1, k),
        candidate_logprobs=np.asarray(r.candidate_logprobs, dtype=np.float32).reshape(lp.shape[0], int(r.num_candidates)),
    )


def info_to_pb(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(**info.__dict__)


def info_from_pb(m: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(**{f: getattr(m, f) for f in ModelInfo.__dataclass_fields__})


def generation_to_pb(request_id: str, g: Generation) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=request_id,
        prompt_id=g.prompt_id,
        sample_index=g.sample_index,
        token_ids=g.token_ids.tolist(),
        finish_reason=g.finish_reason,
        scores=scores_to_pb(g.scores),
    )


def generation_from_pb(r: pb.GenerateResponse) -> Generation:
    """Decodes one answer (`token_ids [n]` int64; the statistics as `convert.scores_from_pb`)."""
    return Generation(
        prompt_id=r.prompt_id,
        sample_index=int(r.sample_index),
        token_ids=np.asarray(r.token_ids, dtype=np.int64),
        finish_reason=r.finish_reason,
        scores=dataclasses.replace(scores_from_pb(r.scores), candidate_logprobs=None),  # Generate asks for none
    )

