"""The CLI commands as written in the README, against the real server."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eopd_teacher.cli", *args], capture_output=True, text=True, timeout=300)


def test_info(tiny_teacher):
    out = _run("info", "--target", tiny_teacher.target)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["model_name"] == "tiny-random" and info["vocab_size"] == 49152


def test_score_text_and_token_ids(tiny_teacher, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(
        json.dumps({"id": "t", "prompt": "What is 2 + 3?", "response": " It is 5.", "chat": True}) + "\n"
        + json.dumps({"id": "ids", "token_ids": [5, 6, 7, 8], "score_from": 2}) + "\n"
    )
    dst = tmp_path / "out.jsonl"
    out = _run("score", "--target", tiny_teacher.target, "--input", str(src), "--output", str(dst), "--top-k", "4")
    assert out.returncode == 0, out.stderr
    recs = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["t", "ids"]
    text = recs[0]
    n = len(text["token_ids"])
    assert n >= 3 and len(text["entropies"]) == n and len(text["topk_ids"]) == n and len(text["topk_ids"][0]) == 4
    assert "".join(text["tokens"]).strip() == "It is 5."
    assert recs[1]["token_ids"] == [7, 8] and len(recs[1]["token_logprobs"]) == 2


def test_score_reports_bad_input_line(tiny_teacher, tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"id": "x", "text": "no response field"}) + "\n")
    out = _run("score", "--target", tiny_teacher.target, "--input", str(src))
    assert out.returncode != 0 and "line 1" in (out.stderr + out.stdout)
