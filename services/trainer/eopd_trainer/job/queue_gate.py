"""The embedded queue's door: what a connection may cost before it has authenticated.

fakeredis' TCP handler reads whatever a connection sends (a line without an end grows without
bound: +448 MiB in 0.9 s from one local connection) and polls every connection's socket 100 times a
second (300 idle connections: 1.5 cores). So each new connection first passes this gate, in its
own handler thread, before fakeredis sees a byte of it:

- it may send at most `max_bytes` (4 KiB: an AUTH or HELLO ... AUTH is ~130 bytes) before one of its
  commands authenticates; a command that could not fit (an array or bulk length beyond it) closes it
  at once;
- it waits for its bytes in a blocking `recv` with a deadline (`timeout_s` in all), so an idle
  connection costs no CPU, and is closed when the deadline passes;
- at most `max_pending` connections wait here at a time: one more closes the oldest waiting one
  (a run's own client authenticates within milliseconds of connecting, so a flood of strangers
  cannot keep it out for long).

Commands before a successful AUTH are answered here as Redis answers them (NOAUTH, WRONGPASS);
the authenticating command and whatever follows it go to fakeredis, whose per-connection gate
(`embedded_queue._require_auth`) answers the AUTH or runs the HELLO.
"""

from __future__ import annotations

import hmac
import socket
import threading
import time
from collections import OrderedDict

MAX_BYTES = 4096
MAX_PENDING = 64
TIMEOUT_S = 10.0
MAX_FIELDS = 16  # HELLO 3 AUTH user pass SETNAME name: 7

NOAUTH = "NOAUTH Authentication required."
WRONGPASS = "WRONGPASS invalid username-password pair or user is disabled."


class ProtocolError(ValueError):
    """Bytes that are not a Redis command, or one that could not fit in what the gate reads."""


def _line(buf: bytes, at: int) -> tuple[bytes, int] | None:
    end = buf.find(b"\r\n", at)
    return None if end < 0 else (buf[at:end], end + 2)


def _count(raw: bytes, what: str, limit: int) -> int:
    try:
        n = int(raw)
    except ValueError:
        raise ProtocolError(f"invalid {what} length") from None
    if not 0 <= n <= limit:
        raise ProtocolError(f"{what} length {n} is beyond what an unauthenticated connection may send")
    return n


def parse_command(buf: bytes, max_bytes: int = MAX_BYTES) -> tuple[list[bytes], int] | None:
    """The command at the start of `buf` as (fields, bytes it took), None while it is incomplete.
    RESP arrays of bulk strings and inline commands (`AUTH pw\\r\\n`), as Redis reads them. Raises
    ProtocolError for malformed bytes or lengths that could not fit in `max_bytes`."""
    if not buf.startswith(b"*"):
        got = _line(buf, 0)
        if got is None:
            return None
        line, used = got
        return line.split(), used
    got = _line(buf, 1)
    if got is None:
        return None
    n, at = _count(got[0], "multibulk", MAX_FIELDS), got[1]
    fields: list[bytes] = []
    for _ in range(n):
        if at >= len(buf):
            return None
        if buf[at:at + 1] != b"$":
            raise ProtocolError(f"expected '$', got {buf[at:at + 1]!r}")
        got = _line(buf, at + 1)
        if got is None:
            return None
        size, at = _count(got[0], "bulk", max_bytes), got[1]
        if len(buf) < at + size + 2:
            return None
        if buf[at + size:at + size + 2] != b"\r\n":
            raise ProtocolError("bulk string not followed by CRLF")
        fields.append(buf[at:at + size])
        at += size + 2
    return fields, at


def credentials(fields: list[bytes]) -> tuple[bytes, bytes] | str | None:
    """(user, password) that an AUTH or HELLO ... AUTH command gives; an error message for a
    malformed one; None for a command that does not try to authenticate."""
    name = fields[0].lower() if fields else b""
    if name == b"auth":
        if len(fields) not in (2, 3):
            return "ERR wrong number of arguments for 'auth' command"
        return (fields[1], fields[2]) if len(fields) == 3 else (b"default", fields[1])
    if name == b"hello":
        upper = [f.upper() for f in fields]
        if b"AUTH" in upper[2:]:
            at = upper.index(b"AUTH", 2)
            if len(fields) < at + 3:
                return "ERR Syntax error in HELLO option 'auth'"
            return fields[at + 1], fields[at + 2]
    return None


def valid(user: bytes, given: bytes, password: bytes) -> bool:
    """The password (compared in constant time) of the user `default`."""
    return hmac.compare_digest(given, password) and user.lower() == b"default"


def _error(message: str) -> bytes:
    return f"-{message}\r\n".encode()


class Admission:
    """The connections waiting at the gate, oldest first; at most `max_pending` (see the module doc)."""

    def __init__(self, max_pending: int = MAX_PENDING):
        self.max_pending = max_pending
        self._waiting: OrderedDict[socket.socket, None] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted = 0  # connections closed to make room

    def admit(self, sock: socket.socket) -> None:
        with self._lock:
            self._waiting[sock] = None
            while len(self._waiting) > self.max_pending:
                oldest, _ = self._waiting.popitem(last=False)
                self.evicted += 1
                try:  # its handler's recv returns b"" at once: it closes the connection
                    oldest.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def leave(self, sock: socket.socket) -> None:
        with self._lock:
            self._waiting.pop(sock, None)

    @property
    def waiting(self) -> int:
        return len(self._waiting)


class Gate:
    """`authenticate(sock)` for each new connection of one server (see the module doc)."""

    def __init__(self, password: bytes, *, max_bytes: int = MAX_BYTES, max_pending: int = MAX_PENDING,
                 timeout_s: float = TIMEOUT_S):
        self.password, self.max_bytes, self.timeout_s = password, max_bytes, timeout_s
        self.admission = Admission(max_pending)

    def authenticate(self, sock: socket.socket) -> bytes | None:
        """Reads `sock` until one of its commands authenticates and returns the bytes from that command
        on (for fakeredis to answer and run); None when the connection must be closed (it closed, sent
        too much or bad bytes, was too slow, or was evicted). Leaves `sock` in blocking mode."""
        self.admission.admit(sock)
        try:
            return self._read(sock)
        finally:
            self.admission.leave(sock)
            try:
                sock.settimeout(None)
            except OSError:
                pass

    def _read(self, sock: socket.socket) -> bytes | None:
        deadline = time.monotonic() + self.timeout_s
        buf, total = b"", 0
        while True:
            while buf:
                try:
                    parsed = parse_command(buf, self.max_bytes)
                except ProtocolError as exc:
                    self._send(sock, _error(f"ERR Protocol error: {exc}"))
                    return None
                if parsed is None:
                    break
                fields, used = parsed
                creds = credentials(fields)
                if isinstance(creds, tuple) and valid(*creds, self.password):
                    return buf
                reply = _error(creds if isinstance(creds, str) else WRONGPASS if creds else NOAUTH)
                if not fields:  # an empty inline line: Redis ignores it
                    reply = b""
                if reply and not self._send(sock, reply):
                    return None
                buf = buf[used:]
            left = deadline - time.monotonic()
            if total >= self.max_bytes or left <= 0:
                return None
            try:
                sock.settimeout(left)
                data = sock.recv(self.max_bytes - total)
            except OSError:  # the deadline (socket.timeout), a reset, an eviction
                return None
            if not data:
                return None
            total += len(data)
            buf += data

    @staticmethod
    def _send(sock: socket.socket, data: bytes) -> bool:
        try:
            sock.sendall(data)
            return True
        except OSError:
            return False
