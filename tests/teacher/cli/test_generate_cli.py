"""`eopd-teacher generate` against the real server (tiny-random over TCP)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from eopd_teacher.client import TeacherClient

pytestmark = pytest.mark.integration


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eopd_teacher.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_text_and_token_ids(tiny_teacher, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(
        json.dumps({"id": "t", "text": "What is 2 + 3?", "chat": True}) + "\n\n"
        + json.dumps({"id": "ids", "token_ids": [5, 6, 7, 8]}) + "\n"
    )
    dst = tmp_path / "out.jsonl"
    out = _run("generate", "--target", tiny_teacher.target, "--input", str(src), "--output", str(dst), "--max-new-tokens", "5",
               "--num-samples", "2", "--seed", "4", "--top-k", "3", "--stop-id", "7", "--stop-id", "9")
    assert out.returncode == 0, out.stderr
    recs = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [(r["id"], r["sample_index"]) for r in recs] == [("t", 0), ("t", 1), ("ids", 0), ("ids", 1)]
    for r in recs:
        n = len(r["token_ids"])
        assert 1 <= n <= 5 and r["finish_reason"] in ("stop", "length") and isinstance(r["text"], str)
        assert len(r["token_logprobs"]) == len(r["entropies"]) == n and np.shape(r["topk_ids"]) == np.shape(r["topk_logprobs"]) == (n, 3)
        assert (r["finish_reason"] == "stop") == (r["token_ids"][-1] in (7, 9, 2))  # 2: the model's EOS
    # Through the client, "ids" again second in its request with the same seed: the same tokens and
    # statistics (a sample's seed is (seed, the prompt's index in the request, the sample's index)).
    with TeacherClient(tiny_teacher.target) as c:
        gens = c.generate({"other": [1], "ids": [5, 6, 7, 8]}, num_samples=2, max_new_tokens=5, seed=4, top_k=3,
                          stop_token_ids=[7, 9])[2:]
    same = [r for r in recs if r["id"] == "ids"]
    assert [g.token_ids.tolist() for g in gens] == [r["token_ids"] for r in same]
    # The statistics pass scores a request's rows together (batched generation): beside another prompt
    # the padded batch differs, so fp32 rounding differs by a few 1e-6 (measured 2.9e-6).
    np.testing.assert_allclose([g.scores.token_logprobs for g in gens], [r["token_logprobs"] for r in same], atol=1e-5)


def test_generate_errors_name_the_input_line(tiny_teacher, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"id": "ok", "token_ids": [1, 2]}) + "\n" + json.dumps({"id": "v", "token_ids": [1, 10**6]}) + "\n")
    out = _run("generate", "--target", tiny_teacher.target, "--input", str(src), "--max-new-tokens", "2")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "eopd-teacher generate: line 2 (id 'v'): INVALID_ARGUMENT: prompts[1].token_ids[1]" in out.stderr
    src.write_text(json.dumps({"id": "a", "token_ids": [1]}) + "\n" + json.dumps({"id": "a", "token_ids": [2]}) + "\n")
    out = _run("generate", "--target", tiny_teacher.target, "--input", str(src), "--max-new-tokens", "2")
    assert out.returncode != 0 and "line 2: id 'a' already used on line 1" in out.stderr
    src.write_text(json.dumps({"id": "a", "prompt": "no text field"}) + "\n")
    out = _run("generate", "--target", tiny_teacher.target, "--input", str(src), "--max-new-tokens", "2")
    assert out.returncode != 0 and "line 1: needs token_ids or text" in out.stderr
