"""TeacherClient.score_stream: one ScoreStream call, no re-sending (AsyncTeacherClient's
machinery, with lanes, retries and stall detection, is `stream.py`)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator

import grpc

from eopd.v1 import teacher_pb2 as pb

from ..convert import scores_from_pb
from ..types import SequenceScores
from .channel import StreamTransport
from .requests import RequestFailed, ScoreBatch, status_code, build_request


# -- the blocking client's stream --------------------------------------------------------------
class _SyncStream:
    """One TeacherClient.score_stream call: the ids in flight, the problem found while writing
    (a duplicate id) and the call, shared by the request iterator (run by grpc's thread) and
    the reader."""

    def __init__(self, batches: Iterable[ScoreBatch]):
        self.batches = batches
        self.inflight: set[str] = set()
        self.problem: list[BaseException] = []
        self.call = None

    def requests(self) -> Iterator[pb.ScoreRequest]:
        for b in self.batches:
            rid = b.request_id or uuid.uuid4().hex
            if rid in self.inflight:
                self.problem.append(ValueError(f"request_id {rid!r} is already in flight on this score_stream; ids must be unique"))
                self.call.cancel()
                return
            self.inflight.add(rid)
            yield build_request(b.sequences, top_k=b.top_k, temperature=b.temperature, request_id=rid,
                                hidden_states=b.hidden_states)


def sync_score_stream(
    transport: StreamTransport, batches: Iterable[ScoreBatch], timeout: float | None, on_error: str
) -> Iterator[tuple[str, list[SequenceScores] | RequestFailed]]:
    """The body of TeacherClient.score_stream (see there)."""
    if on_error not in ("raise", "yield"):
        raise ValueError(f"on_error must be 'raise' or 'yield', not {on_error!r}")
    s = _SyncStream(batches)
    s.call = call = transport.open_stream(s.requests(), timeout=transport.timeout if timeout is None else timeout,
                                          metadata=transport.metadata)
    try:
        for resp in call:
            if resp.HasField("ending"):
                continue  # not asked for here (no eopd-stream-ending metadata); the status follows
            s.inflight.discard(resp.request_id)
            if resp.HasField("error"):
                failed = RequestFailed(resp.request_id, status_code(resp.error.code), resp.error.message)
                if on_error == "raise":
                    raise failed
                yield resp.request_id, failed
                continue
            yield resp.request_id, [scores_from_pb(r) for r in resp.results]
    except grpc.RpcError:
        if s.problem:
            raise s.problem[0] from None
        raise
    finally:
        call.cancel()
    if s.problem:
        raise s.problem[0]
