"""`eopd run`: the whole job on one machine, from nothing pre-started.

    eopd run --config configs/smollm2-cpu.yaml [key=value ...] [--validate-only] [--no-eval] [--overwrite]

1. validates the config; materialises what it names (a layer-subset student into
   `<run_dir>/student-init`, generated task splits into `<run_dir>/data`) and writes the effective
   config the processes load to `<run_dir>/run.yaml`;
2. picks the queue (`queue.backend`, default auto): the Redis at `$REDIS_URL` if it answers, else a
   `redis-server` started on a free port (if the binary is installed), else the embedded in-memory
   queue (`embedded_queue.py`: a Redis-protocol server in a thread of this process, lost if this
   process dies); it says which one;
3. starts the teacher (`eopd-teacher serve --model teacher.model`, free ports, waits for /readyz),
   one rollout worker and the learner as separate processes, logs in `<run_dir>/logs/`;
4. supervises them: a progress bar from the learner's `train_metrics.jsonl`; Ctrl-C / SIGTERM stop
   every process cleanly (the learner keeps its last committed checkpoint); a process that dies
   makes the run exit 1 with the tail of its log;
5. evaluates (`eopd eval`) the initial and the final student on the held-out prompts into
   `<run_dir>/eval.json` unless `--no-eval` / `eval.enabled=false`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .config import ConfigError, QueueConfig, RunConfig, dump_config, load_config
from .prepare import prepare, validate  # noqa: F401 - part of this module's interface (bench/ uses prepare)

if TYPE_CHECKING:
    from .embedded_queue import EmbeddedQueue

EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130


class RunError(RuntimeError):
    """A process of the run failed; the message names it and carries its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def failure(self, what: str) -> RunError:
        return RunError(f"{self.name} {what} (exit code {self.popen.poll()}); last lines of {self.log_path}:\n"
                        f"{log_tail(self.log_path)}")


@dataclass
class Supervisor:
    """Starts child processes (own sessions, logs in `log_dir`) and stops them in reverse order;
    the embedded queue, when the run uses it, lives in this process and is stopped after them."""

    log_dir: Path
    children: list[Child] = field(default_factory=list)
    embedded: EmbeddedQueue | None = None
    drop_env: tuple[str, ...] = ()  # not passed to children (REDIS_PASSWORD with a queue started here)

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        """Starts a child in its own session. When this process dies without stopping its children
        (SIGKILL, OOM, a crash), the kernel sends each of them SIGTERM (PR_SET_PDEATHSIG, set by
        util-linux's `setpriv` before it execs the child; without setpriv they would outlive it)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"{name}.log"
        full_env = {**{k: v for k, v in os.environ.items() if k not in self.drop_env}, "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        setpriv = shutil.which("setpriv")
        if setpriv:
            args = [setpriv, "--pdeathsig", "TERM", "--", *args]
        with open(path, "ab") as fh:
            popen = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        child = Child(name, popen, path)
        self.children.append(child)
        return child

    def check(self, *, allowed_done: tuple[str, ...] = ()) -> None:
        """Raises RunError if a child has exited, unless it exited 0 and is in `allowed_done`."""
        for c in self.children:
            rc = c.popen.poll()
            if rc is None or (rc == 0 and c.name in allowed_done):
                continue
            raise c.failure("exited unexpectedly" if rc == 0 else "failed")
        if self.embedded is not None and not self.embedded.alive():
            raise RunError("the embedded queue's server thread stopped")

    def stop_all(self, timeout: float = 30.0) -> None:
        """SIGTERM each child in reverse start order, waiting for it before the next: the learner
        and the workers stop while the queue and the teacher they talk to are still up."""
        for c in reversed(self.children):
            if not c.alive():
                continue
            with contextlib.suppress(ProcessLookupError):
                c.popen.send_signal(signal.SIGTERM)
            try:  # the learner stops after the optimizer step in progress: give it longer
                c.popen.wait(timeout * 4 if c.name == "learner" else timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.popen.pid, signal.SIGKILL)
                c.popen.wait(10)
        if self.embedded is not None:  # the queue last: nothing is left to talk to it
            self.embedded.stop()


def redis_ping(url: str, timeout: float = 1.0, *, password: str | None = None) -> bool:
    import redis

    try:
        kwargs = {"password": password} if password else {}
        return bool(redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout, **kwargs).ping())
    except Exception:  # noqa: BLE001 - unreachable, refused, auth...: not usable
        return False


def shown_url(url: str) -> str:
    """A Redis URL for messages: a password in it is replaced by ***."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
