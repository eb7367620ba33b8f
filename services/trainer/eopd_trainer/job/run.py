"""`eopd run`: the whole job on one machine, from nothing pre-started.

    eopd run --config configs/smollm2-cpu.yaml [key=value ...] [--validate-only] [--no-eval]
             [--overwrite | --resume]

1. validates the config; materialises what it names (a layer-subset student into
   `<run_dir>/student-init`, generated task splits into `<run_dir>/data`) and writes the effective
   config the processes load to `<run_dir>/run.yaml`;
2. picks the queue (`queue.backend`, default auto; `local_queue.py`): the Redis at `$REDIS_URL` if it
   answers, else a `redis-server` started on a free port with its append-only file in
   `<run_dir>/redis` (if the binary is installed), else the embedded in-memory queue
   (`embedded_queue.py`: a Redis-protocol server in a thread of this process, lost if this process
   dies); it says which one;
3. starts the teacher (`eopd-teacher serve --model teacher.model` on port 0, reporting the ports it
   bound: `teacher_proc.py`; and each of `teachers:` that names a model: `run_teachers.py`), the
   learner and, once the teachers' /readyz answer, one rollout worker,
   as separate processes, logs in `<run_dir>/logs/` (`supervisor.py`); a run that needs no teacher
   to train (loss.variant grpo without train.warmup_kd_iterations) starts none and says so (the
   evaluation still loads teacher.model in-process for its ceiling and KL columns);
4. supervises them: a progress bar from the learner's `train_metrics.jsonl`; Ctrl-C / SIGTERM stop
   every process cleanly (the learner keeps its last committed checkpoint); a process that dies
   makes the run exit 1 with the tail of its log;
5. evaluates (`eopd eval`) `eval.models` on the held-out prompts into `<run_dir>/eval.json` unless
   `--no-eval` / `eval.enabled=false`, model by model, each recorded in `run_summary.json`.

A run directory holding a committed checkpoint is refused unless `--resume` (continue it: same
namespace, same queue or one rebuilt from the checkpoint, only safe config changes; `resume.py`)
or `--overwrite` (delete it). A resumed run whose training is complete evaluates what is left.
`run_summary.json` records every invocation (`run_record.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from eopd_common.memory import release_freed

from ..config import ConfigError, RunConfig, dump_config, load_config, loss_defaults_note
from ..config.stages import run_needs_teacher
from ..data import load_prompts
from ..eval.runs import EvalSet, eval_path, resolve_model, summary_line
from ..faults import Faults
from ..learner.metrics import trim_records
from .local_queue import QueueChoice, choose_queue, run_key_file
from .prepare import check_data, check_teacher_context, prepare, validate
from .progress import Progress
from .resume import (
    RunDirBusy,
    RunLock,
    Start,
    check_extent,
    clear_attempt,
    clear_run_dir,
    plan_start,
    queue_state,
    write_requested,
)
from .run_record import RunRecord
from .supervisor import Child, RunError, Supervisor
from .run_teachers import RunTeachers
from .threads import thread_env
from .weight_sync import broadcast_here, choose_weight_sync, release_shm

EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130
RUN_LEASE_TTL_S = 7 * 24 * 3600.0  # the learner's lease in an eopd run (see TrainingAttempt.write_config)
RUN_UMASK = 0o077  # what eopd run and its children create is owner-only


def say(msg: str) -> None:
    print(f"eopd run: {msg}", file=sys.stderr, flush=True)


def _raise_interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt


def _effective(cfg: RunConfig, *, target: str, queue: dict) -> RunConfig:
    """The config the processes load: the teacher and queue this invocation uses, no console bars."""
    return cfg.model_copy(update={
        "teacher": cfg.teacher.model_copy(update={"target": target}),
        "queue": cfg.queue.model_copy(update=queue),
        "logging": cfg.logging.model_copy(update={"progress": False}),
    })


def _write_run_yaml(run_dir: Path, cfg: RunConfig) -> Path:
    path = run_dir / "run.yaml"
    path.write_text(dump_config(cfg))
    load_config(path)  # what the children will load must validate
    return path


def run(cfg: RunConfig, *, overwrite: bool = False, resume: bool = False, evaluate: bool = True,
        teacher_timeout: float = 600.0, learner_timeout: float | None = None) -> int:
    problems = validate(cfg)
    if problems:
        raise ConfigError("cannot run:\n" + "\n".join(f"  {p}" for p in problems))
    t_start = time.monotonic()
    # Owner-only: the run directory (made 0700) and every file and directory this process and its children
    # create (umask 077, inherited): rollouts in redis' append-only file, checkpoints, published weights
    # (also in /dev/shm), logs, the queue's password and key, the teacher's token.
    old_umask = os.umask(RUN_UMASK)
    lock = RunLock(Path(cfg.run_dir).resolve())
    try:
        try:  # waits for the processes of a killed invocation of this run directory
            lock.acquire(note=say)
        except RunDirBusy as exc:
            say(str(exc))
            return EXIT_FAILED
        except KeyboardInterrupt:
            say("interrupted while waiting for the run directory")
            return EXIT_INTERRUPTED
        try:
            lock.run_dir.chmod(0o700)  # a run directory made before (or by another tool) may be 0755
            return _run(cfg, lock, t_start, overwrite=overwrite, resume=resume, evaluate=evaluate,
                        teacher_timeout=teacher_timeout, learner_timeout=learner_timeout)
        finally:
            lock.release()
    finally:
        os.umask(old_umask)


def _run(cfg: RunConfig, lock: RunLock, t_start: float, *, overwrite: bool, resume: bool, evaluate: bool,
         teacher_timeout: float, learner_timeout: float | None) -> int:
    start = plan_start(cfg, resume=resume, overwrite=overwrite)  # ConfigError: refused, with the reason
    run_dir = lock.run_dir
    if overwrite:
        clear_run_dir(run_dir)
    elif not start.resumed:
        clear_attempt(run_dir)
    release_shm(run_dir)  # a killed invocation's shared-memory weights (a resume republishes)
    if start.note:
        say(start.note)
    requested = cfg
    cfg, facts = prepare(cfg, keep_trained=start.resumed, build_apart=True)
    prompts = load_prompts(cfg.data.train_files, cfg.data.field)
    check_teacher_context(cfg, prompts)  # ConfigError: a record lacks a field of teacher.prompt_template
    total = cfg.total_iterations(len(prompts))
    del prompts
    release_freed()  # the student built, the data written: this process only supervises until the evaluation
    check_extent(start, total)
    write_requested(run_dir, requested)
    record = RunRecord(run_dir, keep=start.resumed)
    resumed_at = ({"iteration": start.iteration, "policy_version": start.policy_version,
                   "optimizer_steps": start.optimizer_steps} if start.resumed else None)
    summary = record.begin(mode="resume" if start.resumed else "new", facts=facts, config=run_dir / "run.yaml",
                           resumed_at=resumed_at)
    if start.resumed:
        say(f"resuming {run_dir} at iteration {start.iteration} of {total} (policy version {start.policy_version}, "
            f"optimizer step {start.optimizer_steps})" + (f"; changed: {'; '.join(start.changed)}" if start.changed else ""))
    if not start.resumed or start.iteration < total:
        code, cfg = TrainingAttempt(cfg, run_dir, start, total, lock, record, teacher_timeout=teacher_timeout,
                                    learner_timeout=learner_timeout).run()
        if code:
            record.end(summary["outcome"], time.monotonic() - t_start)
            return code
        say(f"training done in {summary['train_s']:.0f} s")
    else:  # trained to the end before: evaluate what is left, with this invocation's eval settings
        prev = start.previous
        cfg = _effective(cfg, target=prev.teacher.target, queue={"redis_url": prev.queue.redis_url, "namespace":
                                                                  prev.queue.namespace, "backend": prev.queue.backend})
        _write_run_yaml(run_dir, cfg)
        say(f"training is complete ({total} iterations committed): nothing to train")
    if evaluate and cfg.eval.enabled and cfg.data.eval_files:
        t0 = time.monotonic()
        old = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            result = _evaluate(run_dir, cfg, record)
        except KeyboardInterrupt:
            summary["eval_s"] = time.monotonic() - t0
            say("interrupted during the evaluation: `eopd run ... --resume` evaluates the models left (no training)")
            record.end("interrupted during the evaluation", time.monotonic() - t_start)
            return EXIT_INTERRUPTED
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        summary["eval_s"] = time.monotonic() - t0
        for name, r in result["models"].items():  # headline avg@n / pass@n, the other grading's avg@n, KL
            say(f"eval {summary_line(name, r)}")
        variants = eval_path(run_dir, "variants")
        if variants.is_file():  # the same family written differently (data.generate.variants)
            for name, r in json.loads(variants.read_text())["models"].items():
                say(f"eval [variants] {summary_line(name, r)}")
    record.end("completed", time.monotonic() - t_start)
    say(f"finished in {summary['total_s']:.0f} s; see {run_dir}")
    return 0


class _StopSignal:
    """The SIGINT/SIGTERM handler while training: remembers the signal; `check()` raises
    KeyboardInterrupt once one came (the loops call it between their polls)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    def __call__(self, signum, _frame) -> None:
        self.signum = signum

    def install(self) -> None:
        self._old = {s: signal.signal(s, self) for s in self.SIGNALS}

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def check(self) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGINT).name


