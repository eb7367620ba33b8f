"""The embedded queue of `eopd run`: an in-memory Redis-protocol server in a thread of the `eopd run`
process, for machines with neither a reachable Redis nor a `redis-server` binary.

It is `fakeredis` (a Python implementation of the Redis commands) behind its TCP server
(`fakeredis.TcpFakeServer`, RESP over TCP), bound to 127.0.0.1 on a port the OS picks. The learner
and the rollout workers are separate processes and talk to it through redis-py exactly as they
talk to Redis: nothing in `queue/`, the learner or the workers knows the difference.

What it is not:

- **Not persistent.** Every stream, consumer group, pending list and key lives in the memory of
  the `eopd run` process. If that process dies (SIGKILL, OOM, a crash), the queue is gone; its
  children are SIGKILLed by the kernel (pdeathsig.py: PR_SET_PDEATHSIG); the learner's last
  committed checkpoint stays on disk, but a restarted run starts
  from an empty queue. Ctrl-C / SIGTERM are clean: the children are stopped first, the queue last.
- **Not shared.** It listens on 127.0.0.1 only; processes on other machines cannot use it.
- **A password of its own, enforced here.** fakeredis 2.40's TCP server accepts `CONFIG SET
  requirepass` without enforcing it, so each connection's command dispatch is wrapped
  (`_require_auth`): until it sends `AUTH <password>`, `AUTH default <password>` or `HELLO <ver>
  AUTH default <password>` (what redis-py 8 sends), every command is answered `NOAUTH` and not run;
  a wrong password gets `WRONGPASS`. `eopd run` gives it a random password each start and passes it
  to the learner and workers as REDIS_PASSWORD, as for a redis-server it starts (local_queue.py).
  CONFIG and ACL are refused even after AUTH, so no client can lock the run out. Before fakeredis
  reads a byte of a connection, `queue_gate.py` makes it authenticate first: at most 4 KiB and 10 s
  each, 64 waiting at once, idle ones blocked in `recv` (no CPU), so a stranger's connection costs
  next to nothing (fakeredis alone buffered an endless line: +448 MiB in 0.9 s). What the run's
  processes accept from it is also authenticated: every message carries an HMAC under the run's
  key (`queue/signing.py`), which the queue never sees.
- **Not fast for large entries.** fakeredis' TCP server reads a request line by line and its
  parser concatenates the pieces: median XADD 0.27 ms for 10 kB (the CPU presets' rollouts are
  smaller), 1.2 ms for 100 kB, 78 ms for 1 MB (redis-server: 0.08, 0.12, 0.8 ms), all of it CPU of
  this process. Use Redis for the GPU presets.

One fakeredis 2.40.0 defect is corrected here (`_fix_blocking_xreadgroup`): XREADGROUP with both
COUNT and BLOCK returned at once instead of blocking, which would turn the learner's and the
workers' blocking reads into busy loops. The fix runs in this process only (it replaces one
method of fakeredis' socket class) and is checked by `tests/trainer/queue/test_pipeline_queue.py`.
"""

from __future__ import annotations

import functools
import logging
import secrets
import socket
import threading

from . import queue_gate

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


REFUSED = (b"config", b"acl")  # could lock the run out (requirepass, users): the run never needs them


def _require_auth(sock, password: bytes) -> None:
    """Makes one connection's fake socket run nothing before a successful AUTH (see the module doc).

    fakeredis parses each command and hands it to `sock._process_command(fields)`; that method is
    replaced on this socket only by a gate that answers AUTH and HELLO ... AUTH itself (user
    `default` only; compared in constant time) and passes the rest on once authenticated. Errors
    are queued as fakeredis' SimpleError, which its TCP handler writes as `-<message>` and, unlike
    an error of a command, without closing the connection (as Redis answers NOAUTH)."""
    from fakeredis._helpers import SimpleError

    run = sock._process_command
    authed = False

    def gate(fields: list[bytes]) -> None:
        nonlocal authed
        name = fields[0].lower() if fields else b""
        creds = queue_gate.credentials(fields)
        if isinstance(creds, str):
            sock.put_response(SimpleError(creds))
            return
        if creds is not None:
            if not queue_gate.valid(*creds, password):
                sock.put_response(SimpleError(queue_gate.WRONGPASS))
                return
            authed = True
            if name == b"auth":
                sock.put_response(b"OK")
                return
            at = [f.upper() for f in fields].index(b"AUTH", 2)
            fields = fields[:at] + fields[at + 3:]  # HELLO: fakeredis' own ACL knows no password
        if not authed:
            sock.put_response(SimpleError(queue_gate.NOAUTH))
        elif name in REFUSED:
            sock.put_response(SimpleError(f"ERR {name.decode().upper()} is disabled in the embedded queue"))
        else:
            run(fields)

    sock._process_command = gate


def _auth_server(address: tuple[str, int], gate: queue_gate.Gate):
    """fakeredis' TcpFakeServer whose connections pass `gate` before fakeredis reads them, and must
    authenticate with fakeredis too (`_require_auth`)."""
    import fakeredis
    from fakeredis._clients._tcp_server import TCPFakeRequestHandler

    class Handler(TCPFakeRequestHandler):
        def setup(self) -> None:
            self.admitted = gate.authenticate(self.request)  # blocking, bounded in bytes and time
            if self.admitted is None:
                return  # closed without fakeredis ever seeing it
            super().setup()
            _require_auth(self.current_client.get_socket(), gate.password)

        def handle(self) -> None:
            if self.admitted is None:
                return
            self.current_client.get_socket().sendall(self.admitted)  # the AUTH / HELLO and what followed
            super().handle()

        def finish(self) -> None:
            if self.admitted is not None:
                super().finish()

    class Server(fakeredis.TcpFakeServer):
        # socketserver's backlog is 5: a burst of connections (a stranger's flood) overflowed it and the
        # kernel dropped the SYNs of the run's own clients, which retried after 1, 3, 7 s...
        request_queue_size = socket.SOMAXCONN

    server = Server(address)
    server.RequestHandlerClass = Handler
    return server


class EmbeddedQueue:
    """A Redis-protocol server on 127.0.0.1 in a daemon thread of this process (see the module doc)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, password: str | None = None, *,
                 max_unauthenticated: int = queue_gate.MAX_PENDING, unauthenticated_bytes: int = queue_gate.MAX_BYTES,
                 auth_timeout_s: float = queue_gate.TIMEOUT_S):
        """`password`: what clients must AUTH with (a new random one when None). The other three bound
        what connections that have not authenticated may cost (queue_gate.py): how many wait at once,
        the bytes each may send, the seconds each may take."""
        try:
            import fakeredis
        except ImportError as exc:  # the trainer extra pins it
            raise RuntimeError("the embedded queue needs the fakeredis package (pip install 'eopd[trainer]')") from exc
        _fix_blocking_xreadgroup()
        self.password = password or secrets.token_hex(32)
        self.gate = queue_gate.Gate(self.password.encode(), max_bytes=unauthenticated_bytes,
                                    max_pending=max_unauthenticated, timeout_s=auth_timeout_s)
        self._server = _auth_server((host, port), self.gate)
        self._server.daemon_threads = True  # a connection left open by a killed child must not hold up stop()
        self.host, self.port = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="eopd-embedded-queue", daemon=True)
        self._stopped = False

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def auth_url(self) -> str:
        """`url` with the password in it (for this process' own clients and tests; never logged)."""
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

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
