"""The eval cache in the main job: two real `eopd run`s of the tiny preset (real processes) with
the same models, data, eval settings and seed; the second reuses the teacher's and the initial
student's evaluations, with the first's numbers, and says so (its log, eval.json, the report's table)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from eopd_common.models import default_cache_dir, smollm2_dir
from eopd_trainer.eval.report_tables import table
from tests.procs import ROOT

pytestmark = pytest.mark.integration


def _run(run_dir, cache_dir) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env.update(OMP_NUM_THREADS="1", EOPD_CACHE_DIR=str(cache_dir))
    return subprocess.run([sys.executable, "-m", "eopd_trainer.cli", "run", "--config", str(ROOT / "configs/tiny.yaml"),
                           f"run_dir={run_dir}", "train.iterations=2", "queue.backend=embedded"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.timeout(1800)  # several real processes; minutes on a loaded 2-core machine
def test_a_second_run_reuses_the_teacher_and_initial_evaluations(tmp_path):
    cache_dir = tmp_path / "cache"  # a cache of its own; the tokenizer the tiny models share linked in
    cache_dir.mkdir()
    (cache_dir / "smollm2-135m").symlink_to(smollm2_dir(default_cache_dir(), tokenizer_only=True))
    first = _run(tmp_path / "a", cache_dir)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "reused from cache" not in first.stderr
    second = _run(tmp_path / "b", cache_dir)
    assert second.returncode == 0, second.stderr[-4000:]

    a = json.loads((tmp_path / "a" / "eval.json").read_text())["models"]
    b = json.loads((tmp_path / "b" / "eval.json").read_text())["models"]
    assert set(a) == set(b) == {"teacher", "initial", "final"}
    for name in ("teacher", "initial"):
        assert a[name]["cache"]["reused"] is False and b[name]["cache"]["reused"] is True
        key = b[name]["cache"]["key"]
        assert key == a[name]["cache"]["key"] and (cache_dir / "evals" / f"{key}.json").is_file()
        numbers = lambda r: {k: v for k, v in r.items() if k != "cache"}  # noqa: E731
        assert numbers(b[name]) == numbers(a[name])  # identical numbers, eval_s and samples included
        assert f"eval {name}: " in second.stderr and f"[reused from cache {key}]" in second.stderr
        assert f"b / {name} (reused from cache {key})" in table([tmp_path / "b"])
    assert a["initial"]["avg_at_k"] is not None and a["teacher"]["reverse_kl"] == 0.0
    assert a["final"]["model"] != b["final"]["model"]  # each run's own export, keyed by its files
    assert len(list((cache_dir / "evals").glob("*.json"))) in (3, 4)  # teacher, initial, one or two finals
