"""Pure logic of the vLLM shapes (openai_format.py, openai_generation.py): ranks, the -9999 clamp, echo
log-probs, the field named by a validation error, and the answer of max_tokens > 1."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from eopd_teacher.http.openai_format import (
    CompatError,
    CompletionRequest,
    Decoder,
    json_bytes_estimate,
    plan,
    prompt_logprobs,
    validation_error,
)
from eopd_teacher.http.openai_generation import Sampling, generation_response, sampling
from eopd_teacher.types import Generation, SequenceScores


class _Tok:
    def decode(self, ids):
        return f"<{ids[0]}>"


def _scores() -> SequenceScores:
    # 2 scored positions, top-2
    return SequenceScores("0", np.asarray([-0.1, -np.inf], np.float32), np.asarray([0.5, 1.5], np.float32),
                          np.asarray([[7, 3], [4, 5]], np.int32), np.asarray([[-0.1, -2.5], [-1.0, -1.2]], np.float32))


def test_prompt_logprobs_ranks_clamp_and_json():
    plp, ent = prompt_logprobs([9, 7, 8], _scores(), 2, Decoder(_Tok()))
    assert plp[0] is None and ent[0] is None and ent[1:] == [0.5, 1.5]
    assert plp[1]["7"] == {"logprob": pytest.approx(-0.1), "rank": 1, "decoded_token": "<7>"} and len(plp[1]) == 2
    # the prompt's token outside the top-k: rank k + 1 (a lower bound), -inf sent as -9999.0
    assert plp[2]["8"] == {"logprob": -9999.0, "rank": 3, "decoded_token": "<8>"} and len(plp[2]) == 3
    json.dumps(plp, allow_nan=False)


def test_echo_prompt_logprobs_default_to_logprobs():
    req = CompletionRequest(prompt=[1, 2, 3], max_tokens=0, echo=True, logprobs=3)
    p = plan(req, served_model="m", max_top_k=8, vocab_size=100, tokenize=None)
    assert p.prompt_k == 3 and p.logprobs_k == 3 and not p.generate and p.top_k == 3


@pytest.mark.parametrize(("data", "param"), [
    ({"prompt": [[1, 2], [3, "x"]]}, "prompt[1][1]"),
    ({"prompt": [1, 2], "max_tokens": "many"}, "max_tokens"),
    ({"prompt": [1, 2], "guided_json": {}}, "guided_json"),
])
def test_validation_error_names_the_field(data, param):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate(data)
    err = validation_error(e.value)
    assert isinstance(err, CompatError) and err.status == 400 and err.param == param and str(err).startswith(param)


def test_text_prompt_without_tokenizer_is_refused():
    with pytest.raises(CompatError) as e:
        plan(CompletionRequest(prompt="hi", max_tokens=0), served_model="m", max_top_k=8, vocab_size=100, tokenize=None)
    assert e.value.param == "prompt[0]"


# -- max_tokens > 1 (openai_generation.py) ------------------------------------------------------
def _plan(**fields):
    return plan(CompletionRequest(**fields), served_model="m", max_top_k=8, vocab_size=100, tokenize=None, max_new_tokens=32)


def test_plan_of_generation_and_the_default_max_tokens():
    p = _plan(prompt=[[1, 2], [3, 4, 5]], max_tokens=5, n=3, logprobs=2)
    assert p.sample and not p.generate and (p.max_tokens, p.n, p.top_k) == (5, 3, 2)
    assert _plan(prompt=[1, 2]).max_tokens == 16  # vLLM's default, now served
    # estimate: every choice repeats its prompt, every completion at its longest
    assert json_bytes_estimate(p) == ((2 + 3) * 3 + 2 * 3 * 5) * (2 + 2) * 72


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": 4, "top_p": 0.0}, "top_p"),
    ({"max_tokens": 4, "top_p": 1.5}, "top_p"),
    ({"max_tokens": 4, "top_k": 5}, "top_k"),
    ({"max_tokens": 4, "min_p": 0.1}, "min_p"),
    ({"max_tokens": 4, "stop": "\n"}, "stop"),
    ({"max_tokens": 4, "stop": ["a", "b"]}, "stop"),
    ({"max_tokens": 4, "seed": -1}, "seed"),
])
def test_sampling_fields_refused_naming_the_field(fields, param):
    req = CompletionRequest(prompt=[1, 2], **fields)
    with pytest.raises(CompatError) as e:
        sampling(req)
    assert e.value.status == 400 and e.value.param == param and str(e.value).startswith(param)


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": 4}, "max_tokens"),  # the server does not generate (max_new_tokens 0)
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 1, "n": 2}, "n"),
    ({"max_tokens": 4, "n": 0}, "n"),
])
def test_max_tokens_and_n_refused_naming_the_field(fields, param):
    served = 0 if param == "max_tokens" else 32
    with pytest.raises(CompatError) as e:
        plan(CompletionRequest(prompt=[1, 2], **fields), served_model="m", max_top_k=8, vocab_size=100, tokenize=None,
             max_new_tokens=served)
    assert e.value.status == 400 and e.value.param == param


def test_sampling_defaults_and_honoured_fields():
    s = sampling(CompletionRequest(prompt=[1, 2], max_tokens=4))
    assert s == Sampling(1.0, 1.0, None, ())
    s = sampling(CompletionRequest(prompt=[1, 2], max_tokens=4, temperature=0.0, top_p=0.9, seed=3, stop_token_ids=[7], top_k=-1))
    assert s == Sampling(0.0, 0.9, 3, (7,))


def _generation(ids, finish, k=2) -> Generation:
    n = len(ids)
    rng = np.random.default_rng(n)
    top = np.asarray([[t, (t + 1) % 100][:k] for t in ids], np.int32)
    lps = -rng.random(n).astype(np.float32)
    s = SequenceScores("0", lps, rng.random(n).astype(np.float32), top, np.stack([lps, lps - 1], 1)[:, :k])
    return Generation("0", 0, np.asarray(ids, np.int64), finish, s)


def test_generation_response_in_vllms_shape():
    """Choices per prompt and sample, the stop id out of the text but in token_ids with its
    stop_reason, logprobs with the token first then the top k, usage over every completion."""
    req = CompletionRequest(prompt=[[1, 2], [3]], max_tokens=3, n=2, logprobs=1, stop_token_ids=[9], return_token_ids=True)
    p = _plan(**req.model_dump(exclude_unset=True))
    gens = [[_generation([4, 5, 9], "stop"), _generation([6, 7, 8], "length")], [_generation([5, 0], "stop"), _generation([1], "stop")]]
    text_of = lambda ids: "".join(f"<{t}>" for t in ids)  # noqa: E731
    body = generation_response(req, p, [None, None], gens, "m", Decoder(_Tok()), text_of, eos_id=0)
    ch = body["choices"]
    assert [c["index"] for c in ch] == [0, 1, 2, 3]
    assert [c["text"] for c in ch] == ["<4><5>", "<6><7><8>", "<5>", ""]
    assert [c["finish_reason"] for c in ch] == ["stop", "length", "stop", "stop"]
    assert [c["stop_reason"] for c in ch] == [9, None, None, None]  # EOS (0) and a non-requested id: null
    assert ch[0]["token_ids"] == [4, 5, 9] and ch[2]["prompt_token_ids"] == [3]
    lp = ch[0]["logprobs"]
    assert lp["tokens"] == ["<4>", "<5>", "<9>"] and lp["text_offset"] == [0, 3, 6]
    assert lp["token_logprobs"] == pytest.approx(gens[0][0].scores.token_logprobs.tolist())
    assert list(lp["top_logprobs"][0]) == ["<4>"]  # the token is its own top-1 here: k = 1 adds nothing
    assert ch[0]["completion_entropies"] == pytest.approx(gens[0][0].scores.entropies.tolist())
    assert ch[0]["prompt_logprobs"] is None and "prompt_entropies" not in ch[0]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 3 + 3 + 2 + 1
    assert body["usage"]["total_tokens"] == 12
    json.dumps(body, allow_nan=False)
