"""`/v1/completions` with `max_tokens` > 1 on a real teacher (tiny-random, transformers engine, fp32)
over TCP: served by the Generate path, answered in vLLM's shape. The same tokens and numbers as a
gRPC Generate of the same request (seeded), greedy = Score's top-1, echo with prompt and completion
log-probs, stop ids (kept in token_ids, out of the text, `stop_reason`), vLLM's default max_tokens,
and every refused field a 400 naming it with the server still serving."""

from __future__ import annotations

import numpy as np
import pytest
import requests

from eopd_teacher.client import TeacherClient
from tests.procs import running_teacher

pytestmark = pytest.mark.integration

MAX_TOP_K = 20
MAX_NEW = 24
MAX_SAMPLES = 4
MAX_TOKENS = 2000
PROMPTS = [[17, 4031, 950, 12, 8811, 301], [5, 60, 700, 8000]]


@pytest.fixture(scope="module")
def teacher():
    with running_teacher("tiny-random", "--max-top-k", str(MAX_TOP_K), "--max-new-tokens", str(MAX_NEW),
                         "--max-generate-samples", str(MAX_SAMPLES), "--max-tokens-per-request", str(MAX_TOKENS),
                         "--max-batch-wait-ms", "5") as proc:
        yield proc


@pytest.fixture(scope="module")
def tokenizer():
    from eopd_common.models import default_cache_dir, load_tokenizer

    return load_tokenizer("tiny-random", default_cache_dir())


def _post(proc, payload: dict) -> requests.Response:
    return requests.post(f"{proc.http}/v1/completions", json=payload, timeout=120)


def test_sampled_completions_equal_grpc_generate(teacher, tokenizer):
    """n samples per prompt, seeded: the choices are the gRPC Generate answers of the same request
    (same seed, prompt order and sample order), vLLM's shape around them."""
    k = 3
    body = {"model": "tiny-random", "prompt": PROMPTS, "max_tokens": 6, "n": 2, "temperature": 1.0, "top_p": 0.95,
            "seed": 5, "logprobs": k, "return_token_ids": True}
    r = _post(teacher, body)
    assert r.status_code == 200, r.text
    got = r.json()
    with TeacherClient(teacher.target) as c:
        ref = c.generate(PROMPTS, num_samples=2, max_new_tokens=6, temperature=1.0, top_p=0.95, seed=5, top_k=k)
    assert got["object"] == "text_completion" and len(got["choices"]) == len(ref) == 4
    for i, (choice, g) in enumerate(zip(got["choices"], ref, strict=True)):
        ids = g.token_ids.tolist()
        assert choice["index"] == i and choice["token_ids"] == ids and choice["prompt_token_ids"] == PROMPTS[i // 2]
        assert choice["finish_reason"] == g.finish_reason
        assert choice["text"] == tokenizer.decode(ids[:-1] if g.finish_reason == "stop" else ids, skip_special_tokens=True)
        lp = choice["logprobs"]
        assert lp["tokens"] == [tokenizer.decode([t]) for t in ids] and len(lp["text_offset"]) == len(ids)
        np.testing.assert_allclose(lp["token_logprobs"], g.scores.token_logprobs, atol=1e-6, rtol=0)
        np.testing.assert_allclose(choice["completion_entropies"], g.scores.entropies, atol=1e-6, rtol=0)
        for t, top in enumerate(lp["top_logprobs"]):  # the token itself first, then the top k (by decoded token)
            assert next(iter(top)) == lp["tokens"][t]
            want = {tokenizer.decode([int(tid)]): float(v) for tid, v in zip(g.scores.topk_ids[t], g.scores.topk_logprobs[t])}
            assert all(abs(top[s] - v) <= 1e-6 for s, v in want.items())
            assert len(top) <= k + 1
        assert choice["prompt_logprobs"] is None and "prompt_entropies" not in choice
    assert got["usage"] == {"prompt_tokens": sum(map(len, PROMPTS)), "completion_tokens": sum(len(g.token_ids) for g in ref),
                            "total_tokens": sum(map(len, PROMPTS)) + sum(len(g.token_ids) for g in ref),
                            "prompt_tokens_details": None, "completion_tokens_details": None}
    # the same request again: the same tokens (seeded); another seed: others
    again = _post(teacher, body).json()
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in got["choices"]]
    other = _post(teacher, dict(body, seed=6)).json()
    assert [c["token_ids"] for c in other["choices"]] != [c["token_ids"] for c in got["choices"]]


