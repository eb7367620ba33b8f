"""bench/bench_generate.py's smoke mode (what CI runs): both paths measured on tiny-random, greedy
parity checked, the section rendered from the rows; it writes nothing."""

from __future__ import annotations

import json

from bench import bench_generate


def test_generate_bench_smoke_measures_both_paths_and_renders(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EOPD_BENCH_RESULTS", str(tmp_path))
    monkeypatch.setenv("EOPD_BENCH_DOC", str(tmp_path / "benchmarks.md"))
    assert bench_generate.main(["--smoke"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert row["model"] == "tiny-random" and row["greedy_identical"] and row["same_tokens"]
    assert set(row["rows"]) == {"one at a time", "batched"}
    assert all(r["prompts_s"] > 0 and r["tokens_s"] > 0 and 3 * 2 <= r["generated_tokens"] <= 3 * 2 * 4
               for r in row["rows"].values())
    assert not list(tmp_path.iterdir())  # a smoke run writes nothing
    text = bench_generate.section_text({"results": [row], "rounds": 1, "load": "1.0 -> 1.0", "machine": "a CPU"})
    assert "| tiny-random | 3 x 2 x 4 | batched |" in text and "greedy ids identical" in text
