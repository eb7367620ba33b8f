"""The learner's lease: one learner per namespace (`<ns>:lease`, SET NX PX, renewed by a
heartbeat thread), with `fenced` transactions that only execute while the lease is held."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

import redis
from redis.exceptions import WatchError

log = logging.getLogger(__name__)


class LeaseHeld(RuntimeError):
    """Another live process holds the lease."""


class LeaseLost(RuntimeError):
    """The lease this process held expired or was taken over: it must not commit anything."""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class Lease:
    """A Redis lease: one holder of `key` at a time (SET NX PX), renewed by a daemon thread every
    `ttl_ms / 3` while it is still this holder's value (WATCH/MULTI, no Lua: the embedded queue
    has none). `fenced(fn)` runs commands in a transaction that only executes while the lease is
    ours, which is how the learner acknowledges entries after a commit.

    The value names the holder (host, PID namespace, pid, a random token, a description). A
    lease whose holder is on this host, in this PID namespace, with a pid that no longer exists
    (a SIGKILLed learner restarted at once) is taken over without waiting for it to expire;
    otherwise `acquire` waits up to `wait_s` for it to expire, then raises LeaseHeld."""

    def __init__(self, client: redis.Redis, key: str, *, ttl_ms: int, description: str = ""):
        self.r = client
        self.key = key
        self.ttl_ms = ttl_ms
        self.info = {"host": socket.gethostname(), "pidns": _pid_namespace(), "pid": os.getpid(),
                     "token": uuid.uuid4().hex, "description": description}
        self.value = json.dumps(self.info, sort_keys=True).encode()
        self.lost = False
        self._stop = None
        self._thread = None

    @staticmethod
    def describe(raw: bytes | None) -> str:
        if raw is None:
            return "nobody"
        try:
            info = json.loads(raw)
            return f"host {info['host']} pid {info['pid']} ({info.get('description') or 'no description'})"
        except (ValueError, KeyError, TypeError):
            return repr(raw[:200])

    def _stale_local_holder(self, raw: bytes) -> bool:
        try:
            info = json.loads(raw)
            return (info["host"] == self.info["host"] and info["pidns"] == self.info["pidns"] and info["pidns"] != ""
                    and not _pid_alive(int(info["pid"])))
        except (ValueError, KeyError, TypeError):
            return False

    def acquire(self, wait_s: float = 0.0, poll_s: float = 0.2) -> None:
        deadline = time.monotonic() + wait_s
        noted = False
        while True:
            if self.r.set(self.key, self.value, nx=True, px=self.ttl_ms):
                break
            raw = self.r.get(self.key)
            if raw is not None and self._stale_local_holder(raw) and self._replace(raw):
                log.info("took over the lease %s of a dead process (%s)", self.key, self.describe(raw))
                break
            if time.monotonic() >= deadline:
                ttl = self.r.pttl(self.key)
                raise LeaseHeld(f"the lease {self.key} is held by {self.describe(raw)}, live for another "
                                f"{max(0, int(ttl)) / 1000:.1f} s: another learner is running on this queue namespace; "
                                "stop it, or use another queue.namespace")
            if not noted:
                log.info("waiting up to %.0f s for the lease %s held by %s", wait_s, self.key, self.describe(raw))
                noted = True
            time.sleep(poll_s)
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat, name="lease-heartbeat", daemon=True)
        self._thread.start()

    def _replace(self, expected: bytes) -> bool:
        with self.r.pipeline() as pipe:
            try:
                pipe.watch(self.key)
                if pipe.get(self.key) != expected:
                    return False
                pipe.multi()
                pipe.set(self.key, self.value, px=self.ttl_ms)
                pipe.execute()
                return True
            except WatchError:
                return False

    def fenced(self, queue_commands: Callable) -> None:
        """Runs `queue_commands(pipe)` in a MULTI/EXEC that executes only if the lease is still
        ours (WATCH on the key); raises LeaseLost otherwise (nothing executed)."""
        with self.r.pipeline() as pipe:
            try:
                pipe.watch(self.key)
                current = pipe.get(self.key)
                if current != self.value:
                    self.lost = True
                    raise LeaseLost(f"the lease {self.key} is no longer ours (now held by {self.describe(current)})")
                pipe.multi()
                queue_commands(pipe)
                pipe.execute()
            except WatchError:
                current = self.r.get(self.key)
                if current != self.value:
                    self.lost = True
                    raise LeaseLost(f"the lease {self.key} changed hands (now {self.describe(current)})") from None
                # Renewed by our own heartbeat meanwhile: try again.
                self.fenced(queue_commands)

    def check(self) -> None:
        """Raises LeaseLost unless the key holds our value (fencing before a commit)."""
        current = self.r.get(self.key)
        if self.lost or current != self.value:
            self.lost = True
            raise LeaseLost(f"the lease {self.key} is no longer ours (now held by {self.describe(current)})")

    def _renew(self) -> bool:
        with self.r.pipeline() as pipe:
            try:
                pipe.watch(self.key)
                if pipe.get(self.key) != self.value:
                    return False
                pipe.multi()
                pipe.pexpire(self.key, self.ttl_ms)
                pipe.execute()
                return True
            except WatchError:
                return self.r.get(self.key) == self.value

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_ms / 3000):
            try:
                if not self._renew():
                    self.lost = True
                    log.error("lost the lease %s (now held by %s)", self.key, self.describe(self.r.get(self.key)))
                    return
            except redis.exceptions.RedisError as exc:  # retried at the next beat; the TTL covers a few misses
                log.warning("lease heartbeat failed: %s", exc)

    def release(self) -> None:
        """Stops the heartbeat and deletes the key if it is still ours."""
        if self._stop is not None:
            self._stop.set()
            self._thread.join(5)
        with self.r.pipeline() as pipe:
            try:
                pipe.watch(self.key)
                if pipe.get(self.key) == self.value:
                    pipe.multi()
                    pipe.delete(self.key)
                    pipe.execute()
            except WatchError:
                pass
