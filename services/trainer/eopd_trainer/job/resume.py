"""`eopd run --resume`: whether a run directory may be continued, from where, with which config.

    eopd run --config FILE [key=value ...] --resume

A run directory holds one run across invocations of `eopd run`. Each invocation writes
`run.requested.yaml` (the config as given: file, `EOPD_RUN_*` variables and overrides, validated,
before `eopd run` materialised anything) and `run.yaml` (what the processes load, with the queue's
namespace). A later invocation on the same `run_dir`:

- neither `--resume` nor `--overwrite`: refused when a checkpoint is committed (the message names
  both options). A directory whose earlier attempt committed nothing is started again from
  scratch: what that attempt left (queue data, metrics, weights, a partial checkpoint) is removed;
- `--overwrite`: the directory is emptied first;
- `--resume`: continues from the committed checkpoint (or, with none committed yet, from the start
  with the earlier attempt's queue) under the namespace recorded in `run.yaml`, provided the config
  differs from `run.requested.yaml` only in `SAFE_TO_CHANGE`; any other difference is refused with
  the differing keys named. With no `run.yaml` there is nothing to resume and a new run starts, so
  `--resume` can always be passed ("run or continue").

`RunLock` keeps two invocations (and the processes of a killed one) off the same directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from eopd_common.atomic_files import write_atomic

from ..config import ConfigError, RunConfig, config_from_dict
from ..learner.committed import read_state
from ..learner.state import LearnerState
from ..queue.namespace import RunQueue
from .prepare import CONFIG_NAME

REQUESTED_NAME = "run.requested.yaml"
LOCK_NAME = ".run.lock"
LOCK_WAIT_S = 120.0  # a killed eopd run's children get SIGTERM; the learner may need its Redis retries (~30 s)

# Keys a resume may change: they decide how long the run is, how it is observed, evaluated or
# transported, never what an iteration trains on or how. A key matches itself and everything under it.
SAFE_TO_CHANGE: tuple[str, ...] = (
    "train.iterations", "train.epochs",  # extend the run (never below the committed iteration)
    "eval", "logging", "faults",
    "checkpoint.every", "checkpoint.keep", "checkpoint.keep_weights",
    "queue.backend", "queue.redis_url",  # another queue is rebuilt from the checkpoint
    "queue.block_ms", "queue.max_backlog", "queue.dead_letter_maxlen", "queue.max_rejected_in_a_row",
    "queue.lease_ttl_s", "queue.lease_wait_s",
    "teacher.target", "teacher.timeout_s", "teacher.retry_timeout_s", "teacher.ready_timeout_s",
    "teacher.max_in_flight", "teacher.streams",
    "rollout.claim_idle_ms", "rollout.stop_grace_s", "rollout.weights_poll_s", "rollout.max_task_deliveries",
)
# What eopd run itself fills into run.yaml (compared only when run.requested.yaml is missing).
FILLED_IN = ("teacher.target", "teacher.auth_token_file", "queue.redis_url", "queue.namespace", "queue.backend", "queue.auth_key_file",
             "logging.progress", "student.model", "data.train_files", "data.eval_files")
# What an attempt that committed nothing leaves behind, removed before a new run starts there.
ATTEMPT_OUTPUTS = ("redis", "checkpoints", "weights", "tb", "train_metrics.jsonl", "run_summary.json", "eval.json")


def is_safe(key: str) -> bool:
    return any(key == s or key.startswith(s + ".") for s in SAFE_TO_CHANGE)


def normalised(cfg: RunConfig) -> dict[str, Any]:
    """The config as plain data with absolute paths (what two invocations compare)."""
    data = cfg.model_dump(mode="json")
    data["run_dir"] = str(Path(data["run_dir"]).resolve())
    for key in ("train_files", "eval_files"):
        data["data"][key] = [str(Path(p).resolve()) for p in data["data"][key]]
    return data


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists are leaves."""
    if not isinstance(data, dict) or not data:
        return {prefix: data} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in data.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every leaf that differs; `None` stands for absent."""
    a, b = flatten(old), flatten(new)
    return [(k, a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]


def _read_config(path: Path) -> RunConfig:
    """A config file of the run directory as written (no EOPD_RUN_* variables, no overrides)."""
    try:
        return config_from_dict(yaml.safe_load(path.read_text()) or {})
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def check_config(run_dir: Path, cfg: RunConfig, previous: RunConfig) -> list[str]:
    """The safe keys in which `cfg` differs from the run's; raises ConfigError naming the others."""
    requested = run_dir / REQUESTED_NAME
    ignore: tuple[str, ...] = ()
    if requested.is_file():
        old = normalised(_read_config(requested))
    else:  # a run directory from before run.requested.yaml: run.yaml, less what eopd run filled in
        old, ignore = normalised(previous), FILLED_IN
    diffs = [d for d in differences(old, normalised(cfg)) if d[0] not in ignore]
    unsafe = [d for d in diffs if not is_safe(d[0])]
    if unsafe:
        lines = "\n".join(f"  {k}: {a!r} -> {b!r}" for k, a, b in unsafe)
        raise ConfigError(
            f"cannot resume {run_dir}: the config differs from the run's ({requested.name}) in "
            f"{', '.join(k for k, _, _ in unsafe)}:\n{lines}\n"
            f"Only these may change on --resume: {', '.join(k if '.' in k or k == 'faults' else k + '.*' for k in SAFE_TO_CHANGE)}. "
            "Keep the run's values, or start a new "
            "run (--overwrite, or another run_dir=).")
    return [f"{k}: {a!r} -> {b!r}" for k, a, b in diffs]


