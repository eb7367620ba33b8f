"""Per-client shares of the teacher's global limits (issues 33 and 49), against the real server
(a subprocess over TCP, tiny-random model) started with small limits (8 calls, 8 streams, 8 health
Watches; `max_client_share` 0.5: 4 each per client).

Two clients told apart by address (the share key: `serving/shares.py`): the attacker connects from
two loopback addresses at once, 127.0.0.1 and ::1, and is one client (`loopback`: any local user
owns all of 127.0.0.0/8, issue 49); the victim connects from this machine's own non-loopback
address (the teacher listens on every interface). The attacker tries to take all of each limit: it
is held to one share between its two addresses (RESOURCE_EXHAUSTED naming the share), and the victim
is served beside it (Score, GetModelInfo, Generate, ScoreStream, health). The attacker's unary calls
never send their body: each ends with DEADLINE_EXCEEDED after `request_receive_timeout_s` and frees
its slot. A stream that never reads its answers is given up after `stream_idle_timeout_s` (its work
withdrawn, its `max_streams` slot freed at once; the call ends as soon as the client reads again)."""

from __future__ import annotations

import asyncio
import re
import socket
import time
import urllib.request

import grpc
import pytest

from tests.os_probes import has_ipv6_loopback
from grpc_health.v1 import health_pb2, health_pb2_grpc

from eopd.v1 import teacher_pb2 as pb
from eopd.v1 import teacher_pb2_grpc as pb_grpc
from eopd_teacher.convert import STREAM_ENDING_KEY
from eopd_teacher.grpc.stream_session import STREAM_ENDING_GRACE_S
from tests.procs import running_teacher

pytestmark = pytest.mark.integration

LIMIT = 8  # max_concurrent_calls, max_streams, max_health_watches
SHARE = 4  # max(1, floor(8 x 0.5)): the default max_client_share
RECEIVE_TIMEOUT_S = 2.0
IDLE_TIMEOUT_S = 5.0
REFUSAL_WAIT_S = 1.0  # how long a stream just opened is read before it is written to (open_one)
ATTACKER = "loopback"
DEAF_REQUESTS = 8


def _own_address() -> str | None:
    """This machine's IPv4 address on its default route (no packet is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 9))
            host = s.getsockname()[0]
        except OSError:
            return None
    return None if host.startswith("127.") or host == "0.0.0.0" else host


@pytest.fixture(scope="module")
def teacher():
    own = _own_address()
    if not has_ipv6_loopback() or own is None:
        pytest.skip("needs the IPv6 loopback (::1) and a non-loopback IPv4 address for the two clients")
    limits = ("--host", "::", "--max-concurrent-calls", str(LIMIT), "--max-streams", str(LIMIT),
              "--max-health-watches", str(LIMIT), "--request-receive-timeout-s", str(RECEIVE_TIMEOUT_S),
              "--stream-idle-timeout-s", str(IDLE_TIMEOUT_S), "--grace-seconds", "2")
    with running_teacher("tiny-random", *limits) as t:
        port = t.target.rsplit(":", 1)[1]
        yield t, (f"127.0.0.1:{port}", f"[::1]:{port}"), f"{own}:{port}"


def score_request(rid: str = "v", n_tokens: int = 6, top_k: int = 0) -> pb.ScoreRequest:
    return pb.ScoreRequest(request_id=rid, top_k=top_k, sequences=[
        pb.Sequence(id="s", token_ids=[1 + (7 * j) % 500 for j in range(n_tokens)], score_from=1)])


def share_refusal(what: str, setting: str) -> str:
    return (f"client {ATTACKER} holds {SHARE} {what}, its share of {setting} ({LIMIT} x max_client_share = {SHARE}); "
            "retry later")


def gauge(teacher, name: str) -> float:
    with urllib.request.urlopen(f"{teacher.http}/metrics", timeout=10) as r:
        return float(re.search(rf"^{name} (\S+)$", r.read().decode(), re.M).group(1))


def wait_gauge(teacher, name: str, value: float, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (got := gauge(teacher, name)) != value:
        assert time.monotonic() < deadline, f"{name} is {got}, never {value}"
        time.sleep(0.1)


async def victim_is_served(target: str) -> None:
    """Score, GetModelInfo, Generate and ScoreStream from the victim all answer."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = pb_grpc.TeacherServiceStub(ch)
        resp = await stub.Score(score_request(), timeout=60)
        assert len(resp.results[0].token_logprobs) == 5
        assert (await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)).model_name
        gen = pb.GenerateRequest(request_id="g", prompts=[pb.Prompt(id="p", token_ids=[1, 2, 3])], max_new_tokens=2)
        answers = [a async for a in stub.Generate(gen, timeout=60)]
        assert answers and answers[0].request_id == "g"
        got = [r.request_id async for r in stub.ScoreStream(iter([score_request("s1"), score_request("s2")]), timeout=60)]
        assert sorted(got) == ["s1", "s2"]


