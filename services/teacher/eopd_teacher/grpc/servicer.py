"""`eopd.v1.TeacherService` on gRPC: shape conversion around the teacher's service
(`service.TeacherService`): a protobuf request becomes a core request, the service's answer a
protobuf reply. The ScoreStream loop itself is `stream_session.StreamSession`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from eopd.v1 import teacher_pb2 as pb
from eopd.v1 import teacher_pb2_grpc as pb_grpc

from ..convert import (STREAM_ENDING_KEY, generate_request_from_pb, generation_to_pb, head_to_pb, info_to_pb,
                       score_request_from_pb, scores_to_pb)
from ..serving.batcher import Overloaded
from ..serving.service import CLIENT_ID_HEADER, TeacherService, client_from
from ..serving.shares import Identities
from ..validation import GENERATE_FIELDS, SCORE_FIELDS
from .stream_session import StreamSession, announced_refusal

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TeacherService"].full_name

def wants_stream_ending(context: grpc.aio.ServicerContext) -> bool:
    return any(k == STREAM_ENDING_KEY and v == "1" for k, v in context.invocation_metadata() or ())


def peer_of(context: grpc.aio.ServicerContext) -> str:
    """The caller's address without its port ("ipv4:1.2.3.4", "ipv6:[::1]")."""
    return (context.peer() or "unknown").rsplit(":", 1)[0]


def client_key(context: grpc.aio.ServicerContext) -> str:
    """Who a request is from, for max_inflight_tokens_per_client and the batcher's fair queuing:
    the x-eopd-client metadata, else the peer address without its port."""
    given = next((v for k, v in context.invocation_metadata() or () if k == CLIENT_ID_HEADER and v), None)
    return client_from(given, peer_of(context))


def client_share_key(context: grpc.aio.ServicerContext, identities: Identities) -> str:
    """Whose share of the global limits a call counts against (`shares.Identities.key`): its verified
    client certificate's name or the bearer token it presented, at its address, else its address."""
    authorization = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
    names = (context.auth_context() or {}).get("x509_common_name") or ()
    certificate = names[0].decode(errors="replace") if names else None
    return identities.key(peer_of(context), authorization, certificate)


class TeacherServicer(pb_grpc.TeacherServiceServicer):
    """protobuf <-> core types around `service`."""

    def __init__(self, service: TeacherService):
        self.service = service

    async def _score(self, request: pb.ScoreRequest, client: str, share: str, *, stream: bool) -> pb.ScoreResponse:
        results = await self.service.score(score_request_from_pb(request), client, SCORE_FIELDS, require_request_id=stream,
                                           share_key=share)
        started = time.perf_counter()
        response = pb.ScoreResponse(request_id=request.request_id, results=[scores_to_pb(r) for r in results])
        self.service.state.metrics.encode.observe(time.perf_counter() - started)
        return response

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        share = client_share_key(context, self.service.state.identities)
        return await self._score(request, client_key(context), share, stream=False)

    async def ScoreStream(
        self, request_iterator: AsyncIterator[pb.ScoreRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ScoreResponse]:
        """Serves requests concurrently as they arrive (at most
        stream_session.MAX_INFLIGHT_PER_STREAM at once: beyond that, reading pauses and HTTP/2
        flow control pushes back on the client). A request that fails on its own (invalid, over a
        per-request limit, an engine error, a request_id already in flight) is answered in band
        (`ScoreResponse.error`) and the stream goes on. A stream-level failure (overload,
        draining) ends the stream with its error without waiting for the client to send more,
        after the requests already in flight are answered (and, for a client that asked with
        `eopd-stream-ending: 1`, after announcing the end and letting it half-close)."""
        state = self.service.state
        share = client_share_key(context, state.identities)
        streams = state.streams
        if not streams.try_take(1, share):
            if streams.refusal(1, share) == "share":
                refused = Overloaded(streams.share_message("streams open", "max_streams", share))
            else:
                refused = Overloaded(f"{streams.held} streams open, limit {streams.limit}; retry later")
            # Announced in band like any stream-level end, while the waits for the half-close stay
            # bounded (`refusing_streams`: max_streams and its shares again); beyond, the status alone.
            if wants_stream_ending(context) and state.refusing_streams.try_take(1, share):
                try:
                    async for ending in announced_refusal(refused, request_iterator):
                        yield ending
                finally:
                    state.refusing_streams.give(1, share)
            raise refused
        slot = streams  # the limit that holds this stream's slot

        def given_up() -> None:
            """It took no answers for the idle timeout: its `max_streams` slot goes to the pool of
            given-up streams while gRPC still holds its answer (stream_session's docstring)."""
            nonlocal slot
            if state.stalled_streams.try_take(1, share):
                streams.give(1, share)
                slot = state.stalled_streams

        try:
            client = client_key(context)

            async def score(request: pb.ScoreRequest) -> pb.ScoreResponse:
                return await self._score(request, client, share, stream=True)

            session = StreamSession(score, state.metrics, state.request_bytes, state.settings.stream_idle_timeout_s,
                                    announce=wants_stream_ending(context), client=share, on_stalled=given_up)
            async for response in session.responses(request_iterator):
                yield response
        finally:
            slot.give(1, share)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        async for g in self.service.generate(generate_request_from_pb(request), client_key(context), GENERATE_FIELDS, deadline,
                                             share_key=client_share_key(context, self.service.state.identities)):
            yield generation_to_pb(request.request_id, g)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        return info_to_pb(self.service.model_info())

    async def GetOutputHead(self, request: pb.GetOutputHeadRequest, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[pb.OutputHeadChunk]:
        """The output head in chunks of half the message limit (`convert.head_to_pb`)."""
        head = self.service.output_head()
        for chunk in head_to_pb(head, self.service.state.settings.max_message_bytes // 2):
            yield chunk
