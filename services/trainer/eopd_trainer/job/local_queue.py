"""The queue `eopd run` uses on one machine, by `queue.backend`: the Redis at `$REDIS_URL`, a
`redis-server` it starts, or the embedded in-memory queue (`embedded_queue.py`).

The `redis-server` it starts keeps its data in `<run_dir>/redis` with an append-only file
(`appendfsync everysec`, the policy the deployments use; no RDB snapshots), so a `--resume` starts
it again on the same directory and finds the run's streams, consumer groups, pending lists and task
counter as they were. The embedded queue keeps nothing: a `--resume` rebuilds what the learner
needs from its checkpoint (`learner/rebuild.py`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis

from eopd_common.private_files import write_private

from ..config import QueueConfig
from ..queue.signing import write_key_file
from . import listener
from .embedded_queue import EmbeddedQueue
from .supervisor import Child, RunError, Supervisor, free_port

PING_WAIT_S = 120
REDIS_PORT_TRIES = 5  # a port taken between free_port() and redis-server's bind: try another


def redis_ping(url: str, timeout: float = 1.0, *, password: str | None = None) -> bool:
    try:
        kwargs = {"password": password} if password else {}
        return bool(redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout, **kwargs).ping())
    except Exception:  # noqa: BLE001 - unreachable, refused, auth...: not usable
        return False


def shown_url(url: str) -> str:
    """A Redis URL for messages: a password in it is replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


EMBEDDED_NOTE = ("in memory in this eopd run process: not persistent, lost if this process dies (a --resume "
                 "rebuilds it from the learner's checkpoint); local processes only")


@dataclass(frozen=True)
class QueueChoice:
    url: str
    backend: str  # "redis" (an existing Redis), "redis-server" (started here) or "embedded"
    message: str  # the sentence `eopd run` prints and records in run_summary.json
    password: str | None = field(default=None, repr=False)  # of a queue started here (children: REDIS_PASSWORD)

    @property
    def auth_url(self) -> str:
        """`url` with the password in it, for this process' own connections (never written anywhere)."""
        if not self.password:
            return self.url
        parts = urlsplit(self.url)
        return urlunsplit(parts._replace(netloc=f":{self.password}@{parts.netloc}"))


def redis_pid(url: str, timeout: float = 1.0, *, password: str | None = None) -> int | None:
    """The process id of the Redis answering at `url` (INFO server), None if none answers."""
    try:
        kwargs = {"password": password} if password else {}
        info = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout, **kwargs).info("server")
    except Exception:  # noqa: BLE001 - unreachable, refused, auth...: not ours
        return None
    return int(info["process_id"]) if "process_id" in info else None


def new_password() -> str:
    """A fresh random Redis password (one per redis-server start, one per port tried)."""
    return secrets.token_hex(32)


def start_redis(sup: Supervisor, binary: str, options: Sequence[str], *, name: str = "redis", port: int | None = None,
                wait_s: float = PING_WAIT_S,
                conf_for: Callable[[str], Path] | None = None) -> tuple[str, Child, list[str], str | None]:
    """`redis-server --port P --bind 127.0.0.1 *options` under `sup`, on a free port tried up to
    REDIS_PORT_TRIES times (once on an explicit `port`): a try fails when the port was taken meanwhile
    (redis-server exits, having bound nothing and touched no data). Nothing is sent to the port until
    the socket listening there is proven to be the child's own (`listener.listening_owner_is`: the
    LISTEN socket's inode among the child's open files): a stranger who took the port first is never
    sent a command, let alone the password. `conf_for(password)`: writes the config file read first
    (it carries the password, never put on the command line where every local user can read it) and
    returns its path; each try gets a fresh password, so one given up reveals nothing reusable.
    Returns (url, child, notes on the ports given up, the password or None without `conf_for`)."""
    notes: list[str] = []
    for _ in range(1 if port else REDIS_PORT_TRIES):
        p = port or free_port()
        password = new_password() if conf_for else None
        conf = conf_for(password) if conf_for else None
        log = sup.log_dir / f"{name}.log"
        offset = log.stat().st_size if log.exists() else 0  # this try's lines start there
        child = sup.start(name, [binary, *([str(conf)] if conf else []), "--port", str(p), "--bind", "127.0.0.1",
                                 *options])
        url = f"redis://127.0.0.1:{p}/0"
        taken = _wait_own_redis(child, p, url, wait_s, offset, password)
        if taken is None:
            return url, child, notes, password
        notes.append(f"port {p} {taken}")
        child.stop(10)
        sup.children.remove(child)
    raise RunError(f"redis-server did not start on a free port ({'; '.join(notes)}); log {sup.log_dir / f'{name}.log'}")


