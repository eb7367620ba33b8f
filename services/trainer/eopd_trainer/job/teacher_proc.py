"""Starting `eopd-teacher serve` as a child process that binds its own ports and reports them.

The teacher is started with `--grpc-port 0 --http-port 0 --ports-file <log_dir>/<name>.ports.json`:
it binds both servers on ports the OS picks and writes `{"grpc_port", "http_port", "pid"}` there
(atomically) before it loads the model. Nobody picks a port for it that another process could take
in between. Used by `eopd run` (`run.py`), the tests (`tests/procs.py`) and the benchmarks.
"""

from __future__ import annotations

import ssl
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from .supervisor import Child, RunError, Supervisor, read_ports_file, wait_http_ready

TEACHER_COMMAND = (sys.executable, "-m", "eopd_teacher.cli")


@dataclass
class TeacherChild(Child):
    """A teacher child; its ports are known once `ports()` has read its ports file."""

    ports_path: Path | None = None
    grpc_port: int = 0
    http_port: int = 0
    http_scheme: str = "http"  # "https" when the teacher serves TLS (its ports file says so)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.ports()[0]}"

    @property
    def http_url(self) -> str:
        port = self.ports()[1]
        return f"{self.http_scheme}://127.0.0.1:{port}"

    def ports(self, timeout: float = 120.0, on_poll: Callable[[], None] | None = None) -> tuple[int, int]:
        """(gRPC port, HTTP port), waiting up to `timeout` for the ports file while the teacher lives;
        `on_poll` is called while waiting (it may raise: an interrupt, another child failing)."""
        if self.grpc_port and self.http_port:
            return self.grpc_port, self.http_port
        if self.ports_path is None:
            raise RunError(f"{self.name}: no ports file to read its ports from")
        deadline = time.monotonic() + timeout
        while (doc := read_ports_file(self.ports_path)) is None:
            if not self.alive():
                raise self.failure("failed to start")
            if on_poll is not None:
                on_poll()
            if time.monotonic() > deadline:
                raise RunError(f"{self.name} did not report its ports in {self.ports_path} within {timeout:.0f} s; "
                               f"last lines of {self.log_path}:\n{self.log()[-4000:]}")
            time.sleep(0.05)
        if doc.get("pid") != self.popen.pid:
            raise RunError(f"{self.name}: {self.ports_path} was written by pid {doc.get('pid')}, not by the teacher "
                           f"started here (pid {self.popen.pid})")
        self.grpc_port, self.http_port = int(doc["grpc_port"]), int(doc["http_port"])
        self.http_scheme = "https" if doc.get("http_scheme") == "https" else "http"
        return self.grpc_port, self.http_port

    def wait_ready(self, timeout: float, on_poll: Callable[[], None] | None = None) -> None:
        """Waits for its /readyz (the model loaded); a RunError naming the problem in its first line
        otherwise (the teacher died, or another server answers on its HTTP port)."""
        self.ports(timeout, on_poll)
        wait_http_ready(self, f"{self.http_url}/readyz", timeout, expect_key="ready", what="eopd-teacher's HTTP side",
                        on_poll=on_poll, context=self.probe_tls_context())

    def probe_tls_context(self) -> ssl.SSLContext | None:
        """For an HTTPS teacher: a context that does not verify its certificate. Only readiness is
        read, from the process started here (its pid checked in the ports file), on 127.0.0.1."""
        if self.http_scheme != "https":
            return None
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx


T = TypeVar("T", bound=TeacherChild)


def teacher_args(model: str, *extra: str, ports_file: Path, grpc_port: int = 0, http_port: int = 0,
                 command: Sequence[str] = TEACHER_COMMAND, insecure_no_auth: bool = False) -> list[str]:
    """`insecure_no_auth`: serve without a token (`--insecure-no-auth`; tests and benchmarks on loopback)."""
    opt_out = ["--insecure-no-auth"] if insecure_no_auth else []
    return [*command, "serve", "--model", model, "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
            "--http-port", str(http_port), "--ports-file", str(ports_file), *opt_out, *extra]


def start_teacher(sup: Supervisor, model: str, *extra: str, name: str = "teacher", grpc_port: int = 0,
                  http_port: int = 0, env: dict[str, str] | None = None, hold: bool = False,
                  command: Sequence[str] = TEACHER_COMMAND, kind: type[T] = TeacherChild,
                  drop_env: tuple[str, ...] = (), insecure_no_auth: bool = False) -> T:
    """Starts `eopd-teacher serve --model model *extra` under `sup` (log `<log_dir>/<name>.log`) on
    port 0 for both servers unless explicit ports are given (a test restarting a teacher on the same
    port); returns at once: `.ports()` / `.target` wait for the ports file, `.wait_ready()` for /readyz.
    `drop_env`: variables of this process the teacher does not inherit. The teacher requires a token
    (`EOPD_TEACHER_AUTH_TOKEN_FILE` in `env`, `--auth-token-file` in `extra`) unless `insecure_no_auth`."""
    ports_path = sup.log_dir / f"{name}.ports.json"
    ports_path.parent.mkdir(parents=True, exist_ok=True)
    ports_path.unlink(missing_ok=True)
    args = teacher_args(model, *extra, ports_file=ports_path, grpc_port=grpc_port, http_port=http_port,
                        command=command, insecure_no_auth=insecure_no_auth)
    child = sup.start(name, args, env, hold=hold, kind=kind, drop_env=drop_env)
    child.ports_path = ports_path
    if grpc_port and http_port:  # known already: usable before the teacher has written its file
        child.grpc_port, child.http_port = grpc_port, http_port
        child.http_scheme = "https" if "--tls-cert-file" in extra or (env or {}).get("EOPD_TEACHER_TLS_CERT_FILE") else "http"
    return child
