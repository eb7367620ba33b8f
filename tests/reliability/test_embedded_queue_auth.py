"""Issue 17 section 1: the embedded queue of `eopd run` (fakeredis' TCP server in a thread) requires
the run's random password, like the redis-server it starts (test_queue_auth.py). Against the real
embedded server over TCP, with redis-py and with a raw socket:

- a stranger without the password gets NOAUTH for XADD, SCAN, CONFIG SET requirepass, XREADGROUP,
  and nothing it sent is executed;
- a wrong password (or another user) gets WRONGPASS;
- the right password works as the pipeline uses the queue (StreamQueue: XADD, XREADGROUP with
  BLOCK, XACK), over RESP3 (HELLO 3 AUTH, redis-py 8's default) and RESP2 (AUTH), across reconnects;
  an authenticated CONFIG SET requirepass is refused, so it cannot lock the run out;
- `eopd run` (choose_queue, queue.backend=embedded) hands the password to the children that hold
  the run directory as REDIS_PASSWORD, never on a command line.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

import pytest
import redis
from eopd_trainer.config import QueueConfig
from eopd_trainer.job.embedded_queue import EmbeddedQueue
from eopd_trainer.job.local_queue import choose_queue
from eopd_trainer.job.supervisor import Supervisor
from eopd_trainer.queue.streams import Keys, StreamQueue, connect

pytestmark = pytest.mark.integration


def resp(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def replies(sock: socket.socket, n: int, timeout: float = 10.0) -> list[bytes]:
    """The next `n` one-line replies (simple strings, errors, integers) on a raw connection."""
    buf, deadline = b"", time.monotonic() + timeout
    while buf.count(b"\r\n") < n and time.monotonic() < deadline:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        chunk = sock.recv(4096)
        if not chunk:
            break
        buf += chunk
    return buf.split(b"\r\n")[:n]


@pytest.fixture
def embedded():
    with EmbeddedQueue() as server:
        yield server


def test_a_stranger_gets_noauth_and_nothing_runs(embedded):
    stranger = redis.Redis.from_url(embedded.url, socket_timeout=5)
    for attempt in (lambda: stranger.xadd("eopd:rollouts", {b"data": b"forged"}),
                    lambda: stranger.scan(match="*:rollouts"),
                    lambda: stranger.config_set("requirepass", "x"),
                    lambda: stranger.xreadgroup("learner", "c", {"eopd:rollouts": ">"}, count=1),
                    stranger.ping):
        with pytest.raises(redis.exceptions.AuthenticationError, match="Authentication required"):
            attempt()
    # A raw client: every command before AUTH is answered NOAUTH on the same open connection.
    with socket.create_connection((embedded.host, embedded.port), timeout=10) as raw:
        raw.sendall(resp(b"XADD", b"eopd:rollouts", b"*", b"data", b"forged") + resp(b"SET", b"k", b"v")
                    + resp(b"CONFIG", b"SET", b"requirepass", b"x") + resp(b"PING"))
        assert replies(raw, 4) == [b"-NOAUTH Authentication required."] * 4
    owner = redis.Redis.from_url(embedded.auth_url, socket_timeout=5)
    assert owner.exists("eopd:rollouts", "k") == 0 and owner.dbsize() == 0  # nothing was executed
    assert owner.ping()  # and the CONFIG SET did not change the password


def test_a_wrong_password_or_user_gets_wrongpass(embedded):
    for client in (redis.Redis.from_url(embedded.url, password="guess", socket_timeout=5),  # HELLO 3 AUTH
                   redis.Redis.from_url(embedded.url, password="guess", protocol=2, socket_timeout=5),  # AUTH
                   redis.Redis.from_url(embedded.url, username="admin", password=embedded.password, socket_timeout=5)):
        with pytest.raises(redis.exceptions.AuthenticationError, match="invalid username-password pair"):
            client.ping()
    with socket.create_connection((embedded.host, embedded.port), timeout=10) as raw:
        raw.sendall(resp(b"AUTH", b"guess") + resp(b"AUTH", b"default", b"guess") + resp(b"AUTH")
                    + resp(b"HELLO", b"2") + resp(b"PING") + resp(b"AUTH", embedded.password.encode()) + resp(b"PING"))
        got = replies(raw, 7)
    assert got[:2] == [b"-WRONGPASS invalid username-password pair or user is disabled."] * 2
    assert got[2].startswith(b"-ERR wrong number of arguments")
    assert got[3:] == [b"-NOAUTH Authentication required."] * 2 + [b"+OK", b"+PONG"]


@pytest.mark.parametrize("protocol", [3, 2])
def test_the_password_works_as_the_pipeline_uses_the_queue(embedded, monkeypatch, protocol):
    monkeypatch.setenv("REDIS_PASSWORD", embedded.password)  # how the learner and workers get it
    keys = Keys("emb")
    client = connect(embedded.url) if protocol == 3 else \
        redis.Redis.from_url(embedded.url, password=embedded.password, protocol=2, socket_timeout=30)
    q = StreamQueue(client, keys.rollouts, "learner", "c1", keys.dead)
    q.ensure_group()
    assert [e.data for e in q.read_new(4, block_ms=100)] == []
    producer = StreamQueue(connect(embedded.url), keys.rollouts, "learner", "p", keys.dead)
    later = threading.Timer(0.5, producer.add, args=(b"late",))
    later.start()
    got = q.read_new(4, block_ms=20_000)  # blocks until the write (the blocking read of the learner)
    later.join()
    assert [e.data for e in got] == [b"late"]
    q.ack([got[0].entry_id])
    assert q.pending_count() == 0
    # An authenticated client cannot lock the run out: CONFIG (and ACL) are refused.
    with pytest.raises(redis.exceptions.ResponseError, match="CONFIG is disabled"):
        client.config_set("requirepass", "x")
    with pytest.raises(redis.exceptions.ResponseError, match="ACL is disabled"):
        client.execute_command("ACL", "SETUSER", "default", "off")
    # A reconnect (the server side closes a connection after a command error) authenticates again.
    client.connection_pool.disconnect()
    producer.add(b"again")
    assert [e.data for e in q.read_new(4, block_ms=1000)] == [b"again"]
    assert client.ping()


def test_eopd_run_gives_the_embedded_queue_a_random_password(tmp_path, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("REDIS_PASSWORD", "meant-for-an-external-redis")
    sup = Supervisor(tmp_path / "logs", pdeathsig=False)
    try:
        q = choose_queue(sup, tmp_path, QueueConfig(backend="embedded"))
        assert q.backend == "embedded" and "with a random password" in q.message
        password = sup.child_env["REDIS_PASSWORD"]
        assert len(password) == 64 and password == q.password == sup.embedded.password
        assert password not in q.message + q.url  # the children get it in their environment only
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(q.url, socket_timeout=5).xadd("eopd:rollouts", {b"data": b"x"})
        assert sup.drop_env == ("REDIS_PASSWORD",)  # the external Redis' password goes to no child
        probe = sup.start("probe", [sys.executable, "-c", "from eopd_trainer.queue.streams import connect; import sys; "
                                    f"r = connect({q.url!r}); r.set('probe', 'ok'); sys.exit(0 if r.ping() else 1)"])
        assert probe.wait(60) == 0, probe.log()
        assert redis.Redis.from_url(q.auth_url).get("probe") == b"ok"
        again = Supervisor(tmp_path / "logs2", pdeathsig=False)
        other = choose_queue(again, tmp_path, QueueConfig(backend="embedded"))
        assert other.password != password  # a new one each start
        again.stop_all()
    finally:
        sup.stop_all()
