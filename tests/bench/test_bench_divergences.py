"""`bench_divergences --quick` (issue 48): one real `eopd run` of a divergence member on the tiny
preset, summarised from its metrics: the entropy band per iteration, the smallest divergence term,
the alarms. The SmolLM2 runs (`python -m bench.bench_divergences`) are the lead's."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


def test_divergences_quick_on_the_tiny_preset(tmp_path):
    """TRL's objective (gkd, beta 1, the full vocabulary) end to end: the workers ask the teacher for its
    hidden states (bf16, set by the loss alone), the rollouts carry them through Redis, the learner
    fetches the teacher's output head and projects them."""
    from bench.bench_divergences import MEMBERS, main

    assert not any(o.startswith("teacher.hidden_states") for o in MEMBERS["gkd_rkl_full"])  # the loss asks for them
    out = tmp_path / "divergences.json"
    assert main(["--quick", "--members", "gkd_rkl_full", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["preset"] == "tiny.yaml" and data["iterations"] == 1
    (m,) = data["members"]
    assert m["member"] == "gkd_rkl_full" and "error" not in m, m.get("error")
    assert m["iterations"] == 1
    it = m["per_iteration"][0]
    lo, hi = it["band"]
    assert it["teacher_entropy"] > 0 and lo < hi and it["in_band"] == (lo <= it["student_entropy"] <= hi)
    assert m["min_divergence_term"] is not None and m["min_divergence_term"] >= 0  # a true divergence
    assert "truncation" in m["alarms"]  # the tiny random student never stops before the length limit
