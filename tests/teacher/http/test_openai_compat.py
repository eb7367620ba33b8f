"""The vLLM-compatible `/v1/completions` of a real teacher (tiny-random, fp32) over TCP: vLLM's
shape, parity with the gRPC answer (same engine: 1e-6), every bad field a 400 in vLLM's error shape
naming the field with the server still serving, per-request limits (413), auth and metrics."""

from __future__ import annotations

import numpy as np
import pytest
import requests

from eopd_teacher.client import TeacherClient
from tests.procs import running_teacher

pytestmark = pytest.mark.integration

MAX_TOP_K = 100
MAX_TOKENS = 600
TOKEN = "compat-token-for-tests"


@pytest.fixture(scope="module")
def teacher():
    with running_teacher("tiny-random", "--max-top-k", str(MAX_TOP_K), "--max-tokens-per-request", str(MAX_TOKENS),
                         "--max-batch-wait-ms", "5") as proc:
        yield proc


def _post(proc, payload: dict, **kw) -> requests.Response:
    return requests.post(f"{proc.http}/v1/completions", json=payload, timeout=60, **kw)


def _seqs(seed: int, count: int, vocab: int = 49152) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(3, 40))).tolist() for _ in range(count)]


def test_models_and_health(teacher):
    models = requests.get(f"{teacher.http}/v1/models", timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-random"
    assert models["data"][0]["max_model_len"] > 0
    assert requests.get(f"{teacher.http}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_prompt_logprobs_equal_grpc(teacher, temperature):
    """vLLM's shape (null first, then per position the prompt's token and the top k keyed by id
    string, {logprob, rank, decoded_token}), `prompt_entropies`, and the gRPC numbers to 1e-6.
    With max_tokens 1 eopd scores each prompt plus one filler token (the last position gives the
    completion token): the gRPC reference is that same request."""
    k = 8
    seqs = _seqs(1, 5)
    r = _post(teacher, {"model": "tiny-random", "prompt": seqs, "max_tokens": 1, "temperature": temperature,
                        "prompt_logprobs": k, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and len(body["choices"]) == len(seqs)
    assert body["usage"] == {"prompt_tokens": sum(map(len, seqs)), "completion_tokens": len(seqs),
                             "total_tokens": sum(map(len, seqs)) + len(seqs), "prompt_tokens_details": None,
                             "completion_tokens_details": None}
    with TeacherClient(teacher.target) as c:
        ref = c.score([(str(i), s + [0], 1) for i, s in enumerate(seqs)], top_k=k, temperature=temperature)
    for ids, choice, g in zip(seqs, body["choices"], ref, strict=True):
        plp, ent = choice["prompt_logprobs"], choice["prompt_entropies"]
        assert plp[0] is None and ent[0] is None and len(plp) == len(ids) == len(ent)
        np.testing.assert_allclose(ent[1:], g.entropies[:-1], atol=1e-6, rtol=0)
        for t in range(1, len(ids)):
            pos = plp[t]
            assert all(set(e) == {"logprob", "rank", "decoded_token"} for e in pos.values())
            assert abs(pos[str(ids[t])]["logprob"] - g.token_logprobs[t - 1]) <= 1e-6
            top = [(int(tid), e) for tid, e in pos.items() if e["rank"] <= k]
            top.sort(key=lambda x: x[1]["rank"])
            assert [tid for tid, _ in top] == g.topk_ids[t - 1].tolist()  # ranks agree
            np.testing.assert_allclose([e["logprob"] for _, e in top], g.topk_logprobs[t - 1], atol=1e-6, rtol=0)
            assert len(pos) == k + (str(ids[t]) not in {str(i) for i in g.topk_ids[t - 1].tolist()})
        # max_tokens 1: the greedy next token, the top 1 of the last position
        assert choice["token_ids"] == [int(g.topk_ids[-1, 0])] and choice["prompt_token_ids"] == ids
        assert choice["text"] and choice["finish_reason"] == "length"


def test_max_tokens_0_equals_grpc_for_the_same_sequences(teacher):
    seqs = _seqs(2, 4)
    body = _post(teacher, {"prompt": seqs, "max_tokens": 0, "prompt_logprobs": 4, "temperature": 1.3}).json()
    with TeacherClient(teacher.target) as c:
        ref = c.score([(str(i), s, 1) for i, s in enumerate(seqs)], top_k=4, temperature=1.3)
    for ids, choice, g in zip(seqs, body["choices"], ref, strict=True):
        assert choice["text"] == "" and choice["token_ids"] is None
        own = [choice["prompt_logprobs"][t][str(ids[t])]["logprob"] for t in range(1, len(ids))]
        np.testing.assert_allclose(own, g.token_logprobs, atol=1e-6, rtol=0)
        np.testing.assert_allclose(choice["prompt_entropies"][1:], g.entropies, atol=1e-6, rtol=0)
    assert body["usage"]["completion_tokens"] == 0


def test_echo_logprobs_and_text_prompt(teacher):
    r = _post(teacher, {"prompt": "Hello there, teacher", "max_tokens": 0, "echo": True, "logprobs": 2,
                        "prompt_logprobs": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    ids = ch["prompt_token_ids"]
    assert len(ids) >= 3 and ch["token_ids"] == [] and ch["text"] == "Hello there, teacher"
    lp = ch["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(ids) and lp["text_offset"][0] == 0
    for t in range(1, len(ids)):  # prompt_logprobs 0: only the prompt's token, same number as logprobs
        (only,) = ch["prompt_logprobs"][t].values()
        assert only["logprob"] == lp["token_logprobs"][t]
    assert r.json()["usage"]["completion_tokens"] == 0


BAD = [
    ({"prompt": [1, 2], "max_tokens": 1, "n": 2}, "n"),  # n > 1 only when generating (max_tokens > 1)
    ({"prompt": [1, 2], "max_tokens": -1}, "max_tokens"),
    ({"prompt": [1, 2], "max_tokens": 1, "stream": True}, "stream"),
    ({"prompt": [1, 2], "max_tokens": 1, "logit_bias": {"5": 1}}, "logit_bias"),
    ({"prompt": [1, 2], "max_tokens": 1, "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": [1, 2], "max_tokens": 0, "prompt_logprobs": MAX_TOP_K + 1}, "prompt_logprobs"),
    ({"prompt": [1, 2], "max_tokens": 0, "prompt_logprobs": -2}, "prompt_logprobs"),
    ({"prompt": [1, 2], "max_tokens": 1, "logprobs": MAX_TOP_K + 1}, "logprobs"),
    ({"prompt": [1, 2], "max_tokens": 1, "temperature": -1}, "temperature"),
    ({"prompt": [1, 2], "max_tokens": 1, "temperature": 1e-9}, "temperature"),
    ({"prompt": [[1, 2], [3, 49152]], "max_tokens": 0, "prompt_logprobs": 1}, "prompt[1][1]"),
    ({"prompt": [[1, 2], [3, -4]], "max_tokens": 0, "prompt_logprobs": 1}, "prompt[1][1]"),
    ({"prompt": [[1, 2], [1, "x"]], "max_tokens": 0}, "prompt[1][1]"),
    ({"prompt": [[1, 2], []], "max_tokens": 0}, "prompt[1]"),
    ({"prompt": [], "max_tokens": 0}, "prompt"),
    ({"max_tokens": 1}, "prompt"),
    ({"prompt": [1, 2], "max_tokens": 1, "model": "someone-else"}, "model"),
]


@pytest.mark.parametrize(("payload", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_fields_are_400_naming_the_field(teacher, payload, param):
    r = _post(teacher, payload)
    want = 404 if param == "model" else 400
    assert r.status_code == want, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == want and param in err["message"]
    assert err["type"] == ("NotFoundError" if want == 404 else "BadRequestError")
    ok = _post(teacher, {"prompt": [1, 2, 3], "max_tokens": 0, "prompt_logprobs": 1})  # still serving
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["prompt_logprobs"]) == 3


def test_malformed_bodies(teacher):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = requests.post(f"{teacher.http}/v1/completions", data=raw, headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] is None and "body" in r.json()["error"]["message"]


def test_per_request_limits_are_413(teacher):
    """The gRPC path's per-request token limit applies (413, the field named) and a context over
    the model's is a 400 naming the prompt; the server goes on."""
    big = [[1] * 400, [2] * 400]
    r = _post(teacher, {"prompt": big, "max_tokens": 0, "prompt_logprobs": 1})
    assert r.status_code == 413 and r.json()["error"]["type"] == "RequestEntityTooLargeError"
    assert str(MAX_TOKENS) in r.json()["error"]["message"]
    ctx = requests.get(f"{teacher.http}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    r = _post(teacher, {"prompt": [[1, 2], [1] * ctx], "max_tokens": 1})
    assert r.status_code in (400, 413)
    assert _post(teacher, {"prompt": [5, 6], "max_tokens": 1}).status_code == 200
    # a body over what the admissible tokens need (16 bytes a token, at least 1 MiB): 413 unread
    r = _post(teacher, {"prompt": "x " * (1 << 20), "max_tokens": 0})
    assert r.status_code == 413 and "body" in r.json()["error"]["message"]
    assert _post(teacher, {"prompt": [5, 6], "max_tokens": 1}).status_code == 200


def test_metrics_count_http_requests(teacher):
    before = _metric(teacher, 'eopd_teacher_requests_total{code="OK",method="/v1/completions"}')
    scored = _metric(teacher, "eopd_teacher_tokens_scored_total")
    assert _post(teacher, {"prompt": [1, 2, 3, 4], "max_tokens": 0, "prompt_logprobs": 2}).status_code == 200
    assert _metric(teacher, 'eopd_teacher_requests_total{code="OK",method="/v1/completions"}') == before + 1
    assert _metric(teacher, "eopd_teacher_tokens_scored_total") == scored + 3


def _metric(proc, name: str) -> float:
    for line in requests.get(f"{proc.http}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_auth_applies_to_http(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with running_teacher("tiny-random", "--auth-token-file", str(token_file)) as proc:
        payload = {"prompt": [1, 2, 3], "max_tokens": 0, "prompt_logprobs": 1}
        for headers in ({}, {"authorization": "Bearer wrong"}):
            assert _post(proc, payload, headers=headers).status_code == 401
            assert requests.get(f"{proc.http}/v1/models", headers=headers, timeout=10).status_code == 401
        assert requests.get(f"{proc.http}/health", timeout=10).status_code == 200  # a probe: open
        r = _post(proc, payload, headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and len(r.json()["choices"][0]["prompt_logprobs"]) == 3
