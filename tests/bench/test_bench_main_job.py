"""bench/bench_main_job.py's pure parts: which role a process plays, /proc/<pid>/status read in MiB,
the section rendered from a result (the job itself is run by hand: it takes the whole machine for
~15 minutes), and the memory sampler on this test's own process tree."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.bench_main_job import JobMemory, pss_mib, role_of, section_text, status_mib


def test_roles_from_command_lines():
    assert role_of("/x/python -m eopd_trainer.learner --config a") == "learner"
    assert role_of("/x/python -m eopd_trainer.rollout --worker 0") == "rollout"
    assert role_of("/x/python -m eopd_teacher.cli serve") == "teacher"
    assert role_of("/x/python -m eopd_trainer.cli run --config c") == "eopd run"
    assert role_of("redis-server 127.0.0.1:6379") == "redis"
    assert role_of("/bin/sh -c sleep") is None


def test_status_fields_in_mib():
    text = "Name:\tpython\nVmRSS:\t  2097152 kB\nRssAnon:\t 1048576 kB\nRssFile:\t  1047552 kB\nRssShmem:\t 1024 kB\nThreads: 4\n"
    assert status_mib(text) == {"VmRSS": 2048.0, "RssAnon": 1024.0, "RssFile": 1023.0, "RssShmem": 1.0}


def test_pss_from_smaps_rollup():
    text = "55d0-7ffd ---p 00000000 00:00 0 [rollup]\nRss:\t 2048 kB\nPss:\t 1024 kB\nPss_Anon:\t 512 kB\n"
    assert pss_mib(text) == 1.0 and pss_mib("Rss: 1 kB\n") is None


def test_the_sampler_sees_a_child_under_its_role():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "eopd_trainer.learner"])
    try:
        mem = JobMemory(os.getpid(), keep_series=True)
        for _ in range(50):
            mem.sample()
            if "learner" in mem.peaks:
                break
        assert mem.peaks["learner"]["VmRSS"] > 1 and mem.peak_total_mib >= mem.peaks["learner"]["VmRSS"]
        assert mem.at_peak_total["learner"] > 1
        assert sum(mem.at_peak_total.values()) == pytest.approx(mem.peak_total_mib)
        # PSS: the child's pages shared with this process (the interpreter's libraries) divided between them
        assert 0 < mem.at_peak_pss["learner"] <= mem.peaks["learner"]["VmRSS"] + 1
        assert sum(mem.at_peak_pss.values()) == pytest.approx(mem.peak_pss_total_mib)
        assert len(mem.series) >= 1 and all(s["t"] >= 0 for s in mem.series)
        anon, file_backed, shared = mem.series[-1]["learner"]  # the child's split, which sums to its RSS
        assert anon > 0 and anon + file_backed + shared == pytest.approx(mem.peaks["learner"]["VmRSS"], abs=64)
    finally:
        child.kill()
        child.wait()


def test_section_renders_times_numbers_and_memory():
    result = {"preset": "smollm2-cpu", "cold": True, "overrides": [], "total_s": 900.0, "run_s": 880.0, "train_s": 650.0,
              "eval_s": 200.0, "evals": {"teacher": {"heldout": {"avg_at_k": 0.527, "reused": True, "eval_s": None}},
                                          "final": {"heldout": {"avg_at_k": 0.35, "reused": False, "eval_s": 60.0},
                                                    "variants": {"avg_at_k": 0.3, "reused": False, "eval_s": 40.0}}},
              "memory": {"peak_total_mib": 6144.0, "per_role": {
                  "learner": {"VmRSS": 3072.0, "RssAnon": 2048.0, "RssFile": 1024.0, "RssShmem": 0.0},
                  "teacher": {"VmRSS": 1024.0, "RssAnon": 1000.0, "RssFile": 24.0, "RssShmem": 0.0}},
                  "at_peak_total": {"teacher": 1024.0, "learner": 2048.0}}}
    text = section_text({"result": result, "machine": "Test CPU, eopd@abc1234", "load_avg": "0.1 -> 2.0"})
    assert "bench_main_job --cold" in text and "Test CPU, eopd@abc1234 (load average 0.1 -> 2.0)" in text
    assert "| 900 s (15.0 min) | 650 s | 200 s | 50 s |" in text
    assert "| teacher | 0.527 | - | heldout: reused |" in text
    assert "| final | 0.350 | 0.300 | heldout: 60 s, variants: 40 s |" in text
    assert "**6.00 GiB** (at that instant: learner 2.00, teacher 1.00 GiB)" in text and "| learner | 3.00 | 2.00 | 1.00 | 0.00 |" in text
    assert text.index("| learner | 3.00") < text.index("| teacher | 1.00")  # largest first
    assert "in PSS" not in text  # a run that recorded no PSS says nothing about it
    with_pss = section_text({"result": {**result, "memory": {**result["memory"], "peak_pss_total_mib": 5120.0,
                                                             "at_peak_pss": {"teacher": 1024.0, "learner": 4096.0}}},
                             "machine": "Test CPU", "load_avg": "-"})
    assert "the physical memory the job held: **5.00 GiB** (at that instant: learner 4.00, teacher 1.00 GiB)." in with_pss
    # a labelled run with overrides says what it changed, in its title and its command (not "another machine")
    labelled = section_text({"result": {**result, "overrides": ["loss.variant=eopd"]}, "label": "paper-loss",
                             "machine": "Test CPU", "load_avg": "0.1 -> 2.0"})
    assert labelled.startswith("## The main job end to end, a first run (paper-loss: `loss.variant=eopd`)")
    assert "`python -m bench.bench_main_job --cold --label paper-loss loss.variant=eopd`" in labelled
    assert "another machine" in section_text({"result": result, "label": "avx2", "machine": "Test CPU", "load_avg": "-"})


def test_results_record_the_checkout_the_measurement_started_from(monkeypatch, tmp_path):
    """A long benchmark (the main job: half an hour) records the checkout its processes loaded, the
    one at its start; a checkout changed during it is recorded beside it, not in its place."""
    import json

    from bench.report import provenance, write_results

    monkeypatch.setenv("EOPD_BENCH_RESULTS", str(tmp_path))
    now = provenance()
    started = {**now, "commit": "0" * 40, "describe": "0000000", "dirty_files": []}
    written = json.loads(write_results("x", {"result": 1}, started=started).read_text())
    assert (written["commit"], written["describe"], written["dirty_files"]) == ("0" * 40, "0000000", [])
    assert written["checkout_at_end"] == {k: now[k] for k in ("commit", "describe", "dirty_files")}
    assert "eopd@0000000" in written["machine"]
    same = json.loads(write_results("y", {"result": 1}, started=now).read_text())
    assert same["commit"] == now["commit"] and "checkout_at_end" not in same


def test_a_labelled_machine_gets_its_own_section():
    """`--label`: another machine's measurement is a section of its own, named in its title and command;
    a label that is not a plain name is refused."""
    from bench.bench_main_job import _label, main

    result = {"preset": "smollm2-cpu", "cold": True, "overrides": [], "matmul_gflops": 65.4, "total_s": 2281.0, "run_s": 2270.0,
              "train_s": 1312.0, "eval_s": 934.0, "evals": {},
              "memory": {"peak_total_mib": 6513.0, "per_role": {}, "at_peak_total": {}}}
    text = section_text({"result": result, "label": "avx2"})
    assert text.startswith("## The main job end to end, a first run on another machine (avx2): time and memory "
                           "(`python -m bench.bench_main_job --cold --label avx2`")
    assert "fp32 1024^3 matmul 65 GFLOP/s" in text
    assert _label("avx2-65gflops") == "avx2-65gflops"
    with pytest.raises(SystemExit):
        main(["--label", "../x"])
