"""`eopd run` end to end as real processes (tiny preset): its own redis-server (REDIS_URL unset),
the teacher, a rollout worker, the learner, then the evaluation and `eopd report`; and the
supervisor's failure path (a child that dies -> exit 1 with the tail of its log)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.procs import ROOT

pytestmark = pytest.mark.integration

TINY = ROOT / "configs" / "tiny.yaml"


def eopd(*args: str, timeout: float = 300, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update(OMP_NUM_THREADS="1", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "eopd_trainer.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_tiny_run_end_to_end_then_report(tmp_path):
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    res = eopd("run", "--config", str(TINY), f"run_dir={run_dir}", "train.iterations=4")
    assert res.returncode == 0, res.stderr[-5000:]
    assert "REDIS_URL is not set; started redis-server" in res.stderr
    assert time.monotonic() - t0 < 240
    for name in ("redis", "teacher", "rollout-w0", "learner"):
        assert (run_dir / "logs" / f"{name}.log").is_file(), name
    assert (run_dir / "checkpoints" / "COMMITTED").is_file()
    iters = [json.loads(line) for line in (run_dir / "train_metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in iters if r.get("kind") == "iteration"] == [1, 2, 3, 4]
    summary = json.loads((run_dir / "run_summary.json").read_text())
    assert "redis-server" in summary["queue"] and summary["train_s"] > 0
    ev = json.loads((run_dir / "eval.json").read_text())
    assert set(ev["models"]) == {"initial", "final"}
    for m in ev["models"].values():
        assert m["n_samples"] == 2 and set(m["pass_at_k"]) == {"1", "2"} and m["prompts"] == 8
        assert m["tokens"] > 0 and m["fkl_high_entropy"] == m["fkl_high_entropy"]  # not NaN
    assert ev["models"]["final"]["model"].endswith("/hf")

    # eopd eval adds a model to eval.json; eopd report renders every figure.
    res = eopd("eval", "--run-dir", str(run_dir), "--model", "teacher", "eval.max_prompts=2")
    assert res.returncode == 0, res.stderr[-3000:]
    ev = json.loads((run_dir / "eval.json").read_text())
    assert ev["models"]["teacher"]["forward_kl"] < 1e-6 and ev["models"]["teacher"]["prompts"] == 2
    res = eopd("report", str(run_dir))
    assert res.returncode == 0, res.stderr[-3000:]
    text = (run_dir / "report.html").read_text()
    assert len(re.findall(r"<img alt='[^']+' src='data:image/png;base64,", text)) == 6
    assert "run / teacher" in text


def test_run_fails_with_the_log_of_a_dead_child(tmp_path):
    bad = tmp_path / "broken-model"
    bad.mkdir()
    (bad / "config.json").write_text("{}")  # resolves as a model directory, fails to load
    res = eopd("run", "--config", str(TINY), f"run_dir={tmp_path / 'run'}", f"teacher.model={bad}", timeout=180)
    assert res.returncode == 1, res.stderr[-3000:]
    assert "teacher failed to start" in res.stderr
    assert "last lines of" in res.stderr and "teacher.log" in res.stderr
    assert "Traceback" in res.stderr or "Error" in res.stderr  # the tail of the teacher's log


def test_run_stops_every_process_on_sigterm(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["OMP_NUM_THREADS"] = "1"
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "eopd_trainer.cli", "run", "--config", str(TINY),
                             f"run_dir={run_dir}", "train.iterations=200", "--no-eval"], cwd=ROOT, env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        metrics = run_dir / "train_metrics.jsonl"
        while not (metrics.exists() and '"kind": "iteration"' in metrics.read_text()):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no iteration within 180 s"
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert rc == 130, err[-3000:]
    assert "stopping every process" in err
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "stopped by a signal" in learner_log