class TrainingAttempt:
    """Queue, teacher, learner and rollout worker until the learner has committed iteration `total`.
    `run()` returns (exit code, the effective config); 0 when trained."""

    def __init__(self, cfg: RunConfig, run_dir: Path, start: Start, total: int, lock: RunLock, record: RunRecord, *,
                 teacher_timeout: float, learner_timeout: float | None):
        self.cfg, self.run_dir, self.start, self.total = cfg, run_dir, start, total
        self.lock, self.record, self.summary = lock, record, record.current
        self.teacher_timeout, self.learner_timeout = teacher_timeout, learner_timeout
        # the children that touch the run's state hold the run directory's lock until they exit
        self.sup = Supervisor(run_dir / "logs", pass_fds=(lock.fd,))
        self.stop = _StopSignal()
        self.teachers = RunTeachers(self.sup, run_dir, teacher_timeout, say)
        self.learner: Child | None = None
        self.progress: Progress | None = None
        self.config_path = run_dir / "run.yaml"

    def run(self) -> tuple[int, RunConfig]:
        self.stop.install()
        try:
            self._train()
        except KeyboardInterrupt:
            say(f"interrupted ({self.stop.name}): stopping every process (the learner keeps its last committed "
                "checkpoint; `eopd run ... --resume` continues from it)")
            return self._abort(f"interrupted ({self.stop.name})", EXIT_INTERRUPTED)
        except RunError as exc:
            say(str(exc))
            return self._abort(f"failed: {str(exc).splitlines()[0]}", EXIT_FAILED)
        finally:
            self.stop.restore()
        self.sup.stop_all()
        release_shm(self.run_dir)  # once the children stopped: it holds RAM; a resume republishes
        return 0, self.cfg

    def _abort(self, outcome: str, code: int) -> tuple[int, RunConfig]:
        if self.progress is not None:
            self.progress.bar.close()
        self.sup.stop_all()
        release_shm(self.run_dir)
        self.summary["outcome"] = outcome
        return code, self.cfg

    def _train(self) -> None:
        cpu0 = time.process_time()
        queue, ns = self.start_queue()
        if run_needs_teacher(self.cfg.loss, self.cfg.train.warmup_kd_iterations):
            self.teachers.start(self.cfg, self._poll)
        else:
            say(self.no_teacher_note())
        self.write_config(queue, ns)
        self.start_learner()
        self.teachers.wait_ready(self._poll)
        self.start_worker()
        self.follow_learner()
        # CPU of this process so far: the progress bar and, with the embedded queue, the queue server
        self.summary["supervisor_cpu_s"] = round(time.process_time() - cpu0, 2)
        self.wait_workers()

    def _poll(self) -> None:
        """Between the polls of a wait: a signal interrupts; another child failing fails the run (the
        teacher's own death is reported by the wait, as "failed to start")."""
        self.stop.check()
        if self.teachers.alive():
            self.sup.check()

    def start_queue(self) -> tuple[QueueChoice, str]:
        queue = choose_queue(self.sup, self.run_dir, self.cfg.queue)
        say(queue.message)
        self.summary["queue"], self.summary["queue_backend"] = queue.message, queue.backend
        ns = self.start.namespace or f"{self.cfg.queue.namespace}:run:{self.run_dir.name}:{time.time_ns()}"
        if self.start.resumed:  # recovered (redis-server's append-only file, an external Redis) or rebuilt
            self.summary["queue_state"], message = queue_state(queue.auth_url, ns, self.start, queue.backend)
            say(message)
        return queue, ns

    def no_teacher_note(self) -> str:
        """What `eopd run` says when training needs no teacher (grpo without a KD warm-up)."""
        cfg = self.cfg
        note = f"loss.variant={cfg.loss.variant} trains without a teacher: no teacher process started (the worker grades its samples)"
        evaluating = cfg.eval.enabled and cfg.data.eval_files and cfg.teacher.model
        if evaluating and "teacher" in cfg.eval.models:
            return note + f"; teacher {cfg.teacher.model} used for evaluation only (eval.models has teacher: the ceiling and the KL columns)"
        if evaluating:
            return note + f"; teacher {cfg.teacher.model} used for evaluation only (the KL columns of eval.json)"
        return note

    def write_config(self, queue: QueueChoice, ns: str) -> None:
        # The learner's lease outlives a sleeping laptop: its TTL runs on Redis' wall clock, so a short one
        # expired while the machine slept and the learner refused to commit after waking up (exit 6).
        # On one machine the run directory's lock already keeps a second learner out.
        self.cfg = self.teachers.effective(self.cfg)  # the teachers started here: their targets and token
        self.cfg = _effective(self.cfg, target=self.cfg.teacher.target,
                              queue={"redis_url": queue.url, "namespace": ns, "backend": queue.backend,
                                     "auth_key_file": run_key_file(self.run_dir, self.cfg.queue),
                                     "lease_ttl_s": max(self.cfg.queue.lease_ttl_s, RUN_LEASE_TTL_S)})
        sync, why = choose_weight_sync(self.cfg)  # one node: shared memory where it has room
        say(why)
        self.cfg = self.cfg.model_copy(update={"weight_sync": sync})
        if sync == "broadcast":  # the group of this run's learner and its one worker
            self.cfg = self.cfg.model_copy(update={"weight_broadcast": broadcast_here(self.cfg.weight_broadcast)})
        self.config_path = _write_run_yaml(self.run_dir, self.cfg)

    def start_learner(self) -> None:
        if self.start.resumed:  # before the learner starts: the bar must not count records of iterations trained again
            trim_records(self.run_dir / "train_metrics.jsonl", self.start.iteration)
        # The learner never talks to the teacher: it loads while the teacher does. The worker waits for it.
        # threads: (job/threads.py): every core by default, in sync mode the processes mostly take turns
        self.learner = self.sup.start("learner", [sys.executable, "-m", "eopd_trainer.learner", "--config",
                                                  str(self.config_path)], thread_env(self.cfg.threads, "learner"))

    def start_worker(self) -> None:
        self.sup.start("rollout-w0", [sys.executable, "-m", "eopd_trainer.rollout", "--config", str(self.config_path),
                                      "--worker-id", "w0"], thread_env(self.cfg.threads, "rollout"))
        self.lock.record({"eopd run": os.getpid(), **{c.name: c.popen.pid for c in self.sup.children if c.holds}})

    def follow_learner(self) -> None:
        """The progress bar until the learner exits; RunError if it fails or another child dies."""
        first = self.start.iteration if self.start.resumed else 0
        progress = self.progress = Progress(self.run_dir / "train_metrics.jsonl", self.total, initial=first)
        t_learn = time.monotonic()
        while self.learner.alive():
            self.stop.check()
            self.sup.check(allowed_done=("rollout-w0",))  # a worker exits 0 only once the learner set <ns>:done
            seen = progress.done
            progress.poll()
            if progress.done != seen:
                self.record.trained(progress.done, time.monotonic() - t_learn)
            if self.learner_timeout and time.monotonic() - t_learn > self.learner_timeout:
                raise self.learner.failure(f"did not finish within {self.learner_timeout:.0f} s")
            time.sleep(0.5)
        progress.close()
        if progress.done > first:
            self.record.trained(progress.done, time.monotonic() - t_learn)
        self.progress = None
        if progress.stopped_by:  # train.stop_on: the learner stopped the run on an alarm
            self.summary["stopped_by"] = progress.stopped_by
            raise RunError(f"stopped: {progress.stopped_by}")
        if self.learner.popen.returncode != 0:
            raise self.learner.failure("failed")
        self.summary["train_s"] = time.monotonic() - t_learn

    def wait_workers(self) -> None:
        """The workers exit once they see the learner's <ns>:done: up to 60 s."""
        deadline = time.monotonic() + 60
        workers = [c for c in self.sup.children if c.name.startswith("rollout")]
        while any(c.alive() for c in workers) and time.monotonic() < deadline:
            self.sup.check(allowed_done=("learner", "rollout-w0"))
            time.sleep(0.2)
        self.sup.check(allowed_done=("learner", "rollout-w0"))


