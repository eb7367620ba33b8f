"""Smoke tests of the benchmarks' quick paths: real processes, real measured numbers (not the
docs: quick runs write neither bench/results/ nor docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


def test_pipeline_quick_async_two_teachers(tmp_path):
    """One configuration of `bench_pipeline --quick`: Redis, two teachers, two workers (one per
    teacher), the DeepSpeed learner; both teachers must have scored, the learner's idle share and
    the trained rate must be real measurements."""
    from bench.bench_pipeline import main

    out = tmp_path / "pipeline.json"
    assert main(["--quick", "--modes", "async", "--teachers", "2", "--iterations", "4", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["preset"] == "tiny" and len(data["results"]) == 1
    r = data["results"][0]
    assert r["mode"] == "async" and r["teachers"] == 2 and r["iterations_measured"] == 3
    assert r["trained_tokens"] > 0 and 0 < r["trained_tok_s"] < 1e5
    assert 0.0 <= r["learner_idle_frac"] <= 1.0 and r["queue_wait_s"] >= 0
    assert len(r["teacher_busy"]) == 2 and all(b > 0 for b in r["teacher_busy"]), r["teacher_busy"]  # both used
    assert r["teacher_tok_s"] > 0 and r["staleness_mean"] >= 0
    assert r["cpu_s"]["learner"] > 0 and r["cpu_s"]["rollout-w0"] > 0 and r["cpu_s"]["rollout-w1"] > 0


def test_trl_peer_quick(tmp_path):
    """`bench_trl_peer --quick` on the tiny model: the re-implemented TRL shape returns what the
    gRPC teacher returns (same engine), and the wire sizes are measured."""
    from bench.bench_trl_peer import main

    out = tmp_path / "trl.json"
    assert main(["--quick", "--model", "tiny-random", "--rounds", "1", "--clients", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    agree = data["agreement"]
    assert agree["top_k_ids_equal"]
    assert agree["top_k_logprob_max_diff_binary"] < 1e-5 and agree["token_logprob_max_diff_binary"] < 1e-5
    assert agree["top_k_logprob_max_diff_json"] < 1e-5
    by = {s["path"]: s for s in data["summary"]}
    assert set(by) == {"eopd gRPC", "TRL shape, JSON", "TRL shape, binary"}
    for s in by.values():
        assert s["tok_s"] > 0 and s["server_cpu_s_per_1k"] > 0
    # k = 16: eopd packs ~5k + 13 bytes per token; base64 arrays are larger, nested JSON larger still.
    assert by["eopd gRPC"]["response_bytes_per_token"] < 140
    assert by["eopd gRPC"]["response_bytes_per_token"] < by["TRL shape, binary"]["response_bytes_per_token"]
    assert by["TRL shape, binary"]["response_bytes_per_token"] < by["TRL shape, JSON"]["response_bytes_per_token"]


def test_weight_sync_quick(tmp_path):
    """`bench_weight_sync --quick`: the three paths (files in a disk directory, files in /dev/shm, the
    mapped buffer) publish and load the tiny model for real, and what the worker loaded equals what
    the learner published."""
    from bench.bench_weight_sync import main

    out = tmp_path / "weight_sync.json"
    assert main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["loaded_equal"] is True and data["mb"] > 1 and len(data["rounds"]) == 2
    for path in ("disk", "shm", "mapped"):
        assert data[f"{path}_publish_s"] > 0 and data[f"{path}_load_s"] > 0
    assert data["shm_vs_disk_total"] > 0 and data["mapped_vs_shm_total"] > 0


def test_threads_quick(tmp_path):
    """`bench_threads --quick`: every thread setting measured alone and beside a real CPU hog, each in
    its own process, with the thread count it asked for."""
    from bench.bench_threads import SETTINGS, main

    out = tmp_path / "threads.json"
    assert main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    (rec,) = data["rounds"]
    assert set(rec) == set(SETTINGS)
    assert data["hog_threads"] == 1  # quick: a one-thread hog (the full run: one per core)
    assert rec["one"]["alone"]["torch_threads"] == 1 and rec["cores"]["alone"]["torch_threads"] >= 1
    for setting in SETTINGS:
        for work in ("learner", "sampler"):
            assert data[f"{setting}_{work}_alone_s"] > 0 and data[f"{setting}_{work}_ratio"] > 0


def test_overlap_quick(tmp_path):
    """`bench_overlap --quick`: the tiny preset trained by real `eopd run` jobs in sync and in async
    mode; each mode's idle share, times and staleness come from its own run's records."""
    from bench.bench_overlap import MODES, main

    out = tmp_path / "overlap.json"
    assert main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["preset"] == "tiny" and data["iterations"] == 2
    for mode in MODES:
        m = data[mode]
        assert m["measured"] == 1 and m["s_per_iteration"] > 0 and m["iteration_s"] > 0
        assert 0.0 <= m["idle_frac"] <= 1.0 and m["collect_s"] >= 0
    assert data["sync"]["staleness_mean"] == 0.0  # sync trains only on the current version
