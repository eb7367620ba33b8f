"""The environment that sizes a child's CPU threads (`threads:` of the run config, issue 31 ask 7).

`eopd run` starts a learner, rollout workers and teachers on one machine. Each is a torch process
whose OpenMP pool has, by default, as many threads as there are cores, and OpenMP's default wait
policy lets a thread that waits at a barrier spin before it sleeps. In sync mode the three mostly
take turns, so each may use every core; but when the machine is shared (another job, a second run,
a test suite), a thread spinning for a preempted one burns the CPU the others need
(`bench/bench_threads.py`: a sampler beside a 2-thread CPU hog ran 16x slower with the default
policy, 1.4x with OMP_WAIT_POLICY=PASSIVE). OpenMP reads both settings once, when a process starts,
so they reach a child through its environment, which is what this module builds."""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..config import ThreadsConfig

ROLES = ("learner", "rollout", "teacher")


def thread_env(cfg: ThreadsConfig, role: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to set in a child of `role` (learner, rollout, teacher): OMP_NUM_THREADS when
    the role's thread count is set (> 0; else the child keeps this process's value or torch's
    default, every core); OMP_WAIT_POLICY for the policies passive and active unless it is already
    set in `environ` (this process's environment: the user's explicit choice wins); GOMP_SPINCOUNT
    for `brief` unless either variable is already set there; nothing for `inherit`."""
    if role not in ROLES:
        raise ValueError(f"thread_env: unknown role {role!r} (one of {', '.join(ROLES)})")
    environ = os.environ if environ is None else environ
    env: dict[str, str] = {}
    count = getattr(cfg, role)
    if count:
        env["OMP_NUM_THREADS"] = str(count)
    if cfg.omp_wait_policy == "brief":
        if "OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ:  # the user's explicit choice wins
            env["GOMP_SPINCOUNT"] = str(cfg.spin_count)
    elif cfg.omp_wait_policy != "inherit" and "OMP_WAIT_POLICY" not in environ:
        env["OMP_WAIT_POLICY"] = cfg.omp_wait_policy.upper()
    return env
