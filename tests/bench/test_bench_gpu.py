"""The GPU benchmarks' CPU smoke mode (what CI can run): `python -m bench.run_all gpu --quick` runs
bench/bench_gpu_teacher.py's own code on the CPU (a tiny random model built in code, the in-process
engine and a real `eopd-teacher serve` at 1 and 2 clients, both server settings) and
bench/bench_gpu_trainer.py's (the paper preset on tiny Qwen3-shaped models, two iterations of `eopd
run`, its metrics and per-process memory read back); without a GPU the full run says why it measures
nothing. The section renders from the smoke's rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from bench import bench_gpu_teacher
from tests.procs import ROOT

pytestmark = pytest.mark.integration


def _bench(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow  # a server at two settings and two iterations of `eopd run` (~3 min in CI)
def test_gpu_bench_smoke_runs_on_the_cpu_and_renders(tmp_path):
    res = _bench("bench.run_all", "gpu", "--quick", env_extra={"EOPD_BENCH_RESULTS": str(tmp_path),
                                                              "EOPD_BENCH_DOC": str(tmp_path / "benchmarks.md")})
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    log = (tmp_path / "quick" / "gpu_teacher.log").read_text()
    for profile in ("auto", "cpu-fairness"):
        assert f"| tiny | 2 x 64 (64) | {profile} |" in log
    rows = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert len(rows) == 2 and all(r["server1_tok_s"] > 0 and r["server2_tok_s"] > 0 and r["engine_tok_s"] > 0 for r in rows)
    # The server's time breakdown (issue 30): shares of its wall time, engine first.
    assert "engine / copy / split / encode / other" in log
    assert all(0 < r["server2_breakdown"]["engine"] <= 1.01 and r["server2_breakdown"]["copy"] == 0 for r in rows)  # CPU: no copy
    assert not (tmp_path / "benchmarks.md").exists()  # a smoke run writes no section
    trainer = [json.loads(line) for line in (tmp_path / "quick" / "gpu_trainer.log").read_text().splitlines()
               if line.startswith("{")]
    assert len(trainer) == 1 and trainer[0]["mode"] == "sync" and trainer[0]["iterations"] == 2
    assert trainer[0]["weight_sync"] == "broadcast" and trainer[0]["publish_format"] == "broadcast"  # gloo here, NCCL there
    t = trainer[0]
    assert t["iteration_s"] > 0 and 0 <= t["idle_frac"] <= 1 and t["publish_s"] > 0 and t["load_s"] >= 0
    assert set(t["peak_rss_gib"]) == {"teacher", "rollout", "learner"}
    for r in rows:
        r.update(shape="tiny", profile="auto")
    text = bench_gpu_teacher.section_text({"results": rows, "minutes": 0.5, "provenance": {"describe": "abc1234"},
                                           "software": {"torch": "2.x", "cuda": "13.0", "transformers": "5.x",
                                                        "device": "NVIDIA Test", "device_memory_gib": 80.0}})
    assert "On NVIDIA Test (80.0 GiB)" in text and "eopd@abc1234" in text and "Targets (issue 30)" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the benchmark would run")
def test_gpu_bench_without_a_gpu_says_why_and_measures_nothing(tmp_path):
    res = _bench("bench.run_all", "gpu", env_extra={"EOPD_BENCH_RESULTS": str(tmp_path),
                                                   "EOPD_BENCH_DOC": str(tmp_path / "benchmarks.md")})
    assert res.returncode == 0
    assert "[gpu_teacher] skipped: no CUDA device here" in res.stderr + res.stdout
    assert "[gpu_trainer] skipped: no CUDA device here" in res.stderr + res.stdout
    assert not list(tmp_path.iterdir())
