"""Launching real eopd processes in tests: free ports, readiness polling, loud failures, teardown.

Used by every test tier that needs a real server (importable as `tests.procs`)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    """A running subprocess with its log file."""

    popen: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                return self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                return self.popen.wait(10)
        return self.popen.returncode


def spawn(args: list[str], *, env: dict[str, str] | None = None, name: str = "proc") -> Proc:
    """Starts `python -m ...`-style args with output to a temp log file."""
    fd, path = tempfile.mkstemp(prefix=f"eopd-{name}-", suffix=".log")
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    popen = subprocess.Popen(args, stdout=fd, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT, start_new_session=True)
    os.close(fd)
    return Proc(popen, Path(path))


@dataclass
class TeacherProc(Proc):
    grpc_port: int = 0
    http_port: int = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


def start_teacher(model: str = "tiny-random", *extra: str, grpc_port: int | None = None, http_port: int | None = None,
                  env: dict[str, str] | None = None, wait: bool = True, timeout: float = 180.0) -> TeacherProc:
    """Starts `eopd-teacher serve` as a subprocess on free ports and waits until it is ready."""
    gp, hp = grpc_port or free_port(), http_port or free_port()
    args = [sys.executable, "-m", "eopd_teacher.cli", "serve", "--model", model, "--host", "127.0.0.1",
            "--grpc-port", str(gp), "--http-port", str(hp), *extra]
    base = spawn(args, env=env, name="teacher")
    proc = TeacherProc(base.popen, base.log_path, gp, hp)
    if wait:
        wait_teacher_ready(proc, timeout)
    return proc


def wait_teacher_ready(proc: TeacherProc, timeout: float = 180.0) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"teacher exited with {proc.popen.returncode}:\n{proc.log()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{proc.http}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.2)
    proc.stop()
    raise TimeoutError(f"teacher not ready after {timeout}s:\n{proc.log()[-4000:]}")


@contextlib.contextmanager
def running_teacher(model: str = "tiny-random", *extra: str, **kwargs) -> Iterator[TeacherProc]:
    proc = start_teacher(model, *extra, **kwargs)
    try:
        yield proc
    finally:
        proc.stop()
