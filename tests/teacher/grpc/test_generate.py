"""Generate on the real teacher server (tiny-random, a subprocess over TCP): the answers, their
statistics against Score's, determinism, stop ids, bad input, auth, deadlines, metrics."""

from __future__ import annotations

import asyncio
import math
import re
import urllib.request

import grpc
import numpy as np
import pytest

from eopd.v1 import teacher_pb2 as pb
from eopd.v1 import teacher_pb2_grpc as pb_grpc
from eopd_teacher.client import AsyncTeacherClient, TeacherClient
from tests.procs import running_teacher

pytestmark = pytest.mark.integration

PROMPTS = {"a": [1, 5, 7, 9, 11], "b": [3, 4], "c": list(range(100, 140))}


def _score_of(client: TeacherClient, prompt: list[int], g, **kw):
    """Score of prompt + the generated ids at the generated positions."""
    (s,) = client.score([(g.prompt_id, list(prompt) + g.token_ids.tolist(), len(prompt))], **kw)
    return s


def test_stream_of_all_generations_with_shapes(tiny_teacher):
    with TeacherClient(tiny_teacher.target) as c:
        info = c.info()
        gens = c.generate(PROMPTS, num_samples=3, max_new_tokens=6, seed=1, top_k=5)
    assert info.max_new_tokens == 1024 and info.max_generate_samples == 16
    assert [(g.prompt_id, g.sample_index) for g in gens] == [(p, j) for p in PROMPTS for j in range(3)]
    for g in gens:
        n = len(g.token_ids)
        assert 1 <= n <= 6 and g.finish_reason in ("stop", "length") and (g.finish_reason == "length") == (n == 6)
        assert g.token_ids.dtype == np.int64 and ((0 <= g.token_ids) & (g.token_ids < info.vocab_size)).all()
        s = g.scores
        assert s.seq_id == g.prompt_id and s.token_logprobs.shape == (n,) and s.entropies.shape == (n,)
        assert s.topk_ids.shape == (n, 5) and s.topk_logprobs.shape == (n, 5) and s.candidate_logprobs is None
        assert (s.token_logprobs <= 0).all() and (s.entropies >= 0).all()


def test_raw_stream_answers_one_message_per_generation(tiny_teacher):
    req = pb.GenerateRequest(request_id="raw", prompts=[pb.Prompt(id="x", token_ids=[1, 2, 3])], num_samples=2, max_new_tokens=3,
                             temperature=1.0, seed=5)
    with grpc.insecure_channel(tiny_teacher.target) as ch:
        answers = list(pb_grpc.TeacherServiceStub(ch).Generate(req, timeout=60))
    assert sorted(a.sample_index for a in answers) == [0, 1]
    assert all(a.request_id == "raw" and a.prompt_id == "x" and a.scores.id == "x" for a in answers)
    assert all(len(a.scores.token_logprobs) == len(a.token_ids) and a.scores.top_k == 16 for a in answers)


@pytest.mark.parametrize("score_temperature, top_k", [(1.0, 16), (2.0, 5)])
def test_statistics_equal_score_on_the_returned_tokens(tiny_teacher, score_temperature, top_k):
    with TeacherClient(tiny_teacher.target) as c:
        gens = c.generate(PROMPTS, num_samples=2, max_new_tokens=8, temperature=1.0, seed=7, top_k=top_k,
                          score_temperature=score_temperature)
        for g in gens:
            s = _score_of(c, PROMPTS[g.prompt_id], g, top_k=top_k, temperature=score_temperature)
            np.testing.assert_allclose(g.scores.token_logprobs, s.token_logprobs, atol=1e-5, rtol=0)
            np.testing.assert_allclose(g.scores.entropies, s.entropies, atol=1e-5, rtol=0)
            np.testing.assert_allclose(g.scores.topk_logprobs, s.topk_logprobs, atol=1e-5, rtol=0)
            np.testing.assert_array_equal(g.scores.topk_ids, s.topk_ids)


def test_greedy_is_the_argmax_of_score(tiny_teacher):
    with TeacherClient(tiny_teacher.target) as c:
        gens = c.generate(PROMPTS, num_samples=2, max_new_tokens=10, temperature=0.0)
        for g in gens:
            s = _score_of(c, PROMPTS[g.prompt_id], g, top_k=2)
            np.testing.assert_array_equal(g.token_ids, s.topk_ids[:, 0])
            assert (s.topk_logprobs[:, 0] - s.topk_logprobs[:, 1] > 1e-4).all(), "a near tie makes this test meaningless"
    by_prompt = {}
    for g in gens:  # greedy samples of one prompt are the same
        by_prompt.setdefault(g.prompt_id, []).append(g.token_ids.tolist())
    assert all(a == b for a, b in by_prompt.values())


