"""`json_out.answer_bytes` (the answer encoded in bounded pieces) is byte for byte
`json.dumps(answer, separators=(",", ":"))`; the decoded-token cache is bounded."""

from __future__ import annotations

import json
import random

from eopd_teacher.http.json_out import CHUNK, answer_bytes
from eopd_teacher.http.openai_logprobs import Decoder


def _random(rng: random.Random, depth: int):
    r = rng.random()
    if depth > 6 or r < 0.3:
        return rng.choice([None, True, False, 0, -7, 10 ** 30, -2.5, 1e-300, float("nan"), "", "a\u00e9\"\\\n", "tok"])
    if r < 0.6:
        n = rng.choice([0, 1, 2, CHUNK, CHUNK + 1, 3 * CHUNK + 5]) if depth in (3, 4, 5) and rng.random() < 0.3 else rng.randint(0, 3)
        return [_random(rng, depth + 1) for _ in range(n)]
    return {(rng.choice([None, 1, "é"]) if rng.random() < 0.1 else f"k{i}"): _random(rng, depth + 1) for i in range(rng.randint(0, 4))}


def test_answer_bytes_equal_json_dumps():
    rng = random.Random(33)
    for _ in range(200):
        value = _random(rng, 0)
        assert answer_bytes(value) == json.dumps(value, separators=(",", ":")).encode()


def test_a_vllm_shaped_answer_encodes_the_same():
    positions = [None] + [{str(i * 9 + j): {"logprob": -1.25 * j, "rank": j + 1, "decoded_token": f"t{j}"} for j in range(9)}
                          for i in range(3 * CHUNK)]
    answer = {"id": "cmpl-1", "choices": [{"index": 0, "text": "", "prompt_logprobs": positions,
                                           "prompt_entropies": [None] + [0.5] * (3 * CHUNK),
                                           "logprobs": {"tokens": ["a"] * 500, "top_logprobs": [{"a": -1.0, None: -2.0}] * 500}}]}
    assert answer_bytes(answer) == json.dumps(answer, separators=(",", ":")).encode()


class _Tok:
    def __init__(self):
        self.calls = 0

    def decode(self, ids):
        self.calls += 1
        return f"<{ids[0]}>"


def test_the_decoded_token_cache_is_bounded():
    tok = _Tok()
    decode = Decoder(tok, cache_size=64)
    assert [decode(t) for t in range(1000)] == [f"<{t}>" for t in range(1000)]
    assert decode.cached() == 64
    decode(999)
    assert tok.calls == 1000  # a recent id is served from the cache
