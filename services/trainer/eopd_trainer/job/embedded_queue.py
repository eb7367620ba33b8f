"""The embedded queue of `eopd run`: an in-memory Redis-protocol server in a thread of the `eopd run`
process, for machines with neither a reachable Redis nor a `redis-server` binary.

It is `fakeredis` (a Python implementation of the Redis commands) behind its TCP server
(`fakeredis.TcpFakeServer`, RESP over TCP), bound to 127.0.0.1 on a port the OS picks. The learner
and the rollout workers are separate processes and talk to it through redis-py exactly as they
talk to Redis: nothing in `queue/`, the learner or the workers knows the difference.

What it is not:

- **Not persistent.** Every stream, consumer group, pending list and key lives in the memory of
  the `eopd run` process. If that process dies (SIGKILL, OOM, a crash), the queue is gone; its
  children get SIGTERM from the kernel (supervisor.py: PR_SET_PDEATHSIG) and stop or fail on the lost
  connection; the learner's last committed checkpoint stays on disk, but a restarted run starts
  from an empty queue. Ctrl-C / SIGTERM are clean: the children are stopped first, the queue last.
- **Not shared.** It listens on 127.0.0.1 only; processes on other machines cannot use it.
- **No password.** fakeredis 2.40's TCP server accepts `CONFIG SET requirepass` without enforcing
  it, and an ACL that disables the default user also refuses redis-py's connection handshake (HELLO
  before AUTH), so any local process that finds its port can read and write it. What the run's
  processes accept from it is still authenticated: every message carries an HMAC under the run's
  key (`queue/signing.py`), which the queue never sees.
- **Not fast for large entries.** fakeredis' TCP server reads a request line by line and its
  parser concatenates the pieces: median XADD 0.27 ms for 10 kB (the CPU presets' rollouts are
  smaller), 1.2 ms for 100 kB, 78 ms for 1 MB (redis-server: 0.08, 0.12, 0.8 ms), all of it CPU of
  this process. Use Redis for the GPU presets.

One fakeredis 2.40.0 defect is corrected here (`_fix_blocking_xreadgroup`): XREADGROUP with both
COUNT and BLOCK returned at once instead of blocking, which would turn the learner's and the
workers' blocking reads into busy loops. The fix runs in this process only (it replaces one
method of fakeredis' socket class) and is checked by `tests/trainer/test_pipeline_queue.py`.
"""

from __future__ import annotations

import functools
import logging
import threading

log = logging.getLogger(__name__)

FAKEREDIS_VERSION = "2.40.0"  # the version the fix below was written against (pinned in pyproject.toml)

_fixed = False
_fix_lock = threading.Lock()


def _fix_blocking_xreadgroup() -> None:
    """Makes XREADGROUP ... BLOCK wait for new entries when COUNT is given.

    fakeredis' `_xreadgroup(consumer, group_params, count, noack, min_idle_time, first_pass)`
    returns None ("nothing yet, keep waiting") only on the first pass and only when COUNT is absent;
    with COUNT it returns an empty result, which the blocking loop takes as an answer. Redis
    blocks while a `>` read finds nothing new (a read of the consumer's history, id `0`, never
    blocks). The wrapper keeps fakeredis' read (called as a later pass, so it never discards
    entries it has already moved to the pending list) and answers None while a `>` read is empty.
    """
    global _fixed
    with _fix_lock:
        if _fixed:
            return
        import fakeredis
        from fakeredis._socket._fakesocket import FakeSocket

        if fakeredis.__version__ != FAKEREDIS_VERSION:
            log.warning("fakeredis %s, not %s: the XREADGROUP BLOCK fix may not apply", fakeredis.__version__,
                        FAKEREDIS_VERSION)
        original = FakeSocket._xreadgroup

        @functools.wraps(original)
        def _xreadgroup(self, consumer_name, group_params, count, noack, min_idle_time, first_pass):
            res = original(self, consumer_name, group_params, count, noack, min_idle_time, False)
            if res or any(start_id != b">" for _group, _stream, start_id in group_params):
                return res
            return None  # nothing new: the blocking loop waits for the next write (or the timeout)

        FakeSocket._xreadgroup = _xreadgroup
        _fixed = True


class EmbeddedQueue:
    """A Redis-protocol server on 127.0.0.1 in a daemon thread of this process (see the module doc)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        try:
            import fakeredis
        except ImportError as exc:  # the trainer extra pins it
            raise RuntimeError("the embedded queue needs the fakeredis package (pip install 'eopd[trainer]')") from exc
        _fix_blocking_xreadgroup()
        self._server = fakeredis.TcpFakeServer((host, port))
        self._server.daemon_threads = True  # a connection left open by a killed child must not hold up stop()
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="eopd-embedded-queue", daemon=True)
        self._stopped = False

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> EmbeddedQueue:
        self._thread.start()
        return self

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def stop(self) -> None:
        """Stops accepting connections and ends every connection's thread; the data is dropped."""
        if self._stopped:
            return
        self._stopped = True
        self._server.shutdown()  # sets the handlers' shutdown event, then stops serve_forever
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> EmbeddedQueue:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
