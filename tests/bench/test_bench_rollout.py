"""`bench_rollout --quick` in the vLLM environment (part of the vLLM tier, scripts/vllm_env.sh):
the worker's real samplers (transformers with the old log-probs from a forward pass or recorded while
sampling, vLLM, vLLM with its own log-probs) on the tiny random
student, each in its own process, plus in-place weight reloads; and the section rendered from
the measured JSON."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.integration


def test_rollout_quick_measures_every_sampler_and_renders(tmp_path, monkeypatch):
    from bench import bench_rollout

    out = tmp_path / "rollout.json"
    assert bench_rollout.main(["--quick", "--reps", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    [wl] = data["workloads"]
    assert wl["workload"] == "tiny" and set(wl["paths"]) == set(bench_rollout.PATHS)
    for path, p in wl["paths"].items():
        assert len(p["rounds"]) == 2 and len(p["reloads"]) == bench_rollout.RELOAD_REPS, path
        for r in p["rounds"]:
            assert r["samples"] == wl["prompts"] and 0 < r["tokens"] <= wl["prompts"] * wl["max_new_tokens"]
            assert r["sample_s"] > 0 and r["logprob_s"] >= 0
        assert all(x > 0 for x in p["reloads"]) and p["peak_rss_mib"] > 0
    # vLLM with its own log-probs does no second forward pass: its old log-prob time is ~0.
    # Nor does the transformers sampler recording them while it samples (rollout.old_logprobs: generate).
    for path in ("vllm_own_logprobs", "transformers_generate"):
        own = wl["paths"][path]["rounds"]
        assert all(r["logprob_s"] < 0.05 * r["sample_s"] for r in own), (path, own)

    rows = bench_rollout.summarise(data)
    assert {r["path"] for r in rows} == set(bench_rollout.PATHS)
    assert next(r for r in rows if r["path"] == "transformers")["rollout_vs_transformers"] == pytest.approx(1.0)

    # The section as `eopd bench all` would publish it (provenance added by write_results).
    monkeypatch.setenv("EOPD_BENCH_RESULTS", str(tmp_path))
    monkeypatch.setenv("EOPD_BENCH_DOC", str(tmp_path / "benchmarks.md"))
    from bench.report import read_section, write_results

    write_results("rollout", data)
    assert bench_rollout.main(["--render"]) == 0
    section = read_section("rollout")
    assert section.startswith("## Rollouts") and "| tiny | vllm |" in section and "**Reading**" in section
