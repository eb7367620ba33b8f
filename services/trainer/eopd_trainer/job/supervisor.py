"""The processes `eopd run` starts: each in its own session with its log in `<run_dir>/logs/`,
killed by the kernel if `eopd run` dies (PR_SET_PDEATHSIG: `pdeathsig.py`), stopped in reverse order.

Processes that touch the run's state (the queue, the rollout worker, the learner) inherit the
run directory's lock (`resume.RunLock`, passed as `pass_fds`): a `--resume` waits until the last
of them has exited, so two invocations never share a run directory or a redis-server's files.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from .pdeathsig import guarded

if TYPE_CHECKING:
    from .embedded_queue import EmbeddedQueue


class RunError(RuntimeError):
    """A process of the run failed; the message names it and carries its log's tail."""


def free_port() -> int:
    """A port nobody listened on a moment ago. Only for "an address nobody listens on" and for
    external programs that cannot bind port 0 themselves: another process can take it before it is
    used (eopd's own teacher binds port 0 and reports its ports, `teacher_proc.py`)."""
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
    holds: bool = False  # inherited the run directory's lock (Supervisor.pass_fds)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def failure(self, what: str) -> RunError:
        return RunError(f"{self.name} {what} (exit code {self.popen.poll()}); last lines of {self.log_path}:\n"
                        f"{log_tail(self.log_path)}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL to its whole session after `timeout`; returns the exit code."""
        if not self.alive():
            return self.popen.returncode
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            return self.popen.wait(10)


C = TypeVar("C", bound=Child)


def spawn(name: str, args: Sequence[str], log_path: Path, *, env: dict[str, str] | None = None,
          cwd: Path | None = None, pass_fds: tuple[int, ...] = (), drop_env: tuple[str, ...] = (),
          pdeathsig: bool = True, kind: type[C] = Child) -> C:
    """Starts `args` in its own session, stdout and stderr appended to `log_path`. With `pdeathsig`,
    the kernel SIGKILLs it when this process dies without stopping it (SIGKILL, OOM, a crash):
    PR_SET_PDEATHSIG, set by `pdeathsig.py` before it execs `args` (so the pid is the child's).
    Call it from the thread that outlives the child (the main thread). It inherits `pass_fds`."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**{k: v for k, v in os.environ.items() if k not in drop_env}, "PYTHONUNBUFFERED": "1", **(env or {})}
    args = guarded(args) if pdeathsig else list(args)
    with open(log_path, "ab") as fh:
        popen = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=full_env, cwd=cwd,
                                 start_new_session=True, pass_fds=pass_fds)
    return kind(name, popen, log_path, holds=bool(pass_fds))


@dataclass
class Supervisor:
    """Starts child processes (own sessions, logs in `log_dir`) and stops them in reverse order;
    the embedded queue, when the run uses it, lives in this process and is stopped after them."""

    log_dir: Path
    children: list[Child] = field(default_factory=list)
    embedded: EmbeddedQueue | None = None
    drop_env: tuple[str, ...] = ()  # not passed to children (an external REDIS_PASSWORD, with a queue started here)
    child_env: dict[str, str] = field(default_factory=dict)  # set in children started with hold=True (REDIS_PASSWORD
    # of a redis-server started here: the queue, the learner, the workers; not the teacher)
    pass_fds: tuple[int, ...] = ()  # inherited by every child started with hold=True (the run directory's lock)
    cwd: Path | None = None  # the children's working directory (None: this process')
    pdeathsig: bool = True  # children get SIGTERM when this process dies (spawn)

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None, *, hold: bool = True,
              kind: type[C] = Child, drop_env: tuple[str, ...] = ()) -> C:
        """Starts a child in its own session (`spawn`), log `<log_dir>/<name>.log`, stopped by the
        kernel if this process dies. With `hold`, the child inherits `pass_fds` (the run
        directory's lock) until it exits, and `child_env`. `drop_env`: more variables this child
        does not inherit (besides `self.drop_env`)."""
        child = spawn(name, args, self.log_dir / f"{name}.log", env={**(self.child_env if hold else {}), **(env or {})}, cwd=self.cwd,
                      pass_fds=self.pass_fds if hold else (), drop_env=(*self.drop_env, *drop_env), pdeathsig=self.pdeathsig,
                      kind=kind)
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
        """SIGTERM each child, the learner first (it finishes its optimizer step and stops without
        starting another), then the others in reverse start order, waiting for each before the next:
        the learner and the workers stop while the queue and the teacher they talk to are still up."""
        order = [c for c in reversed(self.children) if c.name == "learner"]
        for c in order + [c for c in reversed(self.children) if c.name != "learner"]:
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


def wait_http_ready(child: Child, url: str, timeout: float, poll_s: float = 0.2, *, expect_key: str | None = None,
                    what: str = "the expected server", on_poll: Callable[[], None] | None = None,
                    context: ssl.SSLContext | None = None) -> None:
    """Waits until `url` answers 200 (with a JSON object holding `expect_key`, when given) while
    `child` is alive. Raises the child's failure if it dies, else a RunError at the deadline whose
    first line says what answered: nothing, or another server (an answer that is not HTTP/1, e.g. a
    gRPC server's HTTP/2 frames, or a 200 without `expect_key`) that holds the port. `on_poll` is
    called between tries (it may raise: an interrupt, another child failing). `context`: the TLS
    context of an https `url`."""
    deadline = time.monotonic() + timeout
    foreign: str | None = None  # what the last foreign answer was
    while True:
        if not child.alive():
            raise child.failure("failed to start")
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as r:
                if r.status == 200 and (expect_key is None or _has_key(r.read(), expect_key)):
                    return
                foreign = f"{r.status} without a JSON {expect_key!r}"
        except urllib.error.HTTPError as exc:  # 503: ours, not ready yet (loading); the teacher never says 404...
            foreign = None if exc.code == 503 or expect_key is None else f"HTTP {exc.code}"
        except (urllib.error.URLError, ConnectionError, OSError):
            foreign = None  # nobody listens yet
        except http.client.HTTPException as exc:  # not HTTP/1 (BadStatusLine: HTTP/2 frames), cut short...
            foreign = type(exc).__name__
        if time.monotonic() > deadline:
            break
        if on_poll is not None:
            on_poll()
        time.sleep(poll_s)
    if foreign is not None:
        head = f"{url} answers, but not as {what} ({foreign}): another server holds that port"
    else:
        head = f"{url} did not answer as ready"
    raise RunError(f"{child.name} was not ready after {timeout:.0f} s: {head}; last lines of {child.log_path}:\n"
                   f"{log_tail(child.log_path)}")


def _has_key(body: bytes, key: str) -> bool:
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    return isinstance(doc, dict) and key in doc


def read_ports_file(path: Path) -> dict | None:
    """The JSON a teacher started with `--ports-file` wrote once both servers were bound (written
    atomically), or None while there is none."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    return doc if isinstance(doc, dict) else None
