"""A gRPC request validated as the gRPC front end does (`convert` to core types, then
`validation` with the gRPC field names): the unit tests of admission feed protobuf messages."""

from __future__ import annotations

from eopd.v1 import teacher_pb2 as pb
from eopd_teacher.convert import generate_request_from_pb, score_request_from_pb
from eopd_teacher.types import GenerateItem, ModelInfo, ScoreItem
from eopd_teacher.validation import GENERATE_FIELDS, SCORE_FIELDS, generate_items, score_items


def items_from_request(
    req: pb.ScoreRequest, info: ModelInfo, *, require_request_id: bool = False, max_response_bytes: int | None = None
) -> list[ScoreItem]:
    """A gRPC ScoreRequest validated as the service does (`validation.score_items`)."""
    return score_items(score_request_from_pb(req), info, SCORE_FIELDS, require_request_id=require_request_id,
                       max_response_bytes=max_response_bytes)


def generate_items_from_request(req: pb.GenerateRequest, info: ModelInfo, *,
                                max_response_bytes: int | None = None) -> list[GenerateItem]:
    """A gRPC GenerateRequest validated as the service does (`validation.generate_items`)."""
    return generate_items(generate_request_from_pb(req), info, GENERATE_FIELDS, max_response_bytes=max_response_bytes)
