"""Orchestration of `eopd bench all` (bench/run_all.py) with a registry of fake benchmarks: small
real Python modules run as subprocesses, writing through bench.report into a temporary doc and
results directory. Logic only: no real benchmark runs here."""

from __future__ import annotations

import json
import sys
import textwrap
from datetime import datetime
from pathlib import Path

import pytest

from bench import report, run_all
from bench.run_all import Bench

FAKE_OK = """
import sys
from bench.report import write_results, write_section
quick = "--quick" in sys.argv
write_results("fake_ok", {"value": 1 if quick else 2})
write_section("fake_ok", "## Fake ok\\n\\nfresh numbers" + (" (quick)" if quick else ""))
print("fake_ok ran")
"""
FAKE_FAIL = """
raise SystemExit(3)
"""


@pytest.fixture()
def env(tmp_path, monkeypatch):
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "fake_ok_bench.py").write_text(textwrap.dedent(FAKE_OK))
    (mods / "fake_fail_bench.py").write_text(textwrap.dedent(FAKE_FAIL))
    results, doc = tmp_path / "results", tmp_path / "benchmarks.md"
    results.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(mods))
    monkeypatch.setenv("EOPD_BENCH_RESULTS", str(results))
    monkeypatch.setenv("EOPD_BENCH_DOC", str(doc))
    for name in ("fake_ok", "fake_fail", "fake_skip"):
        report.write_section(name, f"## {name}\n\nold numbers of {name}")
    (results / "fake_skip.json").write_text(json.dumps({"time": "2026-01-02T03:04:05Z", "machine": "Some CPU, 2 cores, eopd@abc1234"}))
    benches = [Bench("fake_ok", "fake_ok_bench"), Bench("fake_fail", "fake_fail_bench"),
               Bench("fake_skip", "fake_ok_bench", python=tmp_path / "no-venv" / "bin" / "python")]
    return {"results": results, "doc": doc, "benches": benches, "tmp": tmp_path}


def test_full_run_marks_skipped_and_failed_sections_stale_and_writes_a_summary(env):
    assert run_all.main(["all"], benches=env["benches"]) == 1  # one bench failed
    assert "fresh numbers" in report.read_section("fake_ok") and report.STALE_PREFIX not in report.read_section("fake_ok")
    skip = report.read_section("fake_skip")
    assert skip.splitlines()[0] == "## fake_skip"  # the heading stays first
    assert f"{report.STALE_PREFIX} not re-run in this run (skipped:" in skip and "no-venv" in skip
    assert "last measured at 2026-01-02T03:04:05Z on Some CPU, eopd@abc1234" in skip
    assert "old numbers of fake_skip" in skip  # the old numbers stay, labelled
    fail = report.read_section("fake_fail")
    assert "not re-run in this run (failed: exit code 3); last measured at an unknown time" in fail
    data = json.loads((env["results"] / "fake_ok.json").read_text())
    assert data["value"] == 2 and len(data["commit"]) == 40 and data["describe"] and data["cpu"]
    summary = report.read_section("summary")
    assert "| fake_ok | re-run |" in summary
    assert "| fake_skip | skipped (" in summary and "stale, last measured 2026-01-02T03:04:05Z (eopd@abc1234)" in summary
    assert "| fake_fail | failed (exit code 3): stale, last measured never" in summary
    assert report.provenance()["describe"] in summary and "min in all" in summary and "every benchmark" in summary

    # A second run replaces the stale note rather than stacking another one.
    run_all.main(["all"], benches=env["benches"])
    assert report.read_section("fake_skip").count(report.STALE_PREFIX) == 1


