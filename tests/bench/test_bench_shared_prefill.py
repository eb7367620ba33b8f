"""`bench_shared_prefill --quick`: every part of the main job timed plain and shared on tiny random
models, the two paths' outputs compared (the same sampled ids, differences at float rounding)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


def test_shared_prefill_quick(tmp_path):
    from bench.bench_shared_prefill import main, section_text

    out = tmp_path / "shared.json"
    assert main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["rows"]) == {"rollout sampling", "teacher scoring", "learner micro-batch", "evaluation sampling"}
    for name, r in data["rows"].items():
        assert r["plain_s"] > 0 and r["shared_s"] > 0 and r["speedup"] > 0, name
        assert r["same_ids"], name
        assert r["max_diff"] < 1e-3, (name, r["max_diff"])
    assert all(t > 0 for t in data["top_p_s"].values())
    assert "| teacher scoring |" in section_text(data)
