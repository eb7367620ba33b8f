"""`threads:` of the run config (issue 31, ask 7): the environment `eopd run` gives each child. The
children reading it are checked end to end in test_run_e2e.py (their start-up logs)."""

from __future__ import annotations

import pytest

from eopd_common.cpu_threads import cpu_threads_note
from eopd_trainer.config import ConfigError, ThreadsConfig, load_config
from eopd_trainer.job.threads import thread_env
from tests.procs import ROOT


def test_the_default_is_passive_waits_at_every_core():
    """Passive waits by default (bench/bench_busy_job.py: the main job beside a CPU hog 1.75x its time
    alone, 3.27x with OpenMP's default); the thread counts stay torch's (every core)."""
    cfg = ThreadsConfig()
    for role in ("learner", "rollout", "teacher"):
        assert thread_env(cfg, role, environ={}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert thread_env(ThreadsConfig(omp_wait_policy="inherit"), "learner", environ={}) == {}


def test_counts_and_the_wait_policy_reach_each_role():
    cfg = ThreadsConfig(learner=2, rollout=1, omp_wait_policy="passive")
    assert thread_env(cfg, "learner", environ={}) == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    assert thread_env(cfg, "rollout", environ={}) == {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    assert thread_env(cfg, "teacher", environ={}) == {"OMP_WAIT_POLICY": "PASSIVE"}  # 0: the inherited or torch's count
    assert thread_env(ThreadsConfig(omp_wait_policy="active"), "teacher", environ={}) == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_a_wait_policy_set_in_the_environment_wins():
    cfg = ThreadsConfig(teacher=3, omp_wait_policy="passive")
    assert thread_env(cfg, "teacher", environ={"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_NUM_THREADS": "3"}


def test_unknown_role_and_bad_values_are_refused():
    with pytest.raises(ValueError, match="unknown role 'evaluator'"):
        thread_env(ThreadsConfig(), "evaluator", environ={})
    with pytest.raises(ConfigError, match="threads.learner"):
        load_config(ROOT / "configs" / "tiny.yaml", ["threads.learner=-1"])
    with pytest.raises(ConfigError, match="threads.omp_wait_policy"):
        load_config(ROOT / "configs" / "tiny.yaml", ["threads.omp_wait_policy=sleepy"])


@pytest.mark.parametrize("role", ["learner", "rollout", "teacher"])
def test_thread_counts_have_an_upper_bound_naming_the_field(role):
    """A fixed bound (ThreadsConfig.MAX_THREADS, not this machine's cores: a config is often checked on
    another machine than the one it runs on); a count above it is refused when the config loads,
    before eopd run starts a process with a million-thread OpenMP pool."""
    bound = ThreadsConfig.MAX_THREADS
    assert getattr(load_config(ROOT / "configs" / "tiny.yaml", [f"threads.{role}={bound}"]).threads, role) == bound
    with pytest.raises(ConfigError, match=rf"threads\.{role}: Input should be less than or equal to {bound}"):
        load_config(ROOT / "configs" / "tiny.yaml", [f"threads.{role}={bound + 1}"])
    with pytest.raises(ConfigError, match=rf"threads\.{role}"):
        load_config(ROOT / "configs" / "tiny.yaml", [f"threads.{role}=1000000000"])


def test_brief_sets_the_spin_count_and_leaves_the_policy_to_openmp():
    """`brief`: OMP_WAIT_POLICY unset, GOMP_SPINCOUNT = threads.spin_count (libgomp spins that many
    times, then sleeps); an OMP_WAIT_POLICY or GOMP_SPINCOUNT already in the environment wins."""
    cfg = ThreadsConfig(rollout=1, omp_wait_policy="brief", spin_count=1000)
    assert thread_env(cfg, "rollout", environ={}) == {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "1000"}
    assert thread_env(cfg, "learner", environ={}) == {"GOMP_SPINCOUNT": "1000"}
    assert thread_env(cfg, "learner", environ={"OMP_WAIT_POLICY": "PASSIVE"}) == {}
    assert thread_env(cfg, "learner", environ={"GOMP_SPINCOUNT": "5"}) == {}
    assert thread_env(ThreadsConfig(omp_wait_policy="brief"), "teacher", environ={}) == {"GOMP_SPINCOUNT": "10000"}
    loaded = load_config(ROOT / "configs" / "tiny.yaml", ["threads.omp_wait_policy=brief", "threads.spin_count=0"])
    assert thread_env(loaded.threads, "teacher", environ={}) == {"GOMP_SPINCOUNT": "0"}
    with pytest.raises(ConfigError, match="threads.spin_count"):
        load_config(ROOT / "configs" / "tiny.yaml", ["threads.spin_count=-1"])
    with pytest.raises(ConfigError, match="threads.spin_count"):
        load_config(ROOT / "configs" / "tiny.yaml", [f"threads.spin_count={ThreadsConfig.MAX_SPIN_COUNT + 1}"])


def test_the_start_up_note_names_the_spin_count_where_set(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert cpu_threads_note().endswith("torch threads, OMP_WAIT_POLICY=PASSIVE")
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    assert cpu_threads_note().endswith("torch threads, OMP_WAIT_POLICY=unset, GOMP_SPINCOUNT=1000")
