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
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import QueueConfig
from .supervisor import Child, RunError, Supervisor, free_port

PING_WAIT_S = 120


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


EMBEDDED_NOTE = ("in memory in this eopd run process: not persistent, lost if this process dies (a --resume "
                 "rebuilds it from the learner's checkpoint); local processes only")


@dataclass(frozen=True)
class QueueChoice:
    url: str
    backend: str  # "redis" (an existing Redis), "redis-server" (started here) or "embedded"
    message: str  # the sentence `eopd run` prints and records in run_summary.json


def _start_redis_server(sup: Supervisor, run_dir: Path, binary: str) -> tuple[str, Child]:
    port = free_port()
    data_dir = run_dir / "redis"
    data_dir.mkdir(parents=True, exist_ok=True)
    # The AOF policy of the deployments (docker-compose.yml, deploy/k8s): each write reaches the file
    # before the reply (unless a slow fsync holds it, up to 2 s), fsync once a second; no RDB snapshots.
    child = sup.start("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
                                "--appendfsync", "everysec", "--dir", str(data_dir)])
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + PING_WAIT_S  # a resumed run's redis-server first loads its append-only file
    while not redis_ping(url):
        if not child.alive():
            raise child.failure("failed to start")
        if time.monotonic() > deadline:
            raise child.failure(f"did not answer PING within {PING_WAIT_S} s")
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
                           f"queue: {why}; started redis-server on {url.split('/')[2]} (append-only file in "
                           f"{run_dir / 'redis'}, log {child.log_path})")
    if backend == "redis-server":
        raise RunError("no queue: queue.backend=redis-server and redis-server is not on PATH (apt-get install "
                       "redis-server, or queue.backend=auto|embedded)")
    if backend == "auto":
        why += "; redis-server is not installed"
    url = _start_embedded(sup)
    return QueueChoice(url, "embedded", f"queue: {why}; using the embedded queue (fakeredis) on "
                       f"{url.split('/')[2]}, {EMBEDDED_NOTE}")
