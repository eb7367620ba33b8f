"""A private redis-server per test module: started on a free port in a temp dir, torn down after;
or the embedded queue of `eopd run` on a free port."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eopd_trainer.job.local_queue import start_redis as start_redis_server
from eopd_trainer.job.supervisor import Child, RunError, Supervisor


@dataclass
class RedisProc:
    child: Child
    port: int
    dir: Path

    @property
    def popen(self) -> subprocess.Popen:
        return self.child.popen

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)

    def stop(self) -> None:
        self.child.stop(10)


def start_redis(port: int | None = None, *extra: str, timeout: float = 20.0) -> RedisProc:
    """Starts `redis-server` on 127.0.0.1:<free port> (no persistence unless `extra` asks), as
    `eopd run` does (`eopd_trainer.job.local_queue.start_redis`: a port taken meanwhile is retried,
    a foreign Redis never used)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    workdir = Path(tempfile.mkdtemp(prefix="eopd-redis-"))
    sup = Supervisor(workdir, pdeathsig=False)
    try:
        url, child, _, _ = start_redis_server(sup, binary, ["--save", "", "--appendonly", "no", "--dir", str(workdir),
                                                         *extra], port=port, wait_s=timeout)
    except RunError as exc:
        sup.stop_all()
        raise RuntimeError(f"redis-server did not start: {exc}") from None
    return RedisProc(child, int(url.rsplit(":", 1)[1].split("/")[0]), workdir)


@contextlib.contextmanager
def running_redis(*extra: str) -> Iterator[RedisProc]:
    proc = start_redis(None, *extra)
    try:
        yield proc
    finally:
        proc.stop()
        shutil.rmtree(proc.dir, ignore_errors=True)


@contextlib.contextmanager
def running_embedded_queue() -> Iterator:
    """The embedded queue of `eopd run` (a Redis-protocol server in a thread of this process, with
    a random password); `url` carries the password, like a RedisProc's url works as it is."""
    from eopd_trainer.job.embedded_queue import EmbeddedQueue

    with EmbeddedQueue() as server:
        yield types.SimpleNamespace(url=server.auth_url, server=server)
