"""The gRPC shapes <-> core types: `eopd.v1` requests into the service's `ScoreRequest` /
`GenerateRequest`, its answers back (validation is the service's, `validation.py`, with the gRPC
field names).

Shared by both ends of the wire (the gRPC front end and the client); the HTTP API has its own
shapes (`http/openai_compat.py`) and never meets a protobuf message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:  # the head's tensors need torch: a client-only install imports this module without it
    from eopd_common.output_head import OutputHead

# Trailing metadata on a RESOURCE_EXHAUSTED that retrying cannot cure (the request itself is over a
# per-request limit): `eopd-retryable: 0`.
NOT_RETRYABLE_KEY = "eopd-retryable"
# Request metadata of a ScoreStream client that wants the end of the stream announced in band
# (ScoreResponse.ending) before the status, and half-closes when it is (see teacher.proto).
STREAM_ENDING_KEY = "eopd-stream-ending"
# ScoreRequest.hidden_states / SequenceScores.hidden_states_dtype <-> the core's dtype names ("": none).
HIDDEN_TO_PB = {"": pb.HIDDEN_STATES_NONE, "bfloat16": pb.HIDDEN_STATES_BF16, "float32": pb.HIDDEN_STATES_FP32}
HIDDEN_FROM_PB = {v: k for k, v in HIDDEN_TO_PB.items()}


def hidden_dtype_from_pb(value: int) -> str:
    """The dtype name of a HiddenStates value; an unknown value (a newer client) is kept as
    `unknown(N)`, which validation refuses naming the field."""
    return HIDDEN_FROM_PB.get(value, f"unknown({value})")


def score_request_from_pb(req: pb.ScoreRequest) -> ScoreRequest:
    return ScoreRequest(
        sequences=[ScoreSequence(s.id, np.asarray(s.token_ids, dtype=np.int64), int(s.score_from), int(s.num_candidates),
                                 np.asarray(s.candidate_ids, dtype=np.int64) if s.candidate_ids else None)
                   for s in req.sequences],
        request_id=req.request_id, top_k=int(req.top_k), temperature=float(req.temperature),
        hidden_states=hidden_dtype_from_pb(req.hidden_states),
    )


def generate_request_from_pb(req: pb.GenerateRequest) -> GenerateRequest:
    return GenerateRequest(
        prompts=[GeneratePrompt(p.id, np.asarray(p.token_ids, dtype=np.int64)) for p in req.prompts],
        max_new_tokens=int(req.max_new_tokens), request_id=req.request_id, num_samples=int(req.num_samples),
        temperature=float(req.temperature), top_p=float(req.top_p), stop_token_ids=tuple(req.stop_token_ids),
        seed=int(req.seed) if req.HasField("seed") else None, top_k=int(req.top_k),
        score_temperature=float(req.score_temperature), hidden_states=hidden_dtype_from_pb(req.hidden_states),
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
    if s.hidden_states is not None:
        out.hidden_states = s.hidden_states
        out.hidden_states_dtype = HIDDEN_TO_PB[s.hidden_dtype]
        out.hidden_size = s.hidden_size
        out.output_head_fingerprint = s.output_head_fingerprint
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
        hidden_states=r.hidden_states if r.hidden_states else None,
        hidden_dtype=hidden_dtype_from_pb(r.hidden_states_dtype) if r.hidden_states else "",
        hidden_size=int(r.hidden_size),
        output_head_fingerprint=r.output_head_fingerprint,
    )


def info_to_pb(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(**info.__dict__)


def info_from_pb(m: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(**{f: getattr(m, f) for f in ModelInfo.__dataclass_fields__})


def head_info_to_pb(head: OutputHead) -> pb.OutputHeadInfo:
    i = head.info
    return pb.OutputHeadInfo(model=i.model, fingerprint=head.fingerprint, vocab_size=i.vocab_size, hidden_size=i.hidden_size,
                             dtype=i.dtype, has_bias=i.has_bias, logit_factor=i.logit_factor,
                             final_logit_softcapping=i.final_logit_softcapping, valid_vocab_size=i.valid_vocab_size,
                             num_bytes=i.num_bytes)


def head_to_pb(head: OutputHead, chunk_bytes: int) -> Iterator[pb.OutputHeadChunk]:
    """GetOutputHead's answer: the head's payload in chunks of at most `chunk_bytes`, the first
    one carrying its OutputHeadInfo."""
    offset = 0
    for part in head.payload_parts(chunk_bytes):
        chunk = pb.OutputHeadChunk(offset=offset, data=bytes(part))
        if offset == 0:
            chunk.info.CopyFrom(head_info_to_pb(head))
        yield chunk
        offset += len(part)


def head_from_pb(chunks: Iterable[pb.OutputHeadChunk]) -> OutputHead:
    """The OutputHead of GetOutputHead's chunks, its size and fingerprint checked (ValueError
    naming what is wrong: a missing info, a chunk out of order, the payload's size or hash)."""
    info_pb, payload = None, bytearray()
    for i, chunk in enumerate(chunks):
        if i == 0:
            if not chunk.HasField("info"):
                raise ValueError("GetOutputHead: the first chunk carries no info")
            info_pb = chunk.info
        if chunk.offset != len(payload):
            raise ValueError(f"GetOutputHead: chunk {i} at offset {chunk.offset}, expected {len(payload)}")
        payload += chunk.data
    if info_pb is None:
        raise ValueError("GetOutputHead: the answer carries no chunk")
    from eopd_common.output_head import HeadInfo, OutputHead  # torch: only a caller that fetches a head needs it

    info = HeadInfo(model=info_pb.model, vocab_size=info_pb.vocab_size, hidden_size=info_pb.hidden_size, dtype=info_pb.dtype,
                    has_bias=info_pb.has_bias, logit_factor=info_pb.logit_factor,
                    final_logit_softcapping=info_pb.final_logit_softcapping, valid_vocab_size=info_pb.valid_vocab_size)
    return OutputHead.from_payload(info, payload, info_pb.fingerprint)


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