def test_require_all_fails_before_running_anything(env):
    before = env["doc"].read_text()
    assert run_all.main(["all", "--require-all"], benches=env["benches"]) == 2
    assert env["doc"].read_text() == before and not (env["results"] / "fake_ok.json").exists()
    # Without the skippable bench, --require-all runs normally.
    assert run_all.main(["all", "--require-all", "--only", "fake_ok"], benches=env["benches"]) == 0
    assert "fresh numbers" in report.read_section("fake_ok")
    # The summary of an --only run still lists every section, the others with their last measurement.
    summary = report.read_section("summary")
    assert "only fake_ok" in summary and "| fake_ok | re-run |" in summary
    assert "| fake_skip | not in this run: last measured 2026-01-02T03:04:05Z (eopd@abc1234) |" in summary
    assert "| fake_fail | not in this run: last measured never |" in summary


def test_quick_never_touches_the_doc_or_published_results(env, capsys):
    before_doc = env["doc"].read_text()
    before_json = {p.name: p.read_text() for p in env["results"].glob("*.json")}
    assert run_all.main(["all", "--quick", "--only", "fake_ok"], benches=env["benches"]) == 0
    assert env["doc"].read_text() == before_doc
    assert {p.name: p.read_text() for p in env["results"].glob("*.json")} == before_json
    quick = env["results"] / "quick"
    assert json.loads((quick / "fake_ok.json").read_text())["value"] == 1
    assert "fresh numbers (quick)" in (quick / "benchmarks.md").read_text()
    assert "fake_ok ran" in (quick / "fake_ok.log").read_text()
    out = capsys.readouterr().out
    assert "fake_ok ran" in out and "nothing in docs/benchmarks.md" in out


def test_unknown_only_is_an_error(env):
    with pytest.raises(SystemExit):
        run_all.main(["all", "--only", "nope"], benches=env["benches"])


def test_targets_and_projection_from_json(tmp_path):
    """Targets are read from each section's JSON; the projection is computed from the JSON and names its inputs."""
    teacher = {"time": "T1", "machine": "CPU X, 2 cores, eopd@t1", "results": [
        {"workload": "all positions", "dtype": "float32", "sequences": 8, "length": 512, "server_tok_s": 500.0,
         "server_vs_engine": 0.95, "stats_overhead_vs_bare": 0.2, "response_bytes_per_token": 98.0}]}
    ts = run_all.targets("teacher", teacher)
    assert [t["met"] for t in ts] == [True, False, True] and ts[1]["value"] == "worst +20%"
    assert run_all.targets("pipeline", {"summary": [{"mode": "async", "learner_idle_frac": 0.12}]})[0]["met"] is False
    shape = {"batch": 2, "seq": 4, "vocab": 100, "hidden": 10, "k": 2, "chunk": 4}
    loss = {"time": "T2", "machine": "CPU X, 2 cores, eopd@t2", "shape": shape, "timing": {"hidden": {
        "eopd+metrics": {"all_s": [0.3, 0.2, 0.4]}}}}
    (tmp_path / "teacher.json").write_text(json.dumps(teacher))
    (tmp_path / "loss.json").write_text(json.dumps(loss))
    text, data = run_all.projection(tmp_path)
    assert "a model, not a measurement" in text and "`bench/results/teacher.json`: measured T1" in text
    learner_flop_s = 6 * 8 * 100 * 10 / 0.3  # median round
    teacher_flop_s = 500.0 * 2 * run_all.PAPER["smollm2_params"]
    expected = (learner_flop_s / (6 * run_all.PAPER["student_params"])) / (teacher_flop_s / (2 * run_all.PAPER["teacher_params"]))
    assert data["teacher_devices_per_learner_device"] == pytest.approx(expected)
    rows = {r["teacher_devices_per_learner_device"]: r for r in data["rows"]}
    assert {r["bottleneck"] for r in data["rows"] if r["teacher_devices_per_learner_device"] > expected * 1.01} <= {"learner"}
    assert {r["bottleneck"] for r in data["rows"] if r["teacher_devices_per_learner_device"] < expected * 0.99} <= {"teacher"}
    assert rows[4]["teacher_busy"] == pytest.approx(min(1.0, rows[4]["teacher_s_per_iteration"] / rows[4]["learner_s_per_iteration"]))
    empty, nodata = run_all.projection(tmp_path / "nothing")
    assert nodata == {} and "Not computed" in empty


