"""Pure logic of the vLLM shapes (openai_format.py): ranks, the -9999 clamp, echo log-probs and
the field named by a validation error."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from eopd_teacher.openai_format import CompatError, CompletionRequest, Decoder, plan, prompt_logprobs, validation_error
from eopd_teacher.types import SequenceScores


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
