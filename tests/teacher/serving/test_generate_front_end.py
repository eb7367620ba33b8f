"""`TeacherService.generate`, the entry both front ends use (the HTTP `/v1/completions` and the
gRPC Generate): the same validation, batcher, metrics and answers as the gRPC Generate, on a real
in-process server (tiny-random). The gRPC request and answer shapes are `convert`'s."""

from __future__ import annotations

import asyncio

import pytest

from eopd.v1 import teacher_pb2 as pb
from eopd_teacher.client import AsyncTeacherClient
from eopd_teacher.convert import generate_request_from_pb, generation_to_pb
from eopd_teacher.server import TeacherServer
from eopd_teacher.settings import TeacherSettings
from eopd_teacher.validation import GENERATE_FIELDS, InvalidRequest

pytestmark = pytest.mark.integration


def test_generate_request_matches_grpc_generate():
    async def run():
        server = TeacherServer(TeacherSettings(model="tiny-random", grpc_port=0, http_port=0, compile_statistics=False,
                                               insecure_no_auth=True))
        await server.start()
        try:
            for _ in range(600):
                if server.state.info is not None:
                    break
                await asyncio.sleep(0.1)
            service = server.service

            async def generate_request(req: pb.GenerateRequest, client: str) -> list[pb.GenerateResponse]:
                return [generation_to_pb(req.request_id, g) async for g in service.generate(generate_request_from_pb(req), client, GENERATE_FIELDS)]

            req = pb.GenerateRequest(request_id="http-1", prompts=[pb.Prompt(id="a", token_ids=[1, 2, 3]), pb.Prompt(id="b", token_ids=[4])],
                                     num_samples=2, max_new_tokens=4, temperature=1.0, seed=5, top_k=3)
            answers = await generate_request(req, "front-end")
            with pytest.raises(InvalidRequest, match=r"^max_new_tokens: required"):
                await generate_request(pb.GenerateRequest(prompts=[pb.Prompt(id="a", token_ids=[1])]), "front-end")
            async with AsyncTeacherClient(f"127.0.0.1:{server.grpc_port}") as c:
                gens = await c.generate({"a": [1, 2, 3], "b": [4]}, num_samples=2, max_new_tokens=4, seed=5, top_k=3)
            return answers, gens, server.metrics.generations._value.get(), server.state.inflight_tokens
        finally:
            await server.stop()

    answers, gens, generated, inflight = asyncio.run(run())
    assert [(a.request_id, a.prompt_id, a.sample_index) for a in answers] == [("http-1", p, j) for p in "ab" for j in range(2)]
    assert [list(a.token_ids) for a in answers] == [g.token_ids.tolist() for g in gens]
    assert [list(a.scores.token_logprobs) for a in answers] == [g.scores.token_logprobs.tolist() for g in gens]
    assert generated == 8 and inflight == {}