def _start_redis_server(sup: Supervisor, run_dir: Path, binary: str) -> tuple[str, Child, list[str], str | None]:
    data_dir = run_dir / "redis"
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    data_dir.chmod(0o700)  # the append-only file holds the run's rollouts (an older run's dir may be 0755)

    # A new random password each start, in a 0600 config file: a local process that finds the port
    # cannot read, write or reconfigure the queue (NOAUTH).
    def conf_for(password: str) -> Path:
        return write_private(data_dir / "auth.conf", f"requirepass {password}\n")

    # The AOF policy of the deployments (docker-compose.yml, deploy/k8s): each write reaches the file
    # before the reply (unless a slow fsync holds it, up to 2 s), fsync once a second; no RDB snapshots.
    return start_redis(sup, binary, ["--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--dir",
                                     str(data_dir)], conf_for=conf_for)


def _owns_port(child: Child, port: int) -> bool:
    """Whether `child` is the process listening on 127.0.0.1:`port`. Without Linux' /proc (nothing
    else runs eopd run's children with PR_SET_PDEATHSIG either) the weaker proof: it is alive and
    something accepts connections there."""
    if listener.supported():
        return listener.listening_owner_is(child.popen.pid, port)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return child.alive()
    except OSError:
        return False


def _wait_own_redis(child: Child, port: int, url: str, wait_s: float, offset: int,
                    password: str | None = None) -> str | None:
    """None once our redis-server answers at `url`; else why the port is not usable (taken: its log
    from `offset` on says so). The password is sent only once the child owns the listening socket."""
    deadline = time.monotonic() + wait_s  # a resumed run's redis-server first loads its append-only file
    while True:
        if _owns_port(child, port):
            pid = redis_pid(url, password=password)
            if pid == child.popen.pid:
                return None
            if pid is not None:  # cannot be: the listening socket is the child's
                return f"answered by another Redis (pid {pid})"
        elif not child.alive():
            with child.log_path.open("rb") as fh:
                fh.seek(offset)
                if b"Address already in use" in fh.read():
                    return "was taken"
            raise child.failure("failed to start")
        if time.monotonic() > deadline:
            raise child.failure(f"did not answer PING within {wait_s:.0f} s")
        time.sleep(0.05)


KEY_NAME = "queue.key"


def run_key_file(run_dir: Path, qcfg: QueueConfig) -> str:
    """The message key file of the run (queue/signing.py): queue.auth_key_file when set, else
    `<run_dir>/queue.key`, created 0600 with a random key the first time and kept by a resume (the
    entries still in a recovered queue were signed with it)."""
    if qcfg.auth_key_file:
        return qcfg.auth_key_file
    return str(write_key_file(run_dir / KEY_NAME))


def _start_embedded(sup: Supervisor, password: str) -> str:
    try:
        sup.embedded = EmbeddedQueue(password=password).start()
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

    With a queue started here, REDIS_PASSWORD (meant for the Redis at $REDIS_URL) is not passed to
    the children. A redis-server started here gets a new random password (`_start_redis_server`),
    given as REDIS_PASSWORD to the children that hold the run directory (the learner, the workers;
    `Supervisor.child_env`); so does the embedded queue (it enforces AUTH itself, embedded_queue.py).
    Their messages are authenticated besides (queue/signing.py)."""
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
        url, child, notes, password = _start_redis_server(sup, run_dir, binary)
        sup.child_env = {**sup.child_env, "REDIS_PASSWORD": password}  # the learner, workers (not the teacher)
        retried = f" ({'; '.join(notes)})" if notes else ""
        return QueueChoice(url, "redis-server",
                           f"queue: {why}; started redis-server on {url.split('/')[2]}{retried} with a random password "
                           f"(append-only file in {run_dir / 'redis'}, log {child.log_path})", password=password)
    if backend == "redis-server":
        raise RunError("no queue: queue.backend=redis-server and redis-server is not on PATH (apt-get install "
                       "redis-server, or queue.backend=auto|embedded)")
    if backend == "auto":
        why += "; redis-server is not installed"
    password = new_password()
    sup.child_env = {**sup.child_env, "REDIS_PASSWORD": password}  # the learner, workers (not the teacher)
    url = _start_embedded(sup, password)
    return QueueChoice(url, "embedded", f"queue: {why}; using the embedded queue (fakeredis) on "
                       f"{url.split('/')[2]} with a random password, {EMBEDDED_NOTE}", password=password)
