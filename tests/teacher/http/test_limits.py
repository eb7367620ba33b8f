"""The HTTP side's pure limits: the connection cap below the open-file limit, per-address counts,
and the request-body budget (an ASGI middleware driven here by a scripted app; the real server
under floods: tests/reliability/test_http_floods.py)."""

from __future__ import annotations

import asyncio

from eopd_teacher.http.body_budget import BodyBudget
from eopd_teacher.http.limits import FD_RESERVE_MIN, ConnectionCounts, connection_cap, refusal_bytes

MiB = 1 << 20


def test_connection_cap_leaves_descriptors_to_the_rest_of_the_process():
    assert connection_cap(4096, 1024) == 1024 - FD_RESERVE_MIN
    assert connection_cap(8192, 8192) == 8192 - 2048  # a quarter, where that is more
    assert connection_cap(4096, 1 << 20) == 4096  # the setting, where the limit is high
    assert connection_cap(4096, 100) == 1  # never 0


def test_connection_counts_cap_each_address_and_the_total():
    c = ConnectionCounts(total=5, per_peer=2)
    assert c.admit("a") is None and c.admit("a") is None
    assert "limit 2 per client" in c.admit("a")
    assert c.admit("b") is None and c.admit("b") is None and c.admit("c") is None
    assert "5 connections open, limit 5" in c.admit("d")
    c.release("a")
    assert c.admit("d") is None  # room again, for another address
    assert c.refused == 2 and c.open == 5
    for peer in ("a", "b", "b", "c", "d"):
        c.release(peer)
    assert c.open == 0 and not c.by_peer


def test_refusal_is_a_complete_503():
    raw = refusal_bytes("10 connections open, limit 10")
    head, body = raw.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 503") and b"connection: close" in head
    assert f"content-length: {len(body)}".encode() in head and b"limit 10" in body


class Scripted:
    """An ASGI app that reads its whole body, then waits for `release` before answering."""

    def __init__(self):
        self.release = asyncio.Event()
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            m = await receive()
            if m["type"] == "http.disconnect":
                raise ConnectionResetError("client gone")  # what starlette's ClientDisconnect does
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        self.bodies.append(body)
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def request(budget, body: bytes, *, declare: bool = True, chunk: int = MiB):
    headers = [(b"content-length", str(len(body)).encode())] if declare else []
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers, "client": ("1.2.3.4", 5)}
    chunks = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(m):
        sent.append(m)

    return budget(scope, receive, send), sent


def test_body_budget_refuses_declared_bodies_that_do_not_fit_and_gives_bytes_back():
    async def main():
        app = Scripted()
        done: list[int] = []
        budget = BodyBudget(app, 8 * MiB, on_large_body_done=done.append)
        first, s1 = request(budget, b"x" * (5 * MiB))
        t1 = asyncio.ensure_future(first)
        await asyncio.sleep(0)
        assert budget.held == 5 * MiB
        second, s2 = request(budget, b"y" * (4 * MiB))
        await second  # 5 + 4 > 8: refused at once, its body never read
        assert s2[0]["status"] == 503 and b"max_inflight_body_bytes" in s2[1]["body"]
        assert len(app.bodies) == 1
        small, s3 = request(budget, b"z" * MiB)
        t3 = asyncio.ensure_future(small)  # 5 + 1 fits
        app.release.set()
        await asyncio.gather(t1, t3)
        assert s1[0]["status"] == 200 and s3[0]["status"] == 200
        assert budget.held == 0 and budget.peak == 6 * MiB and budget.refused == 1
        assert sorted(done) == [MiB, 5 * MiB]  # the memory returner told of each large body

    asyncio.run(main())


def test_body_budget_counts_chunked_bodies_as_they_arrive():
    async def main():
        app = Scripted()
        budget = BodyBudget(app, 4 * MiB)
        held, _ = request(budget, b"x" * (3 * MiB), declare=False)
        t1 = asyncio.ensure_future(held)
        for _ in range(5):
            await asyncio.sleep(0)
        assert budget.held == 3 * MiB
        over, sent = request(budget, b"y" * (3 * MiB), declare=False)
        await over  # its second chunk does not fit: 503, the route sees the client gone (no traceback)
        assert sent[0]["status"] == 503 and len(sent) == 2
        app.release.set()
        await t1
        alone, sent_alone = request(budget, b"w" * (9 * MiB), declare=False)  # over the budget, but alone
        await alone
        assert sent_alone[0]["status"] == 200 and budget.held == 0 and budget.peak == 9 * MiB

    asyncio.run(main())