async def never_ends(stop: asyncio.Event):
    """A request stream that sends nothing until `stop` (then ends without a message)."""
    await stop.wait()
    return
    yield  # pragma: no cover


async def refusals_are_announced(stub) -> grpc.aio.StreamStreamCall:
    """With the attacker at its share of streams: streams it opens asking for the in-band end
    (`eopd-stream-ending: 1`, as eopd's asyncio client does) and writes to at once (the race of
    grpc/grpc#36066) are told the share refusal in band first, then get it as their status, whether
    they half-close or not (the server waits STREAM_ENDING_GRACE_S at most). At most the attacker's
    share of such refusals wait at once (`refusing_streams`): one more, opened while they wait, gets
    the status alone. Returns the refused stream that never half-closes, its status still to come."""
    refusal = share_refusal("streams open", "max_streams")
    announced = []
    for i in range(SHARE):
        call = stub.ScoreStream(timeout=60, metadata=((STREAM_ENDING_KEY, "1"),))
        await call.write(score_request(f"r{i}"))
        first = await asyncio.wait_for(call.read(), 30)
        assert first.HasField("ending") and not first.request_id, first
        assert (first.ending.code, first.ending.message) == (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], refusal)
        announced.append(call)
    beyond = stub.ScoreStream(timeout=60, metadata=((STREAM_ENDING_KEY, "1"),))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await asyncio.wait_for(beyond.read(), 30)
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
    for call in announced[1:]:  # the first never half-closes (the caller awaits its status after the grace)
        await call.done_writing()
        assert (await asyncio.wait_for(call.code(), 30), await call.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
    return announced[0]


def test_calls_an_attacker_holds_its_share_the_victim_is_served_unsent_bodies_time_out(teacher):
    """The attacker keeps LIMIT + 4 unary calls going from its two loopback addresses that never send
    their body: at most SHARE are admitted at once (the rest refused, naming the share), each
    admitted one ends with DEADLINE_EXCEEDED after the receive timeout; meanwhile the victim is served."""
    t, attackers, victim = teacher

    async def go():
        outcomes: list[tuple[grpc.StatusCode, str, float]] = []
        stop = asyncio.Event()
        async with grpc.aio.insecure_channel(attackers[0]) as ch0, grpc.aio.insecure_channel(attackers[1]) as ch1:
            scores = [ch.stream_unary("/eopd.v1.TeacherService/Score", request_serializer=pb.ScoreRequest.SerializeToString,
                                      response_deserializer=pb.ScoreResponse.FromString) for ch in (ch0, ch1)]

            async def hold(score):
                while not stop.is_set():
                    started = time.monotonic()
                    try:
                        await score(never_ends(stop))
                        code, details = grpc.StatusCode.OK, ""
                    except grpc.aio.AioRpcError as e:
                        code, details = e.code(), e.details()
                    if not stop.is_set():
                        outcomes.append((code, details, time.monotonic() - started))
                    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        await asyncio.sleep(0.2)

            holders = [asyncio.ensure_future(hold(scores[i % 2])) for i in range(LIMIT + 4)]
            try:
                deadline = time.monotonic() + 60
                while not any(o[0] == grpc.StatusCode.RESOURCE_EXHAUSTED for o in outcomes):
                    assert time.monotonic() < deadline, outcomes
                    await asyncio.sleep(0.05)
                await victim_is_served(victim)
                while not any(o[0] == grpc.StatusCode.DEADLINE_EXCEEDED for o in outcomes):
                    assert time.monotonic() < deadline, outcomes
                    await asyncio.sleep(0.05)
            finally:
                stop.set()
                for h in holders:
                    h.cancel()
                await asyncio.gather(*holders, return_exceptions=True)
        return outcomes

    outcomes = asyncio.run(go())
    refused = [o for o in outcomes if o[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    timed_out = [o for o in outcomes if o[0] == grpc.StatusCode.DEADLINE_EXCEEDED]
    assert len(refused) + len(timed_out) == len(outcomes), outcomes
    assert {o[1] for o in refused} == {share_refusal("calls in progress", "max_concurrent_calls")}, refused
    assert {o[1] for o in timed_out} == {f"request: the request message had not arrived {RECEIVE_TIMEOUT_S:g}s after the "
                                         "call started (request_receive_timeout_s)"}, timed_out
    assert all(RECEIVE_TIMEOUT_S * 0.9 <= o[2] < RECEIVE_TIMEOUT_S + 30 for o in timed_out), timed_out
    wait_gauge(t, "eopd_teacher_calls_in_progress", 0)  # every slot freed


def test_streams_an_attacker_holds_its_share_and_a_stream_that_never_reads_is_given_up(teacher):
    """The attacker opens LIMIT streams from its two loopback addresses: SHARE are served, the rest
    refused naming the share; the victim's stream is served beside them. Then a stream of the
    attacker that sends requests and never reads the (large) answers is given up after the idle
    timeout, its slot freed at once (issue 49: it held it until the client read again): when the
    client reads again it gets what gRPC held, then UNAVAILABLE, long before all its answers."""
    t, attackers, victim = teacher
    attacker = attackers[0]

    async def go():
        async with grpc.aio.insecure_channel(attackers[0]) as ch0, grpc.aio.insecure_channel(attackers[1]) as ch1:
            stubs = [pb_grpc.TeacherServiceStub(ch) for ch in (ch0, ch1)]
            held, refused = [], []

            async def open_one(i: int) -> None:  # all at once: none idles out before the last is opened
                """The server refuses a stream as it opens, before it reads a request. A write racing that
                refusal makes grpcio report INTERNAL "Internal error from Core" as the call's status
                instead of the server's (grpc/grpc#36066: a rehearsal saw it for all four), so the stream
                is read first: a refused one ends within REFUSAL_WAIT_S with the server's status and is
                never written to; an admitted one waits for its request (well within the idle timeout)."""
                call = stubs[i % 2].ScoreStream(timeout=120)
                first = asyncio.ensure_future(call.read())
                try:
                    await asyncio.wait_for(asyncio.shield(first), REFUSAL_WAIT_S)
                except asyncio.TimeoutError:
                    pass  # admitted: it waits for a request
                except grpc.aio.AioRpcError:
                    refused.append((await call.code(), await call.details()))
                    return
                await call.write(score_request(f"a{i}"))
                assert (await asyncio.wait_for(first, 60)).request_id == f"a{i}"
                held.append(call)

            await asyncio.gather(*(open_one(i) for i in range(LIMIT)))
            assert len(held) == SHARE, refused
            assert refused == [(grpc.StatusCode.RESOURCE_EXHAUSTED, share_refusal("streams open", "max_streams"))] * (LIMIT - SHARE)
            await victim_is_served(victim)
            lingering = await refusals_are_announced(stubs[0])
            for call in held:
                await call.done_writing()
            assert [await c.code() for c in held] == [grpc.StatusCode.OK] * SHARE
            # The refused stream that never half-closed gets its status once the grace is over.
            assert (await asyncio.wait_for(lingering.code(), STREAM_ENDING_GRACE_S + 30), await lingering.details()) == \
                (grpc.StatusCode.RESOURCE_EXHAUSTED, share_refusal("streams open", "max_streams"))
            await asyncio.to_thread(wait_gauge, t, "eopd_teacher_open_streams", 0)

            # Never reads: 8 requests of ~130 KB answers each, on a channel whose HTTP/2 window stays
            # at 64 KiB (no BDP probing): the answers wait on flow control.
            small_window = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 65536)]
            deaf_ch = grpc.aio.insecure_channel(attacker, options=small_window)
            deaf = pb_grpc.TeacherServiceStub(deaf_ch).ScoreStream(timeout=120)
            for i in range(DEAF_REQUESTS):
                await asyncio.wait_for(deaf.write(score_request(f"d{i}", n_tokens=256, top_k=64)), 60)
            # The server gives up on it once an answer has waited on the client for the idle timeout.
            await asyncio.to_thread(wait_gauge, t, "eopd_teacher_streams_stalled_total", 1, IDLE_TIMEOUT_S + 60)
            # Its max_streams slot is freed at once (counted among the given-up streams until gRPC lets the call go).
            assert await asyncio.to_thread(gauge, t, "eopd_teacher_open_streams") == 0
            # Reading now: what gRPC held, then the end, before all its answers.
            answers = []
            with pytest.raises(grpc.aio.AioRpcError) as e:
                while (r := await asyncio.wait_for(deaf.read(), 60)) is not grpc.aio.EOF:
                    answers.append(r.request_id)
            await deaf_ch.close()
            return e.value, answers

    err, answers = asyncio.run(go())
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert err.details() == (f"the client took no answer for {IDLE_TIMEOUT_S:g}s; stream closed by the server "
                             "(stream_idle_timeout_s), re-open it and read its answers"), err.details()
    assert len(answers) < DEAF_REQUESTS, answers
    wait_gauge(t, "eopd_teacher_open_streams", 0)


def test_health_watches_are_bounded_per_client(teacher):
    """The attacker opens LIMIT Watch streams from its two loopback addresses: SHARE get the status,
    the rest are refused naming the share; the victim's Watch and Check are served; closed watches
    free their slots."""
    t, attackers, victim = teacher

    async def go():
        async with (grpc.aio.insecure_channel(attackers[0]) as ach0, grpc.aio.insecure_channel(attackers[1]) as ach1,
                    grpc.aio.insecure_channel(victim) as vch):
            astubs, vstub = [health_pb2_grpc.HealthStub(ach0), health_pb2_grpc.HealthStub(ach1)], health_pb2_grpc.HealthStub(vch)
            watches, refused = [], []

            async def open_one(i: int) -> None:
                call = astubs[i % 2].Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
                try:
                    first = await asyncio.wait_for(call.read(), 60)
                    assert first.status == health_pb2.HealthCheckResponse.SERVING
                    watches.append(call)
                except grpc.aio.AioRpcError as e:
                    refused.append((e.code(), e.details()))

            await asyncio.gather(*(open_one(i) for i in range(LIMIT)))
            assert len(watches) == SHARE, refused
            assert set(refused) == {(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     share_refusal("health Watch streams", "max_health_watches"))}
            mine = vstub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
            assert (await asyncio.wait_for(mine.read(), 60)).status == health_pb2.HealthCheckResponse.SERVING
            check = await vstub.Check(health_pb2.HealthCheckRequest(service=""), timeout=60)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            assert await asyncio.to_thread(gauge, t, "eopd_teacher_health_watches") == SHARE + 1
            for call in [*watches, mine]:
                call.cancel()

    asyncio.run(go())
    wait_gauge(t, "eopd_teacher_health_watches", 0)
