"""Issue 33 section 4: what a stranger on the machine can do to `eopd run`'s queue.

- The embedded queue (a real process hosting it, raw sockets over TCP): one connection streaming
  64 MiB without authenticating is closed after a few KiB (it grew the process by 448 MiB in 0.9 s);
  a bulk length of 1 GiB is refused at once; 300 idle unauthenticated connections cost next to no
  CPU (they used 1.5 cores: fakeredis polls each socket 100 times a second) and are closed at the
  deadline, the oldest at once beyond the cap of waiting connections; the run's own client (redis-py
  with the password) works throughout.
- The redis-server `eopd run` starts: a stranger already listening on the port it picked never
  receives a byte (the password least of all); the next port gets a fresh password.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
import redis
from eopd_trainer.job import local_queue
from eopd_trainer.job.supervisor import Supervisor, free_port

from tests.procs import ROOT

pytestmark = pytest.mark.integration

PASSWORD = "p" * 64
AUTH_TIMEOUT_S = 3.0
HOST = """
import sys
from eopd_trainer.job.embedded_queue import EmbeddedQueue
q = EmbeddedQueue(password=sys.argv[1], auth_timeout_s=float(sys.argv[2])).start()
print(q.port, flush=True)
sys.stdin.read()  # until the test closes stdin
q.stop()
"""


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.fixture
def queue_process():
    """The embedded queue in a process of its own (as in `eopd run`), its port, its pid."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in
                                                        ("services/common", "services/teacher", "services/trainer"))}
    proc = subprocess.Popen([sys.executable, "-c", HOST, PASSWORD, str(AUTH_TIMEOUT_S)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        port = int(proc.stdout.readline())
        yield port, proc.pid
    finally:
        proc.stdin.close()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def victim_round_trip(port: int) -> None:
    """The run's own use: authenticate (redis-py 8: HELLO 3 AUTH), write, read back."""
    r = redis.Redis(host="127.0.0.1", port=port, password=PASSWORD, socket_timeout=10)
    try:
        entry = r.xadd("eopd:victim", {b"data": b"x" * 1000})
        assert r.xrange("eopd:victim", entry, entry)[0][0] == entry
    finally:
        r.close()


def stream_junk(port: int, total: int) -> int:
    """Sends up to `total` bytes of an endless line without authenticating; the bytes it got out
    before the server closed the connection."""
    chunk, sent = b"x" * (1 << 20), 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            while sent < total:
                sent += s.send(chunk)
        except OSError:  # reset / broken pipe: the server closed it
            return sent
    return sent


def test_unauthenticated_bytes_are_bounded_before_the_password(queue_process):
    port, pid = queue_process
    victim_round_trip(port)
    rss0 = rss_kib(pid)
    sent = stream_junk(port, 64 << 20)
    time.sleep(0.3)
    grown_mib = (rss_kib(pid) - rss0) / 1024
    # Closed long before 64 MiB (what it got out is the kernel's socket buffers, not the server's);
    # the server grew by a few MiB at most (was +448 MiB in 0.9 s).
    assert sent < 64 << 20, f"the server read all {sent} bytes of an unauthenticated connection"
    assert grown_mib < 16, f"one unauthenticated connection grew the queue's process by {grown_mib:.0f} MiB"
    # A length that could never fit is refused at once, before a byte of it is read.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"*1\r\n$1073741824\r\n")
        answer = s.recv(4096)
        assert answer.startswith(b"-ERR Protocol error") and b"beyond" in answer
        assert s.recv(4096) == b""  # closed
    # Commands before AUTH get NOAUTH as from Redis, then AUTH works on the same connection.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"PING\r\n*2\r\n$4\r\nAUTH\r\n$5\r\nwrong\r\n")
        time.sleep(0.2)
        first = s.recv(4096)
        assert first.startswith(b"-NOAUTH") and b"-WRONGPASS" in first
        s.sendall(b"*2\r\n$4\r\nAUTH\r\n$64\r\n" + PASSWORD.encode() + b"\r\n*1\r\n$4\r\nPING\r\n")
        buf = b""
        while buf.count(b"\r\n") < 2:
            buf += s.recv(4096)
        assert buf == b"+OK\r\n+PONG\r\n"
    victim_round_trip(port)


def test_idle_unauthenticated_connections_cost_no_cpu_and_are_closed(queue_process):
    port, pid = queue_process
    victim_round_trip(port)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(300)]
    try:
        time.sleep(0.3)
        cpu0, t0 = cpu_s(pid), time.monotonic()
        time.sleep(2.0)  # below AUTH_TIMEOUT_S: the waiting ones are still open
        cpu, wall = cpu_s(pid) - cpu0, time.monotonic() - t0
        # fakeredis' own handler polled each: 300 connections used 1.5 cores in the attack, 0.3-1.2 here on main
        assert cpu < 0.1 * wall, f"300 idle connections used {cpu:.2f} s of CPU in {wall:.1f} s"
        victim_round_trip(port)  # the run's client gets in (it takes the place of the oldest waiting)
        closed_early = 0
        for s in idle:
            s.setblocking(False)
            try:
                closed_early += s.recv(1) == b""
            except BlockingIOError:
                pass
            except ConnectionResetError:
                closed_early += 1
        assert closed_early >= 300 - 64 - 1, f"only {closed_early} closed beyond the cap of 64 waiting"
        # Past the deadline every one of them is closed by the server.
        time.sleep(AUTH_TIMEOUT_S + 0.5)
        for s in idle:
            s.settimeout(5)
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
    finally:
        for s in idle:
            s.close()
    victim_round_trip(port)


class Recorder:
    """A stranger listening on a port before `eopd run` picks it: records every byte it is sent."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                while data := conn.recv(65536):
                    self.received += data
                    conn.sendall(b"+OK\r\n")  # answers like a Redis would, to draw more out
            except OSError:
                pass

    def close(self) -> None:
        self.sock.close()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_the_redis_password_goes_only_to_the_runs_own_child(tmp_path, monkeypatch):
    stranger = Recorder()
    ports = iter([stranger.port, free_port()])
    monkeypatch.setattr(local_queue, "free_port", lambda: next(ports))
    passwords: list[str] = []
    new_password = local_queue.new_password
    monkeypatch.setattr(local_queue, "new_password", lambda: passwords.append(new_password()) or passwords[-1])
    sup = Supervisor(tmp_path / "logs", pdeathsig=False)
    try:
        url, child, notes, password = local_queue._start_redis_server(sup, tmp_path, shutil.which("redis-server"))
        assert notes == [f"port {stranger.port} was taken"]
        time.sleep(0.2)
        assert stranger.connections == 0 and bytes(stranger.received) == b"", bytes(stranger.received)[:200]
        # A fresh password on the second port: the first one, had it leaked, opens nothing.
        assert len(passwords) == 2 and passwords[0] != passwords[1] == password
        assert (tmp_path / "redis" / "auth.conf").read_text() == f"requirepass {password}\n"
        assert local_queue.redis_pid(url, password=password) == child.popen.pid
        assert local_queue.redis_pid(url, password=passwords[0]) is None
    finally:
        sup.stop_all()
        stranger.close()


@pytest.mark.parametrize("data, expected", [
    (b"*2\r\n$4\r\nAUTH\r\n$2\r\npw\r\n", ([b"AUTH", b"pw"], 22)),
    (b"*2\r\n$4\r\nAUTH\r\n$2\r\npw", None),  # incomplete: wait for more
    (b"AUTH default pw\r\nPING\r\n", ([b"AUTH", b"default", b"pw"], 17)),  # inline, as Redis reads it
    (b"AUTH default", None),
])
def test_the_gate_parses_what_redis_reads(data, expected):
    from eopd_trainer.job.queue_gate import parse_command

    assert parse_command(data) == expected


@pytest.mark.parametrize("data", [b"*1\r\n$1073741824\r\n", b"*100000\r\n", b"*1\r\n+x\r\n", b"*x\r\n"])
def test_the_gate_refuses_what_could_not_fit_or_is_not_resp(data):
    from eopd_trainer.job.queue_gate import ProtocolError, parse_command

    with pytest.raises(ProtocolError):
        parse_command(data)


def test_the_gate_reads_credentials_as_redis_does():
    from eopd_trainer.job.queue_gate import credentials

    assert credentials([b"AUTH", b"pw"]) == (b"default", b"pw")
    assert credentials([b"auth", b"u", b"pw"]) == (b"u", b"pw")
    assert credentials([b"HELLO", b"3", b"AUTH", b"default", b"pw"]) == (b"default", b"pw")
    assert "wrong number" in credentials([b"AUTH"]) and "Syntax" in credentials([b"HELLO", b"3", b"AUTH", b"x"])
    assert credentials([b"HELLO", b"3"]) is None and credentials([b"PING"]) is None and credentials([]) is None
