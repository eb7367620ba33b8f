"""The processes `eopd run` starts: each in its own session with its log in `<run_dir>/logs/`,
taken down by the kernel if `eopd run` dies (PR_SET_PDEATHSIG), stopped in reverse order.

Processes that touch the run's state (the queue, the rollout worker, the learner) inherit the
run directory's lock (`resume.RunLock`, passed as `pass_fds`): a `--resume` waits until the last
of them has exited, so two invocations never share a run directory or a redis-server's files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .embedded_queue import EmbeddedQueue


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
    holds: bool = False  # inherited the run directory's lock (Supervisor.pass_fds)

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
    pass_fds: tuple[int, ...] = ()  # inherited by every child started with hold=True (the run directory's lock)

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None, *, hold: bool = True) -> Child:
        """Starts a child in its own session. When this process dies without stopping its children
        (SIGKILL, OOM, a crash), the kernel sends each of them SIGTERM (PR_SET_PDEATHSIG, set by
        util-linux's `setpriv` before it execs the child; without setpriv they would outlive it).
        With `hold`, the child inherits `pass_fds` (the run directory's lock) until it exits."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_dir / f"{name}.log"
        full_env = {**{k: v for k, v in os.environ.items() if k not in self.drop_env}, "PYTHONUNBUFFERED": "1",
                    **(env or {})}
        setpriv = shutil.which("setpriv")
        if setpriv:
            args = [setpriv, "--pdeathsig", "TERM", "--", *args]
        with open(path, "ab") as fh:
            popen = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
                                     pass_fds=self.pass_fds if hold else ())
        child = Child(name, popen, path, holds=hold and bool(self.pass_fds))
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
