"""`bench_dense --quick` (issue 48): every support's loss runs forward and backward on small shapes
and the section renders; the SmolLM2-shaped numbers are docs/benchmarks.md's `dense_loss`."""

from __future__ import annotations

import json

from bench import bench_dense


def test_quick_measures_every_member_and_renders(tmp_path):
    out = tmp_path / "dense.json"
    assert bench_dense.main(["--quick", "--reps", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [m["member"] for m in data["members"]] == list(bench_dense.MEMBERS)
    assert all(m["seconds"] > 0 and len(m["all"]) == 1 for m in data["members"])
    assert data["members"][0]["vs_eopd"] == 1.0
    text = bench_dense.section_text(data)
    assert "| gkd reverse KL, full, bf16 hidden states |" in text and "N = 64" in text