EMBEDDED_NOTE = ("in memory in this eopd run process: not persistent, lost if this process dies; local processes only")


@dataclass(frozen=True)
class QueueChoice:
    url: str
    backend: str  # "redis" (an existing Redis), "redis-server" (started here) or "embedded"
    message: str  # the sentence `eopd run` prints and records in run_summary.json


def _start_redis_server(sup: Supervisor, run_dir: Path, binary: str) -> tuple[str, Child]:
    port = free_port()
    data_dir = run_dir / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
    child = sup.start("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                "--dir", str(data_dir)])
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 20
    while not redis_ping(url):
        if not child.alive():
            raise child.failure("failed to start")
        if time.monotonic() > deadline:
            raise child.failure("did not answer PING within 20 s")
        time.sleep(0.05)
    return url, child


def _start_embedded(sup: Supervisor) -> str:
    from .embedded_queue import EmbeddedQueue

    try:
        sup.embedded = EmbeddedQueue().start()
    except (RuntimeError, OSError) as exc:
        raise RunError(f"the embedded queue did not start: {exc}") from None
    return sup.embedded.url


def choose_queue(sup: Supervisor, run_dir: Path, qcfg: QueueConfig | None = None) -> QueueChoice:
    """The queue of the run, by `queue.backend`:

    auto          the Redis at $REDIS_URL if it answers PING, else a redis-server started here if the
                  binary is on PATH, else the embedded queue;
    redis         $REDIS_URL (or queue.redis_url when it is unset), which must answer;
    redis-server  a redis-server started here (error if not installed);
    embedded      the embedded in-memory queue (embedded_queue.py).

    A queue started here has no password: REDIS_PASSWORD (meant for the Redis at $REDIS_URL) is then
    not passed to the children."""
    qcfg = qcfg or QueueConfig()
    backend = qcfg.backend
    env_url = os.environ.get("REDIS_URL", "")
    password = os.environ.get("REDIS_PASSWORD") or None
    if backend == "redis":
        url = env_url or qcfg.redis_url
        source = "REDIS_URL" if env_url else "queue.redis_url"
        if not redis_ping(url, password=password):
            raise RunError(f"no queue: queue.backend=redis and the Redis at {source} ({shown_url(url)}) does not "
                           "answer PING")
        return QueueChoice(url, "redis", f"queue: the Redis at {source} ({shown_url(url)}) (queue.backend=redis)")
    if backend == "auto" and env_url and redis_ping(env_url, password=password):
        return QueueChoice(env_url, "redis", f"queue: the Redis at REDIS_URL ({shown_url(env_url)})")
    sup.drop_env = ("REDIS_PASSWORD",)
    if backend == "auto":
        why = f"REDIS_URL={shown_url(env_url)} does not answer" if env_url else "REDIS_URL is not set"
    else:
        why = f"queue.backend={backend}"
    binary = shutil.which("redis-server")
    if backend in ("auto", "redis-server") and binary is not None:
        url, child = _start_redis_server(sup, run_dir, binary)
        return QueueChoice(url, "redis-server",
                           f"queue: {why}; started redis-server on {url.split('/')[2]} (log {child.log_path})")
    if backend == "redis-server":
        raise RunError("no queue: queue.backend=redis-server and redis-server is not on PATH (apt-get install "
                       "redis-server, or queue.backend=auto|embedded)")
    if backend == "auto":
        why += "; redis-server is not installed"
    url = _start_embedded(sup)
    return QueueChoice(url, "embedded", f"queue: {why}; using the embedded queue (fakeredis) on "
                       f"{url.split('/')[2]}, {EMBEDDED_NOTE}")


def wait_http_ready(child: Child, url: str, timeout: float, poll_s: float = 0.2) -> None:
    """Waits until `url` answers 200 while `child` is alive; raises the child's failure otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not child.alive():
            raise child.failure("failed to start")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(poll_s)
    raise child.failure(f"was not ready after {timeout:.0f} s")


def wait_teacher(child: Child, http_port: int, timeout: float) -> None:
    wait_http_ready(child, f"http://127.0.0.1:{http_port}/readyz", timeout)


# Preparing the run directory: prepare.py (also `eopd prepare`) ------------------------------------

# The run ---------------------------------------------------------------------------------------

class _Progress:
    """Follows `<run_dir>/train_metrics.jsonl` into a tqdm bar."""

    def __init__(self, path: Path, total: int):
        from tqdm import tqdm

        self.path, self.offset, self.done = path, 0, 0
        self.last: dict = {}
        self.bar = tqdm(total=total, desc="eopd run", unit="it", dynamic_ncols=True, file=sys.stderr)

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open() as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            rec = json.loads(line)
            if rec.get("kind") != "iteration":
                continue
            self.last = rec
            self.bar.set_postfix(loss=f"{rec.get('iter/loss', 0):.4f}", gate=f"{rec.get('iter/gate_ratio', 0):.2f}",
                                 fkl=f"{rec.get('iter/fkl_gated_mean', 0):.3f}")
            self.bar.update(int(rec["iteration"]) - self.done)
            self.done = int(rec["iteration"])

    def close(self) -> None:
        self.poll()
        self.bar.close()


def say(msg: str) -> None:
    print(f"eopd run: {msg}", file=sys.stderr, flush=True)


def run(cfg: RunConfig, *, overwrite: bool = False, evaluate: bool = True, teacher_timeout: float = 600.0,
        learner_timeout: float | None = None) -> int:
    problems = validate(cfg)
    if problems:
        raise ConfigError("cannot run:\n" + "\n".join(f"  {p}" for p in problems))
    t_start = time.monotonic()
    cfg, facts = prepare(cfg, overwrite=overwrite)
    run_dir = Path(cfg.run_dir)
    sup = Supervisor(run_dir / "logs")
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    summary: dict = {"config": str(run_dir / "run.yaml"), **facts}
    progress = None
    try:
        cpu0 = time.process_time()
        queue = choose_queue(sup, run_dir, cfg.queue)
        redis_url = queue.url
        say(queue.message)
        summary["queue"], summary["queue_backend"] = queue.message, queue.backend
        gp, hp = free_port(), free_port()
        ns = f"{cfg.queue.namespace}:run:{run_dir.name}:{time.time_ns()}"
        cfg = cfg.model_copy(update={
            "teacher": cfg.teacher.model_copy(update={"target": f"127.0.0.1:{gp}"}),
            "queue": cfg.queue.model_copy(update={"redis_url": redis_url, "namespace": ns, "backend": queue.backend}),
            "logging": cfg.logging.model_copy(update={"progress": False}),
        })
        config_path = run_dir / "run.yaml"
        config_path.write_text(dump_config(cfg))
        load_config(config_path)  # what the children will load must validate
        py = sys.executable
        teacher = sup.start("teacher", [py, "-m", "eopd_teacher.cli", "serve", "--model", cfg.teacher.model, "--host",
                                        "127.0.0.1", "--grpc-port", str(gp), "--http-port", str(hp)])
        say(f"teacher {cfg.teacher.model} starting on 127.0.0.1:{gp} (log {teacher.log_path})")
        deadline = time.monotonic() + teacher_timeout
        while True:  # interruptible wait for readiness
            if stop["signal"] is not None:
                raise KeyboardInterrupt
            try:
                wait_teacher(teacher, hp, timeout=min(2.0, max(0.1, deadline - time.monotonic())))
                break
            except RunError:
                if not teacher.alive():
                    raise teacher.failure("failed to start") from None
                if time.monotonic() > deadline:
                    raise
        say(f"teacher ready; run directory {run_dir}")
        env: dict[str, str] = {}  # torch's default threads: in sync mode the processes mostly take turns
        sup.start("rollout-w0", [py, "-m", "eopd_trainer.rollout", "--config", str(config_path), "--worker-id", "w0"], env)
        learner = sup.start("learner", [py, "-m", "eopd_trainer.learner", "--config", str(config_path)], env)
        from .data import load_prompts

        total = cfg.total_iterations(len(load_prompts(cfg.data.train_files, cfg.data.field)))
        progress = _Progress(run_dir / "train_metrics.jsonl", total)
        t_learn = time.monotonic()
        while learner.alive():
            if stop["signal"] is not None:
                raise KeyboardInterrupt
            sup.check(allowed_done=("rollout-w0",))  # a worker exits 0 only once the learner set <ns>:done
            progress.poll()
            if learner_timeout and time.monotonic() - t_learn > learner_timeout:
                raise learner.failure(f"did not finish within {learner_timeout:.0f} s")
            time.sleep(0.5)
        progress.close()
        progress = None
        if learner.popen.returncode != 0:
            raise learner.failure("failed")
        summary["train_s"] = time.monotonic() - t_learn
        # CPU of this process so far: the progress bar and, with the embedded queue, the queue server
        summary["supervisor_cpu_s"] = round(time.process_time() - cpu0, 2)
        worker_deadline = time.monotonic() + 60
        while any(c.alive() for c in sup.children if c.name.startswith("rollout")) and time.monotonic() < worker_deadline:
            sup.check(allowed_done=("learner", "rollout-w0"))
            time.sleep(0.2)
        sup.check(allowed_done=("learner", "rollout-w0"))
    except KeyboardInterrupt:
        say(f"interrupted ({signal.Signals(stop['signal'] or signal.SIGINT).name}): stopping every process "
            "(the learner keeps its last committed checkpoint)")
        if progress is not None:
            progress.bar.close()
        sup.stop_all()
        return EXIT_INTERRUPTED
    except RunError as exc:
        if progress is not None:
            progress.bar.close()
        say(str(exc))
        sup.stop_all()
        return EXIT_FAILED
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    sup.stop_all()
    say(f"training done in {summary['train_s']:.0f} s")
    if evaluate and cfg.eval.enabled and cfg.data.eval_files:
        from .evaluation import evaluate_run

        t0 = time.monotonic()
        result = evaluate_run(run_dir, cfg.eval.models)
        summary["eval_s"] = time.monotonic() - t0
        from .evaluation import summary_line

        for name, r in result["models"].items():  # headline avg@n / pass@n, the other grading's avg@n, KL
            say(f"eval {summary_line(name, r)}")
    summary["total_s"] = time.monotonic() - t_start
    (run_dir / "run_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    say(f"finished in {summary['total_s']:.0f} s; see {run_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eopd run", description="Run the whole job on one machine: queue, teacher, "
                                "rollout worker, learner, then the evaluation.")
    p.add_argument("--config", required=True, help="run config YAML (configs/<preset>.yaml)")
    p.add_argument("--validate-only", action="store_true", help="validate the config and the specs it names, then exit")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation at the end")
    p.add_argument("--overwrite", action="store_true", help="delete an existing trained run in run_dir first")
    p.add_argument("--learner-timeout", type=float, default=None, help="fail if training takes longer (seconds)")
    p.add_argument("overrides", nargs="*", help="key=value overrides with dotted paths (e.g. train.iterations=4)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)  # key=value overrides before or after the flags
    try:
        cfg = load_config(args.config, args.overrides)
        if args.validate_only:
            problems = validate(cfg, local=False)
            if problems:
                raise ConfigError("invalid for eopd run:\n" + "\n".join(f"  {p}" for p in problems))
            print(f"eopd run: {args.config} is valid ({cfg.total_iterations(1) if cfg.train.iterations else 'epochs'} "
                  f"iterations; teacher {cfg.teacher.model}, student {cfg.student.model}, loss {cfg.loss.variant})")
            return 0
        return run(cfg, overwrite=args.overwrite, evaluate=not args.no_eval, learner_timeout=args.learner_timeout)
    except ConfigError as exc:
        print(f"eopd run: {exc}", file=sys.stderr)
        return EXIT_CONFIG
