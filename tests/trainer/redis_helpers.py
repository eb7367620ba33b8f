"""A private redis-server per test module: started on a free port in a temp dir, torn down after;
or the embedded queue of `eopd run` on a free port."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.procs import free_port


@dataclass
class RedisProc:
    popen: subprocess.Popen
    port: int
    dir: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def start_redis(port: int | None = None, *extra: str, timeout: float = 20.0) -> RedisProc:
    """Starts `redis-server` on 127.0.0.1:<free port> (no persistence unless `extra` asks)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    port = port or free_port()
    workdir = Path(tempfile.mkdtemp(prefix="eopd-redis-"))
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(workdir), *extra]
    popen = subprocess.Popen(args, stdout=open(workdir / "redis.log", "wb"), stderr=subprocess.STDOUT,
                             start_new_session=True)
    proc = RedisProc(popen, port, workdir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"redis-server exited: {(workdir / 'redis.log').read_text(errors='replace')}")
        with contextlib.suppress(Exception):
            if proc.client().ping():
                return proc
        time.sleep(0.05)
    proc.stop()
    raise TimeoutError("redis-server did not start")


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
    """The embedded queue of `eopd run` (a Redis-protocol server in a thread of this process);
    it has a `url` like RedisProc."""
    from eopd_trainer.job.embedded_queue import EmbeddedQueue

    with EmbeddedQueue() as server:
        yield server