@dataclass(frozen=True)
class Start:
    """Where an invocation starts: a new run, or the committed state of the run in run_dir."""

    resumed: bool
    iteration: int = 0  # the committed iteration (0: none)
    policy_version: int = 0
    optimizer_steps: int = 0
    tasks_published: int | None = None  # tasks the committed checkpoint had published (None: unknown)
    namespace: str | None = None  # the queue namespace of run.yaml
    previous: RunConfig | None = None  # run.yaml of the previous invocation
    changed: tuple[str, ...] = ()  # safe keys that differ, "key: old -> new"
    note: str = ""


def plan_start(cfg: RunConfig, *, resume: bool, overwrite: bool) -> Start:
    """Decides how an invocation starts; raises ConfigError when it must not (see the module)."""
    run_dir = Path(cfg.run_dir).resolve()
    if resume and overwrite:
        raise ConfigError("--resume continues the run in run_dir and --overwrite deletes it: pass one of them")
    state = read_state(run_dir / "checkpoints")
    if overwrite:
        return Start(False)
    if not resume:
        if state is not None:
            raise ConfigError(
                f"{run_dir} already holds a trained run (iteration {state.iteration} committed): pass --resume "
                "to continue it, --overwrite to delete it and start again, or another run_dir=")
        return Start(False)
    if not (run_dir / CONFIG_NAME).is_file():
        return Start(False, note=f"nothing to resume in {run_dir} (no {CONFIG_NAME}): starting a new run")
    previous = _read_config(run_dir / CONFIG_NAME)
    changed = check_config(run_dir, cfg, previous)
    state = state or LearnerState()
    return Start(True, iteration=state.iteration, policy_version=state.policy_version,
                 optimizer_steps=state.optimizer_steps, tasks_published=state.feed.tasks_published,
                 namespace=previous.queue.namespace, previous=previous, changed=tuple(changed))


def check_extent(start: Start, total: int) -> None:
    """A resume may lengthen a run, never cut it below what is committed."""
    if start.iteration > total:
        raise ConfigError(f"train.iterations: the run in this run_dir has committed iteration {start.iteration}; it "
                          f"cannot be shortened to {total} iterations (set train.iterations >= {start.iteration})")