def test_seed_determinism(tiny_teacher):
    kw = dict(num_samples=3, max_new_tokens=8, temperature=1.0)
    with TeacherClient(tiny_teacher.target) as c:
        first = c.generate(PROMPTS, seed=11, **kw)
        again = c.generate(PROMPTS, seed=11, **kw)
        other = c.generate(PROMPTS, seed=12, **kw)
        # Prompt "a" at index 0 alone: its samples do not depend on the other prompts of the request.
        alone = c.generate({"a": PROMPTS["a"]}, seed=11, **kw)
    assert [g.token_ids.tolist() for g in first] == [g.token_ids.tolist() for g in again]
    assert [g.token_ids.tolist() for g in first[:3]] == [g.token_ids.tolist() for g in alone]
    assert [g.token_ids.tolist() for g in first] != [g.token_ids.tolist() for g in other]
    samples = [g.token_ids.tolist() for g in first[:3]]
    assert len({tuple(s) for s in samples}) == 3, "samples of one prompt are drawn independently"


def test_stop_ids_end_a_generation_and_are_kept(tiny_teacher):
    prompt = PROMPTS["a"]
    with TeacherClient(tiny_teacher.target) as c:
        (free,) = c.generate([prompt], max_new_tokens=10, temperature=0.0)
        stop_id = int(free.token_ids[3])
        cut = free.token_ids.tolist().index(stop_id) + 1
        (stopped,) = c.generate([prompt], max_new_tokens=10, temperature=0.0, stop_token_ids=[stop_id, 0])
        # Sampled: every stopped sample ends with the stop id, and it appears nowhere before.
        sampled = c.generate([prompt], num_samples=8, max_new_tokens=12, temperature=1.0, seed=3,
                             stop_token_ids=[int(t) for t in free.scores.topk_ids[:, :8].ravel()])
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    assert stopped.finish_reason == "stop" and stopped.token_ids.tolist() == free.token_ids[:cut].tolist()
    assert stopped.scores.token_logprobs.shape == (cut,)
    np.testing.assert_allclose(stopped.scores.token_logprobs, free.scores.token_logprobs[:cut], atol=1e-5)
    stops = set(int(t) for t in free.scores.topk_ids[:, :8].ravel())
    for g in sampled:
        ids = g.token_ids.tolist()
        assert not stops & set(ids[:-1])
        assert (g.finish_reason == "stop") == (ids[-1] in stops)


def _generate_raw(target: str, req: pb.GenerateRequest, metadata=()):
    with grpc.insecure_channel(target) as ch:
        return list(pb_grpc.TeacherServiceStub(ch).Generate(req, timeout=60, metadata=metadata))


def _req(**kw) -> pb.GenerateRequest:
    prompts = kw.pop("prompts", [pb.Prompt(id="p0", token_ids=[1, 2, 3])])
    fields = dict(request_id="bad", max_new_tokens=4) | kw
    return pb.GenerateRequest(prompts=prompts, **fields)


