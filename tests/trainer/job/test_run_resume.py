"""`eopd run --resume` as real processes (tiny preset): an `eopd run` killed (SIGKILL to it and to
every process it started, all frozen first so none reacts to the others' deaths: what an OOM kill
of the lot, a laptop's dead battery or a reboot does to the processes) at the points where a crash
costs something, or stopped with Ctrl-C, then resumed until it completes.

Each interrupted run is compared with an uninterrupted one of the same seed: the final committed
iteration is `train.iterations`, each iteration of the ledger holds `train.batch_size` distinct
rollout ids, no id is in two iterations and the set of ids is the uninterrupted run's; the final
weights equal the uninterrupted run's to `WEIGHTS_ATOL` (measured: bitwise equal, see
docs/reliability.md: the rollouts are the same because sampling is seeded per task and sync mode
samples iteration i's tasks with the weights after i - 1; the learner's order, its random draws and
its optimizer state are restored); `train_metrics.jsonl` holds each step once; the evaluation ran
once (each model evaluated in exactly one invocation).

Every run here sends each round's samples to the teacher as one request (`ONE_REQUEST`): the
teacher's fp32 scores depend on which sequences it batches together (its shared prefill and the CPU
kernels' reduction order: up to 4e-6 in a log-prob on tiny-random, measured), and two requests in
flight are batched together or apart as their arrival times fall. Two requests per round made the
weights of two runs differ by ~1e-5 when a loaded machine split a round that the other run batched
whole (a rehearsal under two pytest workers, 2026-12-06); that is a property of any two runs, resumed
or not, and not what these tests check.

The chains are long (each invocation starts a teacher, a worker and a learner); they share one
uninterrupted reference run. The pieces they rely on are tested first, without processes: which
config changes a resume accepts, the metrics trimmed to the committed iteration, the queue rebuilt
from a checkpoint, the random generators restored, the run directory's lock held by the children,
the record of invocations."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import ROOT
from tests.trainer.pipeline_helpers import committed_state, trained_ids

TINY = ROOT / "configs" / "tiny.yaml"
ITERATIONS = 5
BATCH = 8  # configs/tiny.yaml train.batch_size
WEIGHTS_ATOL = 0.0  # measured: the resumed runs' weights are bitwise those of the uninterrupted run
ONE_REQUEST = f"teacher.sequences_per_request={BATCH}"  # a round's samples in one request (module docstring)


# Without processes --------------------------------------------------------------------------------

def _committed(run_dir: Path, iteration: int, **state) -> None:
    ckpt = run_dir / "checkpoints"
    (ckpt / f"iter{iteration:06d}").mkdir(parents=True)
    (ckpt / f"iter{iteration:06d}" / "trainer_state.json").write_text(json.dumps(
        {"iteration": iteration, "policy_version": iteration, "optimizer_steps": 2 * iteration, "ledger": {}, **state}))
    (ckpt / "COMMITTED").write_text(f"iter{iteration:06d}\n")


def test_resume_accepts_safe_config_changes_and_names_the_others(tmp_path):
    from eopd_trainer.config import ConfigError, dump_config, load_config
    from eopd_trainer.job.resume import check_extent, plan_start, write_requested

    run_dir = tmp_path / "run"

    def cfg(*extra):
        return load_config(TINY, [f"run_dir={run_dir}", *extra])

    assert plan_start(cfg(), resume=False, overwrite=False).resumed is False  # nothing there: a new run
    start = plan_start(cfg(), resume=True, overwrite=False)
    assert not start.resumed and "nothing to resume" in start.note
    run_dir.mkdir()
    write_requested(run_dir, cfg())
    (run_dir / "run.yaml").write_text(dump_config(cfg("queue.namespace=eopd:tiny:run:run:1")))
    _committed(run_dir, 3, tasks_published=12)

    with pytest.raises(ConfigError, match=r"already holds a trained run \(iteration 3 committed\): pass --resume .*"
                                          r"--overwrite"):
        plan_start(cfg(), resume=False, overwrite=False)
    with pytest.raises(ConfigError, match="pass one of them"):
        plan_start(cfg(), resume=True, overwrite=True)
    assert plan_start(cfg(), resume=False, overwrite=True).resumed is False
    with pytest.raises(ConfigError) as err:
        plan_start(cfg("loss.variant=opd", "train.lr=0.01", "eval.n_samples=8"), resume=True, overwrite=False)
    msg = str(err.value)
    assert "in loss.variant, train.lr:" in msg and "loss.variant: 'eopd' -> 'opd'" in msg and "eval.n_samples" not in msg
    assert "train.iterations" in msg.split("Only these may change on --resume:")[1]

    start = plan_start(cfg("train.iterations=20", "eval.n_samples=8", "logging.level=DEBUG",
                           "faults=[{point: learner.after_step}]"), resume=True, overwrite=False)
    assert (start.resumed, start.iteration, start.policy_version, start.optimizer_steps) == (True, 3, 3, 6)
    assert (start.namespace, start.tasks_published) == ("eopd:tiny:run:run:1", 12)
    assert [c.split(":")[0] for c in start.changed] == ["eval.n_samples", "faults", "logging.level", "train.iterations"]
    check_extent(start, 3)
    with pytest.raises(ConfigError, match=r"train.iterations: .* committed iteration 3; it cannot be shortened to 2"):
        check_extent(start, 2)


def test_trim_records_keeps_the_committed_iterations(tmp_path):
    from eopd_trainer.learner.metrics import trim_records

    path = tmp_path / "train_metrics.jsonl"
    rows = [{"step": 2 * i - 1 + j, "iteration": i, "kind": "step"} for i in (1, 2, 3) for j in (0, 1)]
    rows += [{"step": 2 * i, "iteration": i, "kind": "iteration"} for i in (1, 2)]  # iteration 3's summary missing
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "iter')  # a line cut by a SIGKILL
    assert trim_records(path, 3) is False  # iteration 3's record is not there: the learner appends it from the checkpoint
    assert trim_records(path, 2) is True
    assert [(r["iteration"], r["kind"]) for r in map(json.loads, path.read_text().splitlines())] == [
        (1, "step"), (1, "step"), (2, "step"), (2, "step"), (1, "iteration"), (2, "iteration")]
    assert trim_records(tmp_path / "absent.jsonl", 0) is True


def test_rebuild_republishes_the_untrained_tasks_with_their_ids():
    import fakeredis
    from eopd_trainer.learner.rebuild import rebuild_if_lost
    from eopd_trainer.learner.state import LearnerState
    from eopd_trainer.queue.messages import decode_task
    from eopd_trainer.queue.namespace import RunQueue

    r = fakeredis.FakeRedis()
    queue = RunQueue(r, "ns")
    keys = queue.keys
    ids = lambda *seqs: [f"t{t}-s{j}" for t in seqs for j in (0, 1)]  # noqa: E731
    # async, 4 tasks per iteration: t0-t7 trained but t5 (stale: replaced by t8, trained); t9 half
    # settled; t10, t11 published ahead, untouched when iteration 2 was committed.
    # (a checkpoint's trainer_state.json of that instant, from before schema_version was written)
    state = LearnerState.from_json({
        "iteration": 2, "policy_version": 2, "tasks_published": 12, "settled": ["t5-s0", "t5-s1", "t9-s1"],
        "ledger": {"1": ids(0, 1, 2, 3), "2": ids(4, 6, 7, 8)},
        "counters": {"stale_dropped": 3, "duplicates": 1, "dead_letters": 0}})

    def published_tasks():
        return [decode_task(f[b"data"]) for _, f in r.xrange(keys.tasks)]

    note = rebuild_if_lost(queue, state, n_samples=2, prompt_of=lambda seq: 100 + seq)
    assert "had no task counter" in note and "republished 3 tasks not yet trained" in note
    assert [(t.task_seq, t.prompt_index, t.num_samples, t.min_policy_version) for t in published_tasks()] == [
        (9, 109, 2, 2), (10, 110, 2, 2), (11, 111, 2, 2)]
    assert int(r.get(keys.tasks_next)) == 12
    assert {k.decode(): int(v) for k, v in r.hgetall(keys.counts).items()} == {"stale": 3, "duplicate": 1, "dead_letter": 0}
    assert rebuild_if_lost(queue, state, n_samples=2, prompt_of=lambda seq: seq) is None  # nothing lost now

    r.set(keys.tasks_next, 10)  # behind: an append-only file that lost its last writes
    r.delete(keys.tasks)
    note = rebuild_if_lost(queue, state, n_samples=2, prompt_of=lambda seq: seq)
    assert "had task counter 10" in note and [t.task_seq for t in published_tasks()] == [10, 11]
    assert int(r.get(keys.tasks_next)) == 12

    fresh = LearnerState.from_json({"iteration": 0, "policy_version": 0, "tasks_published": None, "ledger": {}})
    assert rebuild_if_lost(RunQueue(fakeredis.FakeRedis(), "ns"), fresh, n_samples=2, prompt_of=lambda seq: seq) is None
    # before tasks_published was saved:
    old = LearnerState.from_json({"iteration": 1, "policy_version": 1, "ledger": {"1": ids(0, 1, 2, 3)}})
    r2 = fakeredis.FakeRedis()
    assert "republished 0 tasks" in rebuild_if_lost(RunQueue(r2, "ns"), old, n_samples=2, prompt_of=lambda seq: seq)
    assert int(r2.get(keys.tasks_next)) == 4


def test_rng_states_round_trip_as_json():
    import random

    import numpy as np
    import torch
    from eopd_trainer.learner.checkpoint import rng_state, set_rng_state

    saved = json.loads(json.dumps(rng_state()))
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    set_rng_state(saved)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == first


def test_run_lock_is_held_until_the_last_child_exits(tmp_path):
    from eopd_trainer.job.resume import RunDirBusy, RunLock
    from eopd_trainer.job.supervisor import Supervisor

    lock = RunLock(tmp_path)
    lock.acquire(wait_s=0)
    sup = Supervisor(tmp_path / "logs", pass_fds=(lock.fd,))
    child = sup.start("worker", ["sleep", "60"])
    sup.start("teacher", ["sleep", "60"], hold=False)  # does not hold it
    # the killed eopd run: a pid above the kernel's largest pid_max (2**22), so no process has it
    lock.record({"eopd run": 2**22 + 1, "worker": child.popen.pid})
    lock.release()  # eopd run is gone; its worker is not
    notes: list[str] = []
    with pytest.raises(RunDirBusy, match=rf"still in use \(worker pid {child.popen.pid}\) after 1 s"):
        RunLock(tmp_path).acquire(wait_s=1, note=notes.append)
    assert "waiting up to 1 s for the processes of a previous eopd run" in notes[0]
    child.popen.kill()
    child.popen.wait()
    again = RunLock(tmp_path)
    again.acquire(wait_s=5)  # the teacher still runs: it does not matter
    again.release()
    sup.stop_all()


def test_run_record_keeps_every_invocation(tmp_path):
    from eopd_trainer.job.run_record import RunRecord

    rec = RunRecord(tmp_path, keep=True)
    inv = rec.begin(mode="new", facts={"student_init": "s"}, config=tmp_path / "run.yaml", resumed_at=None)
    inv.update(queue="queue: q1", queue_backend="embedded")
    rec.trained(1, 10.0)
    rec.trained(2, 20.0)  # then killed: nothing more recorded
    settings = {"n_samples": 2}
    rec = RunRecord(tmp_path, keep=True)
    rec.begin(mode="resume", facts={"student_init": "s"}, config=tmp_path / "run.yaml", resumed_at={"iteration": 2})
    rec.trained(3, 5.0)
    assert rec.to_evaluate(["initial", "final"], {"initial": "a", "final": "b"}, settings) == ["initial", "final"]
    rec.evaluated("initial", "a", settings)
    rec.end("completed", 30.0)
    data = json.loads((tmp_path / "run_summary.json").read_text())
    assert [i["outcome"] for i in data["invocations"]] == ["killed (no exit recorded)", "completed"]
    assert [i["iterations"] for i in data["invocations"]] == [[1, 2], [3, 3]]
    assert data["train_s"] == 25.0 and data["queue"] == "queue: q1" and data["student_init"] == "s"
    rec = RunRecord(tmp_path, keep=True)
    assert rec.to_evaluate(["initial", "final"], {"initial": "a", "final": "b"}, settings) == ["final"]
    assert rec.to_evaluate(["initial"], {"initial": "a"}, {"n_samples": 4}) == ["initial"]  # other settings
    assert rec.to_evaluate(["initial"], {"initial": "other"}, settings) == ["initial"]  # another model
    assert RunRecord(tmp_path, keep=False).data == {"invocations": []}


# Real processes -----------------------------------------------------------------------------------

def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    e["OMP_NUM_THREADS"] = "1"
    return e


class Run:
    """One `eopd run` invocation in the background, its stderr in a file."""

    def __init__(self, run_dir: Path, *args: str, name: str, config: Path = TINY):
        self.run_dir = run_dir
        self.err_path = run_dir.parent / f"{name}.stderr"
        self.learner_log = run_dir / "logs" / "learner.log"
        self.learner_offset = self.learner_log.stat().st_size if self.learner_log.exists() else 0
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "eopd_trainer.cli", "run", "--config", str(config), f"run_dir={run_dir}",
                 ONE_REQUEST, *args], cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def learner(self) -> str:
        """What the learner logged in this invocation."""
        if not self.learner_log.exists():
            return ""
        with open(self.learner_log, errors="replace") as fh:
            fh.seek(self.learner_offset)
            return fh.read()

    def wait_for(self, what: str, where, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while what not in where():
            assert self.proc.poll() is None, f"eopd run exited ({self.proc.returncode}):\n{self.stderr()[-4000:]}"
            assert time.monotonic() < deadline, f"{what!r} not seen in {timeout} s:\n{self.stderr()[-3000:]}"
            time.sleep(0.3)

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            raise

    def freeze(self, seconds: float) -> None:
        """SIGSTOP to eopd run and every process it started, SIGCONT `seconds` later."""
        procs = descendants(self.proc.pid)
        for sig in (signal.SIGSTOP, signal.SIGCONT):
            for p in procs:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            time.sleep(seconds if sig == signal.SIGSTOP else 0)

    def kill_all(self) -> None:
        """SIGKILL to eopd run and every process it started, all stopped (SIGSTOP) first."""
        kill_tree(self.proc.pid)
        self.proc.wait(30)


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def kill_tree(pid: int) -> None:
    procs = descendants(pid)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in procs:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass


def weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    tag = (run_dir / "checkpoints" / "COMMITTED").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / tag / "hf" / "model.safetensors"))


def max_weight_difference(a: Path, b: Path) -> float:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa)


def metric_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train_metrics.jsonl").read_text().splitlines()]


def tensorboard_steps(run_dir: Path, tag: str) -> list[int]:
    """The steps TensorBoard shows for `tag` (what a crashed attempt wrote past a resume is purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb" / "train"), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def assert_completed_exactly_once(run_dir: Path, reference: Path) -> dict:
    state = committed_state(run_dir)
    assert state["iteration"] == ITERATIONS
    ids = trained_ids(state)  # fails if an id is in two iterations
    per_iteration = [list(ids.values()).count(i) for i in range(1, ITERATIONS + 1)]
    assert per_iteration == [BATCH] * ITERATIONS, per_iteration
    assert set(ids) == set(trained_ids(committed_state(reference)))
    assert state["optimizer_steps"] == state["global_steps"] == 2 * ITERATIONS  # no step of a killed attempt survives
    records = metric_records(run_dir)  # each step once, every iteration once, in order
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, 2 * ITERATIONS + 1))
    assert [r["iteration"] for r in records if r["kind"] == "iteration"] == list(range(1, ITERATIONS + 1))
    assert tensorboard_steps(run_dir, "loss") == list(range(1, 2 * ITERATIONS + 1))  # purge_step hid the redone ones
    difference = max_weight_difference(run_dir, reference)
    print(f"max |weights - uninterrupted weights| = {difference:.3g}")
    assert difference <= WEIGHTS_ATOL
    return json.loads((run_dir / "run_summary.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run (same seed), no evaluation."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    r = Run(run_dir, f"train.iterations={ITERATIONS}", "--no-eval", name="reference")
    assert r.wait() == 0, r.stderr()[-4000:]
    return run_dir


@pytest.mark.integration
@pytest.mark.chaos
def test_sigkilled_at_every_point_then_resumed_on_redis_server(tmp_path, reference):
    """The run's own redis-server (its append-only file in <run_dir>/redis) killed with everything
    else, four times: mid-iteration, while a checkpoint is written, between a commit and its
    acknowledgement, during the evaluation. Pending rollouts and tasks come back from the file."""
    run_dir = tmp_path / "run"
    evals = "eval.models=[initial,final]"

    # 1. mid-iteration: iteration 2's first optimizer step done, nothing of it committed
    r = Run(run_dir, f"train.iterations={ITERATIONS}", evals,
            "faults=[{point: learner.after_step, iteration: 2, step: 1, action: hang}]", name="1")
    r.wait_for("injected fault hang at learner.after_step", r.learner)
    r.kill_all()
    assert committed_state(run_dir)["iteration"] == 1

    # Without --resume the trained run is refused, naming both options.
    res = subprocess.run([sys.executable, "-m", "eopd_trainer.cli", "run", "--config", str(TINY),
                          f"run_dir={run_dir}", ONE_REQUEST, f"train.iterations={ITERATIONS}", evals], cwd=ROOT, env=env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "already holds a trained run" in res.stderr, res.stderr[-2000:]
    assert "--resume" in res.stderr and "--overwrite" in res.stderr

    # 2. while the checkpoint of iteration 3 is written (DeepSpeed's shards on disk, not committed)
    r = Run(run_dir, f"train.iterations={ITERATIONS}", evals, "--resume",
            "faults=[{point: checkpoint.write, iteration: 3, action: hang}]", name="2")
    r.wait_for("injected fault hang at checkpoint.write", r.learner)
    assert "resuming" in r.stderr() and "at iteration 1 of 5 (policy version 1" in r.stderr()
    assert "queue recovered (redis-server)" in r.stderr()
    r.kill_all()
    assert committed_state(run_dir)["iteration"] == 2
    assert not (run_dir / "checkpoints" / "iter000003" / "trainer_state.json").exists()

    # 3. between the commit of iteration 4 and the acknowledgement of its rollouts
    r = Run(run_dir, f"train.iterations={ITERATIONS}", evals, "--resume",
            "faults=[{point: learner.after_commit, iteration: 4, action: hang}]", name="3")
    r.wait_for("injected fault hang at learner.after_commit", r.learner)
    r.kill_all()
    assert committed_state(run_dir)["iteration"] == 4

    # 4. during the evaluation, after its first model
    r = Run(run_dir, f"train.iterations={ITERATIONS}", evals, "--resume",
            "faults=[{point: run.evaluate, count: 1, action: hang}]", name="4")
    r.wait_for("injected fault hang at run.evaluate", r.stderr)
    assert "8 scored rollouts of this run in it (8 of them read by the learner" in r.stderr()  # iteration 4's
    r.kill_all()
    assert committed_state(run_dir)["iteration"] == ITERATIONS
    assert set(json.loads((run_dir / "eval.json").read_text())["models"]) == {"initial"}

    # 5. the evaluation is resumed, not the training
    r = Run(run_dir, f"train.iterations={ITERATIONS}", evals, "--resume", name="5")
    assert r.wait() == 0, r.stderr()[-4000:]
    err = r.stderr()
    assert "training is complete (5 iterations committed): nothing to train" in err
    assert "evaluation: initial evaluated already in this run" in err
    assert r.learner() == ""  # no learner started

    summary = assert_completed_exactly_once(run_dir, reference)
    outcomes = [inv["outcome"] for inv in summary["invocations"]]
    assert outcomes == ["killed (no exit recorded)"] * 4 + ["completed"], outcomes
    assert [inv.get("evaluated", []) for inv in summary["invocations"]] == [[], [], [], ["initial"], ["final"]]
    assert [inv["resumed_at"]["iteration"] for inv in summary["invocations"][1:]] == [1, 2, 4, 5]
    assert set(json.loads((run_dir / "eval.json").read_text())["models"]) == {"initial", "final"}

    # A changed loss variant is refused, naming it; nothing is started.
    res = subprocess.run([sys.executable, "-m", "eopd_trainer.cli", "run", "--config", str(TINY),
                          f"run_dir={run_dir}", ONE_REQUEST, f"train.iterations={ITERATIONS}", evals, "loss.variant=opd",
                          "--resume"],
                         cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "the config differs from the run's (run.requested.yaml) in loss.variant" in res.stderr
    assert "loss.variant: 'eopd' -> 'opd'" in res.stderr


@pytest.mark.integration
@pytest.mark.chaos
def test_embedded_queue_sigkill_then_ctrl_c_then_extended(tmp_path, reference):
    """The embedded queue dies with eopd run: the resumed learner rebuilds what it needs from its
    checkpoint. Then a freeze of every process (a sleeping laptop), Ctrl-C (SIGINT) and a resume
    that extends train.iterations from 4 to 5."""
    run_dir = tmp_path / "run"
    common = ("queue.backend=embedded", "--no-eval")

    # 1. SIGKILL mid-iteration 2 (its second optimizer step done): the queue is lost with eopd run
    r = Run(run_dir, "train.iterations=4", *common,
            "faults=[{point: learner.after_step, iteration: 2, step: 2, action: hang}]", name="1")
    r.wait_for("injected fault hang at learner.after_step", r.learner)
    r.kill_all()
    assert committed_state(run_dir)["iteration"] == 1

    # 2. resumed: the queue is rebuilt. Every process frozen for 6 s (a laptop asleep: longer than
    # queue.lease_ttl_s, which Redis counts in wall-clock time; eopd run's learner holds its lease for
    # days), then Ctrl-C once iteration 3 is trained
    r = Run(run_dir, "train.iterations=4", *common, "--resume", "queue.lease_ttl_s=2", name="2")
    metrics = lambda: (run_dir / "train_metrics.jsonl").read_text()  # noqa: E731
    r.wait_for('"iteration": 2', metrics)
    r.freeze(6)
    r.wait_for('"iteration": 3', metrics)
    err = r.stderr()
    assert "queue rebuilt: the embedded queue lives in the eopd run process and went with the interrupted one" in err
    assert "republished 0 tasks not yet trained" in r.learner() and "task counter set to 4" in r.learner()
    r.proc.send_signal(signal.SIGINT)
    assert r.wait(180) == 130, r.stderr()[-4000:]
    assert "interrupted (SIGINT)" in r.stderr()
    committed = committed_state(run_dir)["iteration"]
    assert committed in (3, 4)

    # 3. resumed with more iterations: trains to 5
    r = Run(run_dir, f"train.iterations={ITERATIONS}", *common, "--resume", name="3")
    assert r.wait() == 0, r.stderr()[-4000:]
    assert f"; train.iterations: 4 -> {ITERATIONS}" in r.stderr()  # after queue.lease_ttl_s: 2 -> 15.0

    summary = assert_completed_exactly_once(run_dir, reference)
    assert [inv["outcome"] for inv in summary["invocations"]] == [
        "killed (no exit recorded)", "interrupted (SIGINT)", "completed"]
    assert [inv.get("queue_state") for inv in summary["invocations"]] == [None, "rebuilt", "rebuilt"]