def test_greedy_is_scores_top1_and_extends_max_tokens_1(teacher):
    r = _post(teacher, {"prompt": PROMPTS, "max_tokens": 5, "temperature": 0.0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    one = _post(teacher, {"prompt": PROMPTS, "max_tokens": 1, "temperature": 0.0, "return_token_ids": True}).json()
    with TeacherClient(teacher.target) as c:
        for prompt, choice, first in zip(PROMPTS, r.json()["choices"], one["choices"], strict=True):
            ids = choice["token_ids"]
            assert ids[0] == first["token_ids"][0]  # max_tokens 1 gives the greedy next token: the same one
            (s,) = c.score([("g", prompt + ids, len(prompt))], top_k=1)
            assert ids == s.topk_ids[:, 0].tolist()
    assert r.json()["choices"][0]["logprobs"] is None


def test_echo_with_prompt_and_completion_logprobs(teacher, tokenizer):
    prompt = "Hello there, teacher"
    r = _post(teacher, {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "echo": True, "logprobs": 2,
                        "prompt_logprobs": 1, "return_token_ids": True})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    ids, out = ch["prompt_token_ids"], ch["token_ids"]
    assert ids == tokenizer(prompt)["input_ids"] and len(out) >= 1
    assert ch["text"].startswith(prompt)
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(ids) + len(out)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    plp = ch["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids) == len(ch["prompt_entropies"])
    for t in range(1, len(ids)):  # the echoed prompt's entries are its prompt log-probs
        assert lp["token_logprobs"][t] == plp[t][str(ids[t])]["logprob"]
    with TeacherClient(teacher.target) as c:
        (s,) = c.score([("e", ids + out, 1)], top_k=2)
    np.testing.assert_allclose(lp["token_logprobs"][1:], s.token_logprobs, atol=1e-5, rtol=0)
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == len(out)


def test_stop_token_ids_and_the_default_max_tokens(teacher):
    greedy = _post(teacher, {"prompt": PROMPTS[0], "temperature": 0.0, "return_token_ids": True}).json()["choices"][0]
    assert len(greedy["token_ids"]) == 16 or greedy["finish_reason"] == "stop"  # vLLM's default max_tokens, 16
    stop_id = greedy["token_ids"][2]
    end = greedy["token_ids"].index(stop_id) + 1
    r = _post(teacher, {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.0, "stop_token_ids": [stop_id],
                        "return_token_ids": True, "logprobs": 0})
    ch = r.json()["choices"][0]
    assert ch["token_ids"] == greedy["token_ids"][:end] and ch["finish_reason"] == "stop" and ch["stop_reason"] == stop_id
    assert len(ch["logprobs"]["tokens"]) == end  # the stop id has its log-prob entry ...
    no_stop = _post(teacher, {"prompt": PROMPTS[0], "max_tokens": end - 1, "temperature": 0.0}).json()["choices"][0]
    assert ch["text"] == no_stop["text"]  # ... but not its text


BAD = [
    ({"max_tokens": MAX_NEW + 1}, "max_tokens"),
    ({"max_tokens": 4, "n": MAX_SAMPLES + 1}, "n"),
    ({"max_tokens": 4, "stop_token_ids": [49152]}, "stop_token_ids[0]"),
    ({"max_tokens": 4, "stop": "\n"}, "stop"),
    ({"max_tokens": 4, "top_k": 5}, "top_k"),
    ({"max_tokens": 4, "top_p": 0}, "top_p"),
    ({"max_tokens": 4, "temperature": 1e-9}, "temperature"),
    ({"max_tokens": 4, "seed": -3}, "seed"),
    ({"max_tokens": 4, "logprobs": MAX_TOP_K + 1}, "logprobs"),
    ({"max_tokens": 4, "prompt": [[1, 2], [3, 49152]]}, "prompt[1][1]"),
]


@pytest.mark.parametrize(("fields", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_generation_fields_are_400_naming_the_field(teacher, fields, param):
    r = _post(teacher, {"prompt": [1, 2, 3], **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "BadRequestError" and param in err["message"]
    ok = _post(teacher, {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0.0})  # still serving
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None


def test_over_the_per_request_token_limit_is_413(teacher):
    """(prompt + max_tokens) x n over max_tokens_per_request: the Generate path's limit, 413."""
    r = _post(teacher, {"prompt": [[1] * 300] * 5, "max_tokens": MAX_NEW, "n": MAX_SAMPLES})  # 6,480 > MAX_TOKENS
    assert r.status_code == 413 and r.json()["error"]["type"] == "RequestEntityTooLargeError", r.text
    assert str(MAX_TOKENS) in r.json()["error"]["message"]
    assert _post(teacher, {"prompt": [5, 6], "max_tokens": 2}).status_code == 200

