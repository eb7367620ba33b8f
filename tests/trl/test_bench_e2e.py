"""`bench_e2e --quick` (issue 34's head-to-head, the tiny preset, 2 iterations): eopd run, TRL's own
GKDTrainer and ServerDistillationTrainer (against eopd-teacher's and stock vLLM's /v1/completions),
each trained for real, checkpointed on its training clock and graded by `eopd eval`."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("trl", reason="the TRL tier runs in .venv-vllm (bash scripts/vllm_env.sh)")
pytest.importorskip("vllm", reason="the vLLM server is one of the systems")

pytestmark = pytest.mark.integration


def test_bench_e2e_quick_wires_every_system(tmp_path):
    from bench.bench_e2e import main

    out = tmp_path / "e2e.json"
    systems = ["eopd", "trl-gkd", "trl-server-eopd", "trl-server-vllm"]
    assert main(["--quick", "--systems", *systems, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    runs = {r["system"]: r for r in data["runs"]}
    assert set(runs) == set(systems)
    assert data["settings"]["steps"] == 4 and data["settings"]["batch_size"] == 4  # 2 iterations x 2 steps of 4
    for system, r in runs.items():
        cps = r["checkpoints"]
        assert len(cps) == 2, (system, cps)  # one per iteration (TRL: every 2 steps)
        times = [c["train_s"] for c in cps]
        assert 0 < times[0] < times[1] < r["wall_s"], (system, times, r["wall_s"])
        for c in cps:
            assert 0.0 <= c["heldout"]["avg_at_k"] <= 1.0 and set(c["heldout"]["pass_at_k"]) == {"1", "2"}
        assert r["memory"]["peak_total_mb"] > 100, (system, r["memory"])
        assert r["machine"]["boot_id"] and r["machine"]["matmul_gflops"] > 0, r["machine"]  # which machine, how fast
    assert [c["step"] for c in runs["trl-gkd"]["checkpoints"]] == [2, 4]
    assert runs["trl-server-vllm"]["teacher_start_s"] > 0 and "vllm.entrypoints.openai.api_server" in runs["trl-server-vllm"]["memory"]["per_process_peak_mb"]
    assert any("learner" in name or "eopd_trainer" in name for name in runs["eopd"]["memory"]["per_process_peak_mb"])
    # where the time goes (bench.e2e_time_split): eopd's phases and TRL GKD's, measured in both runs
    split, ref = runs["eopd"]["time_split"], runs["trl-gkd"]["time_split"]
    assert split["learner_steps_s"] > 0 and split["sampling_s"] > 0 and split["weight_load_s"] > 0, split
    assert split["iterations"] == 2 and split["optimizer_steps"] == 4 and split["start_s"] > 0, split
    assert ref["generate_s"] > 0 and ref["teacher_forward_s"] > 0 and ref["student_step_s"] > 0, ref
    assert ref["optimizer_steps"] == 4 and "time_split" not in runs["trl-server-eopd"]
    summary = data["summary"]
    assert set(summary["systems"]) == set(systems) and summary["target"] is not None
    assert len({m for s in summary["systems"].values() for m in s["machines"]}) == 1  # one machine: every ratio pairs
