"""Launching real eopd processes in tests: free ports, readiness polling, loud failures, teardown.

Used by every test tier that needs a real server (importable as `tests.procs`). Thin wrappers over
`eopd_trainer.job.supervisor` (spawn, Child) and `eopd_trainer.job.teacher_proc` (the teacher on
port 0, reporting its ports): one copy of the process logic, shared with `eopd run`."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eopd_trainer.job import supervisor, teacher_proc
from eopd_trainer.job.supervisor import Child, free_port

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "Proc", "TeacherProc", "free_port", "restart_port", "running_teacher", "spawn", "start_teacher",
           "wait_teacher_ready"]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def restart_port() -> int:
    """A free port below the ephemeral range, for a server a test kills and starts again on the same
    port: an ephemeral one (`free_port`) can be taken meanwhile as the local port of an outgoing
    connection (a client reconnecting to the dead server), and the restart then fails with
    EADDRINUSE (seen in CI)."""
    low = _ephemeral_range()[0]
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()

Proc = Child

#: The environment of a teacher that compiles its statistics, as it does by default outside the tests
#: (tests/conftest.py turns the compilation off for the others).
COMPILED = {"EOPD_TEACHER_COMPILE_STATISTICS": "true"}


def spawn(args: list[str], *, env: dict[str, str] | None = None, name: str = "proc") -> Proc:
    """Starts `python -m ...`-style args in ROOT with output to a temp log file."""
    fd, path = tempfile.mkstemp(prefix=f"eopd-{name}-", suffix=".log")
    os.close(fd)
    return supervisor.spawn(name, args, Path(path), env=env, cwd=ROOT, pdeathsig=False)


@dataclass
class TeacherProc(teacher_proc.TeacherChild):
    """A teacher started by a test; `http` is its HTTP side's base URL."""

    @property
    def http(self) -> str:
        return self.http_url


# What names a teacher's client authentication, as a flag or an environment variable.
AUTH_FLAGS = ("--auth-token", "--auth-token-file", "--tls-client-ca-file", "--insecure-no-auth", "--no-insecure-no-auth")
AUTH_ENV = ("EOPD_TEACHER_AUTH_TOKEN", "EOPD_TEACHER_AUTH_TOKEN_FILE", "EOPD_TEACHER_TLS_CLIENT_CA_FILE",
            "EOPD_TEACHER_INSECURE_NO_AUTH")


def names_auth(extra: tuple[str, ...], env: dict[str, str] | None) -> bool:
    """Whether a teacher's flags or environment say how callers authenticate (or that they need not)."""
    return any(a.split("=", 1)[0] in AUTH_FLAGS for a in extra) or any(k in AUTH_ENV for k in env or {})


def start_teacher(model: str = "tiny-random", *extra: str, grpc_port: int | None = None, http_port: int | None = None,
                  env: dict[str, str] | None = None, wait: bool = True, timeout: float = 180.0,
                  command: tuple[str, ...] = teacher_proc.TEACHER_COMMAND, name: str = "teacher") -> TeacherProc:
    """Starts `eopd-teacher serve` as a subprocess (port 0 and its ports file unless ports are
    given; log in a temp dir); returns once its ports are known and, with `wait`, once it is ready.
    A teacher whose `extra` and `env` name no authentication is started with `--insecure-no-auth`
    (tests on loopback that call it without a token); one that names a token requires it."""
    sup = supervisor.Supervisor(Path(tempfile.mkdtemp(prefix=f"eopd-{name}-")), cwd=ROOT, pdeathsig=False)
    proc = teacher_proc.start_teacher(sup, model, *extra, name=name, grpc_port=grpc_port or 0,
                                      http_port=http_port or 0, env=env, command=command, kind=TeacherProc,
                                      insecure_no_auth=not names_auth(extra, env))
    try:  # its ports are known on return, as they were when tests picked them (bound before the model loads)
        proc.ports(timeout)
    except BaseException:
        proc.stop()
        raise
    if wait:
        wait_teacher_ready(proc, timeout)
    return proc


def wait_teacher_ready(proc: TeacherProc, timeout: float = 180.0) -> None:
    """Its /readyz answers; a RunError (a RuntimeError) naming the problem otherwise, the teacher stopped."""
    try:
        proc.wait_ready(timeout)
    except BaseException:
        proc.stop()
        raise


@contextlib.contextmanager
def running_teacher(model: str = "tiny-random", *extra: str, **kwargs) -> Iterator[TeacherProc]:
    proc = start_teacher(model, *extra, **kwargs)
    try:
        yield proc
    finally:
        proc.stop()