def write_requested(run_dir: Path, cfg: RunConfig) -> None:
    write_atomic(run_dir / REQUESTED_NAME, yaml.safe_dump(normalised(cfg), sort_keys=False))


def clear_run_dir(run_dir: Path) -> None:
    """--overwrite: everything in run_dir but the lock this invocation holds."""
    if run_dir.is_dir():
        for p in run_dir.iterdir():
            if p.name != LOCK_NAME:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def clear_attempt(run_dir: Path) -> None:
    """A new run in a directory whose earlier attempt committed nothing: its outputs go (logs stay)."""
    for name in ATTEMPT_OUTPUTS:
        p = run_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


class RunDirBusy(RuntimeError):
    """Another eopd run, or processes a killed one started, still use the run directory."""


class RunLock:
    """An exclusive flock on `<run_dir>/.run.lock`, held by `eopd run` and inherited by the children
    that touch the run's state (queue, rollout worker, learner: `Supervisor.pass_fds`). It is free
    only once the last of them has exited, so a `--resume` right after a SIGKILL of `eopd run` (the
    kernel kills its children, pdeathsig.py: gone within moments) waits for them instead of starting a second
    redis-server on the same append-only file or a second learner. The file names the holders."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self.fd: int | None = None

    def holders(self) -> str:
        try:
            info = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return "unknown processes"
        alive = [f"{name} pid {pid}" for name, pid in info.items() if _pid_alive(pid)]
        return ", ".join(alive) or "processes that are exiting"

    def acquire(self, wait_s: float = LOCK_WAIT_S, note: Callable[[str], None] = print, poll_s: float = 0.2) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline, noted = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise RunDirBusy(f"{self.run_dir} is still in use ({self.holders()}) after {wait_s:.0f} s: another "
                                     "eopd run, or processes a killed one started; stop them first") from None
                if not noted:
                    note(f"waiting up to {wait_s:.0f} s for the processes of a previous eopd run of {self.run_dir} to "
                         f"exit ({self.holders()})")
                    noted = True
                time.sleep(poll_s)
        self.fd = fd
        self.record({"eopd run": os.getpid()})

    def record(self, holders: dict[str, int]) -> None:
        """Names the processes holding the lock (shown to an invocation that waits for it)."""
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, json.dumps(holders).encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


def _pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


def queue_state(url: str, ns: str, start: Start, backend: str) -> tuple[str, str]:
    """What a resumed run's queue holds: ("recovered" | "behind" | "rebuilt", the sentence to print).
    Clears `<ns>:done` (set when an earlier invocation finished training; a worker started while it
    is set would stop at once, e.g. when train.iterations was raised) and `<ns>:lease`: the run
    directory's lock, held here, proves that the learner holding it has exited (eopd run gives its
    learner a lease of days, which must not keep the resumed one out)."""
    queue = RunQueue.connect(url, ns)
    queue.forget_learner()
    raw = queue.task_counter()
    published = start.tasks_published
    if raw is None:
        why = ("the embedded queue lives in the eopd run process and went with the interrupted one"
               if backend == "embedded" else f"it holds nothing under {ns}")
        if start.iteration == 0:
            return "rebuilt", f"queue: {why}; no checkpoint committed yet, so tasks are published from the first"
        return "rebuilt", (f"queue rebuilt: {why}; the learner republishes from its checkpoint (iteration "
                           f"{start.iteration}) the tasks not yet trained, with their ids")
    if published is not None and raw < published:
        return "behind", (f"queue recovered but behind the checkpoint (task counter {raw}, the checkpoint had "
                          f"published {published}: its last writes were lost); the learner republishes the missing tasks")
    held = queue.learner_pending()
    n_tasks, n_rollouts = queue.stream_lengths()
    return "recovered", (f"queue recovered ({backend}): {n_tasks} tasks and {n_rollouts} scored "
                         f"rollouts of this run in it ({held} of them read by the learner, not yet acknowledged)")