BAD = [
    (dict(prompts=[]), grpc.StatusCode.INVALID_ARGUMENT, r"^prompts: at least one prompt"),
    (dict(prompts=[pb.Prompt(id="p0", token_ids=[])]), grpc.StatusCode.INVALID_ARGUMENT, r"prompts\[0\]\.token_ids: empty prompt, id 'p0'"),
    (dict(prompts=[pb.Prompt(id="", token_ids=[1])]), grpc.StatusCode.INVALID_ARGUMENT, r"prompts\[0\]\.id: must be non-empty"),
    (dict(prompts=[pb.Prompt(id="x", token_ids=[1]), pb.Prompt(id="x", token_ids=[2])]), grpc.StatusCode.INVALID_ARGUMENT,
     r"prompts\[1\]\.id: duplicate prompt id 'x'"),
    (dict(prompts=[pb.Prompt(id="v", token_ids=[1, 49152])]), grpc.StatusCode.INVALID_ARGUMENT,
     r"prompts\[0\]\.token_ids\[1\]: token id 49152 is outside the vocabulary .*'v'"),
    (dict(prompts=[pb.Prompt(id="long", token_ids=[1] * 2040)], max_new_tokens=9), grpc.StatusCode.INVALID_ARGUMENT,
     r"prompts\[0\]\.token_ids: 2040 prompt tokens \+ max_new_tokens 9 exceed the model's context of 2048, id 'long'"),
    (dict(max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, r"^max_new_tokens: required"),
    (dict(max_new_tokens=1025), grpc.StatusCode.INVALID_ARGUMENT, r"^max_new_tokens: 1025 exceeds the server's maximum 1024"),
    (dict(num_samples=17), grpc.StatusCode.INVALID_ARGUMENT, r"^num_samples: 17 exceeds the server's maximum 16"),
    (dict(temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT, r"^temperature: -0.5 must be 0 \(greedy\)"),
    (dict(temperature=math.nan), grpc.StatusCode.INVALID_ARGUMENT, r"^temperature: nan"),
    (dict(top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, r"^top_p: 1.5 must be"),
    (dict(top_p=-0.1), grpc.StatusCode.INVALID_ARGUMENT, r"^top_p: -0.1"),
    (dict(stop_token_ids=[2, -3]), grpc.StatusCode.INVALID_ARGUMENT, r"^stop_token_ids\[1\]: token id -3 is outside"),
    (dict(top_k=65), grpc.StatusCode.INVALID_ARGUMENT, r"^top_k: 65 exceeds the maximum 64"),
    (dict(score_temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, r"^score_temperature: -1.0 must be 0"),
    (dict(prompts=[pb.Prompt(id=f"big{i}", token_ids=[1] * 1000) for i in range(20)], max_new_tokens=1000, num_samples=16),
     grpc.StatusCode.RESOURCE_EXHAUSTED, r"^prompts: \(prompt tokens \+ max_new_tokens 1000\) x num_samples 16"),
]


@pytest.mark.parametrize("fields, code, match", BAD, ids=[m.split(":")[0].strip("^\\") for _, _, m in BAD])
def test_bad_field_is_refused_naming_it_and_the_server_still_serves(tiny_teacher, fields, code, match):
    with pytest.raises(grpc.RpcError) as e:
        _generate_raw(tiny_teacher.target, _req(**fields))
    assert e.value.code() == code
    assert re.search(match, e.value.details()), e.value.details()
    with TeacherClient(tiny_teacher.target) as c:
        assert len(c.score([("ok", [1, 2, 3], 1)])) == 1


def test_sync_and_async_clients_agree(tiny_teacher):
    kw = dict(num_samples=2, max_new_tokens=5, temperature=0.8, top_p=0.9, seed=21, top_k=3)
    with TeacherClient(tiny_teacher.target) as c:
        sync = c.generate([[1, 2, 3], [4, 5]], **kw)

    async def run():
        async with AsyncTeacherClient(tiny_teacher.target) as c:
            return await asyncio.gather(c.generate([[1, 2, 3], [4, 5]], **kw), c.generate([[7, 8]], max_new_tokens=3, temperature=0))

    asy, greedy = asyncio.run(run())
    assert [(g.prompt_id, g.sample_index, g.token_ids.tolist()) for g in sync] == \
           [(g.prompt_id, g.sample_index, g.token_ids.tolist()) for g in asy]
    assert [g.prompt_id for g in sync] == ["0", "0", "1", "1"] and len(greedy) == 1 and len(greedy[0].token_ids) == 3


def test_deadline_and_metrics(tiny_teacher):
    with TeacherClient(tiny_teacher.target, retry_timeout=0) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate([list(range(1, 200))] * 40, num_samples=4, max_new_tokens=64, timeout=0.05)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert len(c.generate([[1, 2]], max_new_tokens=2)) == 1
    with urllib.request.urlopen(f"{tiny_teacher.http}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'eopd_teacher_requests_total{code="OK",method="Generate"}' in text
    assert 'eopd_teacher_requests_total{code="INVALID_ARGUMENT",method="Generate"}' in text
    for name in ("eopd_teacher_generations_total", "eopd_teacher_tokens_generated_total"):
        value = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))
        assert value > 0, name


def test_unauthenticated_generate_is_refused(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with running_teacher("tiny-random", "--auth-token-file", str(token_file)) as proc:
        with pytest.raises(grpc.RpcError) as e:
            _generate_raw(proc.target, _req())
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            _generate_raw(proc.target, _req(), metadata=(("authorization", "Bearer wrong"),))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with TeacherClient(proc.target, auth_token="s3cret") as c:
            (g,) = c.generate([[1, 2, 3]], max_new_tokens=3, temperature=0)
        assert len(g.token_ids) == 3