VARIANTS_FILE = "heldout_variants.jsonl"  # written by data.generate.variants (tasks.write_splits)


def _evaluate(run_dir: Path, cfg: RunConfig, record: RunRecord) -> dict:
    """`eopd eval` of `eval.models`, one model at a time, each recorded when done: a run
    interrupted during the evaluation evaluates only the models left when resumed (and a model
    evaluated already with the same settings is not evaluated again). One evaluator for all: the
    teacher loaded once, each model once for both sets, evaluations in the eval cache reused."""
    settings = cfg.eval.model_dump(mode="json", exclude={"models", "enabled", "cache"})
    resolved = {m: resolve_model(m, run_dir, cfg) for m in cfg.eval.models}
    todo = record.to_evaluate(cfg.eval.models, resolved, settings)
    done = [m for m in cfg.eval.models if m not in todo]
    if done:
        say(f"evaluation: {', '.join(done)} evaluated already in this run (same model, same eval settings)")
    faults = Faults(cfg.faults)
    gen = cfg.data.generate
    sets = [EvalSet(None, tuple(Path(f) for f in cfg.data.eval_files))]
    if gen is not None and gen.variants and cfg.eval.variants:  # the same family written differently
        sets.append(EvalSet("variants", (run_dir / "data" / VARIANTS_FILE,)))
    # imported here: the evaluation loads models (torch, transformers); the supervisor imports them only
    # when it evaluates, and holds neither while the run trains
    from ..eval.evaluate import RunEvaluator

    evaluator = RunEvaluator(run_dir) if todo else None
    for i, name in enumerate(todo):
        faults.hit("run.evaluate", count=i)  # fault point: before the i-th model (tests interrupt the evaluation)
        evaluator.evaluate(name, sets)
        record.evaluated(name, resolved[name], settings)
    path = run_dir / "eval.json"
    return json.loads(path.read_text()) if path.is_file() else {"models": {}}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eopd run", description="Run the whole job on one machine: queue, teacher, "
                                "rollout worker, learner, then the evaluation.")
    p.add_argument("--config", required=True, help="run config YAML (configs/<preset>.yaml)")
    p.add_argument("--validate-only", action="store_true", help="validate the config and the specs it names, then exit")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation at the end")
    p.add_argument("--overwrite", action="store_true", help="delete an existing trained run in run_dir first")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in run_dir from its last committed checkpoint (or evaluate what is left); "
                   "only safe config changes are accepted (train.iterations to extend it, eval.*, logging.*, ...); "
                   "starts a new run when run_dir holds none")
    p.add_argument("--learner-timeout", type=float, default=None, help="fail if training takes longer (seconds)")
    p.add_argument("overrides", nargs="*", help="key=value overrides with dotted paths (e.g. train.iterations=4)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # key=value overrides before or after the flags
    try:
        cfg = load_config(args.config, args.overrides)
        note = loss_defaults_note(args.config, args.overrides, cfg)
        if note:
            say(note)
        if args.validate_only:
            problems = validate(cfg, local=False)
            if problems:
                raise ConfigError("invalid for eopd run:\n" + "\n".join(f"  {p}" for p in problems))
            checked = check_data(cfg)  # ConfigError as eopd run gives it: a record lacks a template's field
            print(f"eopd run: {args.config} is valid ({cfg.total_iterations(1) if cfg.train.iterations else 'epochs'} "
                  f"iterations; teacher {cfg.teacher.model}, student {cfg.student.model}, loss {cfg.loss.variant}; "
                  f"{checked})")
            return 0
        return run(cfg, overwrite=args.overwrite, resume=args.resume, evaluate=not args.no_eval,
                   learner_timeout=args.learner_timeout)
    except ConfigError as exc:
        print(f"eopd run: {exc}", file=sys.stderr)
        return EXIT_CONFIG
