"""Launching the pipeline's real processes in tests (learner, rollout workers) on the tiny config."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tests.procs import ROOT, Proc, free_port, spawn

TINY = ROOT / "configs" / "tiny.yaml"


def overrides(run_dir: Path, redis_url: str, teacher_target: str, ns: str, *extra: str) -> list[str]:
    return [f"run_dir={run_dir}", f"queue.redis_url={redis_url}", f"teacher.target={teacher_target}",
            f"queue.namespace={ns}", *extra]


def spawn_learner(ov: list[str], *, nproc: int = 1, name: str = "learner") -> Proc:
    if nproc == 1:
        args = [sys.executable, "-m", "eopd_trainer.learner", "--config", str(TINY), *ov]
    else:
        args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                "-m", "eopd_trainer.learner", "--config", str(TINY), *ov]
    return spawn(args, env={"OMP_NUM_THREADS": "1"}, name=name)


def spawn_worker(ov: list[str], worker_id: str) -> Proc:
    return spawn([sys.executable, "-m", "eopd_trainer.rollout", "--config", str(TINY), "--worker-id", worker_id, *ov],
                 env={"OMP_NUM_THREADS": "1"}, name=f"worker-{worker_id}")


def wait_exit(proc: Proc, timeout: float, *others: Proc) -> int:
    """Waits for `proc` to exit; fails with its log (and the others') on timeout."""
    deadline = time.monotonic() + timeout
    while proc.alive():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.log_path}\n{p.log()[-3000:]}" for p in (proc, *others))
            proc.stop()
            raise TimeoutError(f"process did not finish in {timeout}s\n{logs}")
        time.sleep(0.2)
    return proc.popen.returncode


def describe(*procs: Proc) -> str:
    return "\n".join(f"--- {p.log_path} (rc {p.popen.poll()})\n{p.log()[-4000:]}" for p in procs)


def committed_state(run_dir: Path) -> dict:
    """The committed trainer_state.json (`LearnerState.to_json`: the resume contract's keys)."""
    from eopd_trainer.learner.checkpoint import read_state

    state = read_state(Path(run_dir) / "checkpoints")
    assert state is not None, f"no committed checkpoint in {run_dir}"
    return state.to_json()


def trained_ids(state: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for it, ids in state["ledger"].items():
        for rid in ids:
            assert rid not in out, f"{rid} trained in iterations {out[rid]} and {it}"
            out[rid] = int(it)
    return out


def iteration_records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "train_metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "iteration"]


def wait_for_iterations(run_dir: Path, n: int, timeout: float, *procs: Proc) -> None:
    deadline = time.monotonic() + timeout
    while len(iteration_records(run_dir)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {n} iterations after {timeout}s\n{describe(*procs)}")
        time.sleep(0.2)


def rollout_accounting(client, ns: str, state: dict, n_samples: int = 2) -> dict[str, set[str]]:
    """Where every rollout of every task the learner published went: `trained` (the committed
    ledger; fails if an id is in two iterations), `dead` (dead-lettered; a payload damaged by the
    `corrupt` fault is read past its leading 0xff byte), `unread` (still in the rollouts stream at
    the end) and `dropped` (none of these: acknowledged without training, i.e. stale or future).
    Fails unless every `dropped` id is recorded in `<ns>:dropped` as stale or future (`recorded`):
    no rollout leaves the stream unaccounted for."""
    from eopd_trainer.queue.messages import PoisonMessage, decode_rollout
    from eopd_trainer.queue.streams import Keys, read_dead_letters, read_dropped

    keys = Keys(ns)
    published = int(client.get(keys.tasks_next) or 0)
    every = {f"t{t}-s{s}" for t in range(published) for s in range(n_samples)}
    trained = set(trained_ids(state))
    dead: set[str] = set()
    for d in read_dead_letters(client, keys.dead):
        for payload in (d["data"], d["data"][1:]):
            try:
                dead.add(decode_rollout(payload).rollout_id)
                break
            except PoisonMessage:
                continue
    unread = {decode_rollout(f[b"data"]).rollout_id for _, f in client.xrange(keys.rollouts)}
    assert trained <= every and dead <= every and unread <= every, sorted((trained | dead | unread) - every)
    assert not trained & dead, sorted(trained & dead)
    dropped = every - trained - dead - unread
    recorded = {d["rollout_id"] for d in read_dropped(client, keys.dropped) if d["reason"] in ("stale", "future")}
    assert dropped <= recorded, f"acknowledged without a record: {sorted(dropped - recorded)}"
    return {"every": every, "trained": trained, "dead": dead, "unread": unread, "dropped": dropped,
            "recorded": recorded}