def test_a_timing_names_its_machine_and_how_fast_it_is():
    """One record, used by the head-to-head's runs and the layout grid's cells: the machine's name,
    its boot (two machines share a CPU name), its measured speed and when."""
    from bench.report import timing_machine

    m = timing_machine()
    assert set(m) == {"cpu", "cores", "mem_gib", "boot_id", "matmul_gflops", "timed_at"}
    assert m["cpu"] and m["cores"] >= 1 and m["mem_gib"] >= 1 and m["boot_id"] and m["matmul_gflops"] > 0
    assert datetime.fromisoformat(m["timed_at"]).tzinfo is not None  # UTC, comparable across machines


def test_provenance_ignores_the_benchmarks_own_outputs(tmp_path, monkeypatch):
    """A run writes docs/benchmarks.md and bench/results/ section by section: that alone must not
    make the next section's checkout `-dirty`; any other tracked change must (and is listed)."""
    import shutil
    import subprocess

    repo = tmp_path / "repo"
    (repo / "bench" / "results").mkdir(parents=True)
    (repo / "docs").mkdir()
    (repo / "src.py").write_text("x = 1\n")
    (repo / "docs" / "benchmarks.md").write_text("# Benchmarks\n")
    (repo / "bench" / "results" / "a.json").write_text("{}\n")
    (repo / "docs" / "figures").mkdir()
    (repo / "docs" / "figures" / "f.png").write_bytes(b"png")

    def git(*args):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo, check=True, capture_output=True)

    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "init")
    monkeypatch.setattr(report, "ROOT", repo)
    assert not report.provenance()["describe"].endswith("-dirty")
    (repo / "docs" / "benchmarks.md").write_text("# Benchmarks\n\nnew section\n")
    (repo / "bench" / "results" / "a.json").write_text('{"v": 1}\n')
    (repo / "docs" / "figures" / "f.png").write_bytes(b"png, redrawn")  # figures are written before the JSON
    p = report.provenance()
    assert not p["describe"].endswith("-dirty") and p["dirty_files"] == []
    (repo / "src.py").write_text("x = 2\n")
    p = report.provenance()
    assert p["describe"].endswith("-dirty") and p["dirty_files"] == ["src.py"]
    # A copy sent to a device machine (its .git stale) is named by the sender: scripts/device_bench.sh
    monkeypatch.setenv("EOPD_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    p = report.provenance()
    assert (p["commit"], p["describe"], p["dirty_files"]) == ("0123456789abcdef0123456789abcdef01234567", "0123456", [])
    shutil.rmtree(repo)


def test_eopd_bench_runs_the_checkout_bench_as_a_subprocess(tmp_path, monkeypatch, capfd):
    """`eopd bench ARGS` is `python -m bench.run_all ARGS` in the repository root, never an import of
    bench/ by the installed package; without a checkout's bench/ it says so in one line (exit 2)."""
    from eopd_trainer import cli

    assert cli.main(["bench", "--help"]) == 0
    assert "usage: eopd bench" in capfd.readouterr().out
    monkeypatch.setattr(cli, "REPO_ROOT", tmp_path)
    assert cli.main(["bench", "all", "--quick"]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"no bench/run_all.py in {tmp_path}" in err and "python -m bench.run_all" in err


def test_e2e_is_a_registry_of_its_own():
    """`eopd bench e2e` runs the head-to-head with TRL alone (hours): `all`'s benchmarks are not in it."""
    assert [b.module for b in run_all.E2E_BENCHES] == ["bench.bench_e2e"] and run_all.E2E_BENCHES[0].quick_out
    assert "e2e_trl" not in {b.name for b in run_all.BENCHES}
    with pytest.raises(SystemExit):
        run_all.main(["e2e", "--only", "teacher"])
