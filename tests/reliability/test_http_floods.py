"""HTTP connection floods against the real teacher (issue 33, section 3, and the HTTP body items of
section 1): a subprocess over TCP (tiny-random model), started with a hard open-file limit of
`NOFILE` (so it cannot raise it), a probe listener (`--http-probe-port 0`) and small limits, so that
hundreds of sockets reach what thousands reached at the defaults.

Each flood runs a few seconds while a victim probes, throughout, a fresh gRPC Score (a new
connection each time: the accept path) and /readyz on the probe listener; every probe must answer
(Score OK, /readyz 200) within DEADLINE_S, and their median latency stays within a generous
ratio of the victim alone (2 shared cores, other jobs beside: 3-5x noise is expected).

- reconnecting partial requests from 8 client addresses (127.0.0.2-9 on loopback), more than the
  open-file limit in all: the HTTP side keeps below its connection cap (a quarter of the open files
  left to the rest), so gRPC and the probes still accept.
- slow bodies from one address: it gets `--http-max-connections-per-peer` connections and no more
  (503 at once), the main port still serves another client, and each body still unfinished after
  `--http-body-timeout-s` is closed by the server.
- held 4 MiB bodies: at most `--http-max-inflight-body-bytes` of them admitted, the others answered
  503 before their body is read; the teacher's peak RSS grows by a bound set by that budget, not by
  the number of requests, and the memory is handed back after."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import resource
import socket
import statistics
import threading
import time
import urllib.request

import grpc
import pytest

from eopd.v1 import teacher_pb2 as pb
from eopd.v1 import teacher_pb2_grpc as pb_grpc
from eopd_trainer.job.teacher_proc import TEACHER_COMMAND
from tests.os_probes import closed_by_server, status_mib
from tests.procs import running_teacher

pytestmark = [pytest.mark.integration, pytest.mark.serial]

MiB = 1024 * 1024
NOFILE = 640  # soft and hard: the HTTP side's cap becomes 640 - 384 = 256 (http.limits.connection_cap)
PER_PEER = 48
HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 3.0
BODY_BUDGET = 16 * MiB
FLOOD_S = 4.0
# A probe's median under a flood within RATIO x its median alone, plus FLOOR_S (loopback probes take
# ~2 ms alone: the floor absorbs the machine's noise); every probe within DEADLINE_S (the issue saw
# Score miss a 5 s deadline; against the code before, no probe at all answered during the first flood).
RATIO, FLOOR_S, DEADLINE_S = 20.0, 0.5, 10.0


@pytest.fixture(scope="module")
def teacher():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"hard open-file limit {hard} is too low for the attacker's sockets")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    command = ("prlimit", f"--nofile={NOFILE}:{NOFILE}", *TEACHER_COMMAND)
    with running_teacher("tiny-random", "--http-probe-port", "0", "--no-compile-statistics",
                         "--http-max-connections-per-peer", str(PER_PEER),
                         "--http-header-timeout-s", str(HEADER_TIMEOUT_S), "--http-body-timeout-s", str(BODY_TIMEOUT_S),
                         "--http-max-inflight-body-bytes", str(BODY_BUDGET), command=command) as t:
        t.probe_port = json.loads(t.ports_path.read_text())["probe_port"]
        yield t


def score_once(target: str) -> float:
    """A Score on a fresh channel (a new TCP connection); its latency, or raises."""
    started = time.monotonic()
    with grpc.insecure_channel(target) as ch:
        req = pb.ScoreRequest(request_id="v", sequences=[pb.Sequence(id="s", token_ids=[1, 2, 3, 4, 5], score_from=1)])
        resp = pb_grpc.TeacherServiceStub(ch).Score(req, timeout=DEADLINE_S)
    assert len(resp.results[0].token_logprobs) == 4
    return time.monotonic() - started


def get(port: int, path: str, source: str = "127.0.0.1") -> tuple[int, float]:
    """(status, latency) of a GET from `source`, on a fresh connection."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S, source_address=(source, 0)) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), time.monotonic() - started


def readyz_once(port: int) -> float:
    status, took = get(port, "/readyz")
    assert status == 200, f"/readyz answered {status}"
    return took


class Victim:
    """Probes Score and /readyz (probe listener) in a loop until stopped; keeps latencies and failures."""

    def __init__(self, t):
        self.t = t
        self.score: list[float] = []
        self.readyz: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, probe, into in (("Score", lambda: score_once(self.t.target), self.score),
                                      ("/readyz", lambda: readyz_once(self.t.probe_port), self.readyz)):
                try:
                    into.append(probe())
                except Exception as exc:  # noqa: BLE001 - every failure is reported by the assertion
                    self.failures.append(f"{name}: {type(exc).__name__}: {exc}")
            time.sleep(0.05)

    def __enter__(self) -> Victim:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)


def baseline(t) -> tuple[float, float]:
    """The victim alone: median Score and /readyz latency (after a warm-up call each)."""
    score_once(t.target), readyz_once(t.probe_port)
    return (statistics.median(score_once(t.target) for _ in range(5)),
            statistics.median(readyz_once(t.probe_port) for _ in range(5)))


def assert_victim_served(victim: Victim, alone: tuple[float, float]) -> None:
    assert not victim.failures, f"{len(victim.failures)} probes failed during the flood, first: {victim.failures[:3]}"
    assert len(victim.score) >= 2 and len(victim.readyz) >= 2, (victim.score, victim.readyz)
    for name, took, base in (("Score", victim.score, alone[0]), ("/readyz", victim.readyz, alone[1])):
        med = statistics.median(took)
        print(f"{name}: alone {base * 1000:.1f} ms, under the flood median {med * 1000:.1f} ms, max {max(took) * 1000:.1f} ms "
              f"({len(took)} probes)")
        assert med <= RATIO * base + FLOOR_S, f"{name}: median {med:.3f}s under the flood, {base:.3f}s alone"




def reconnecting_partial_requests(port: int, sources: list[str], per_source: int, seconds: float, counter) -> None:
    """Keeps `per_source` connections open from each address, each having sent half a request,
    reconnecting (a round every 0.1 s) those the server closed; runs in its own process (`spawn`),
    so that the attacker's threads do not slow the victim's measurements down (the GIL)."""
    stop = time.monotonic() + seconds

    def attacker(source: str) -> None:
        socks: list[socket.socket] = []
        while time.monotonic() < stop:
            for s in [s for s in socks if closed_by_server(s)]:
                s.close()
                socks.remove(s)
            while len(socks) < per_source and time.monotonic() < stop:
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=2, source_address=(source, 0))
                    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
                    socks.append(s)
                    with counter.get_lock():
                        counter.value += 1
                except OSError:
                    time.sleep(0.01)
            time.sleep(0.1)
        for s in socks:
            s.close()

    threads = [threading.Thread(target=attacker, args=(src,)) for src in sources]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def test_reconnecting_partial_requests_from_many_addresses_do_not_starve_grpc_or_probes(teacher):
    """8 addresses x 90 connections (720, over the teacher's 640 open files), each sending half a
    request and reconnecting as soon as the server closes it (the issue's 1,050 at 1024 files)."""
    alone = baseline(teacher)
    ctx = multiprocessing.get_context("spawn")
    connects = ctx.Value("i", 0)
    flood = ctx.Process(target=reconnecting_partial_requests, daemon=True,
                        args=(teacher.http_port, [f"127.0.0.{i}" for i in range(2, 10)], 90, FLOOD_S + 3, connects))
    flood.start()
    try:
        while connects.value < 720 and flood.is_alive():  # every address at its cap, the HTTP side at its total
            time.sleep(0.1)
        with Victim(teacher) as victim:
            time.sleep(FLOOD_S)
        assert connects.value > 720, connects.value
    finally:
        flood.join(30)
        if flood.is_alive():
            flood.kill()
    assert_victim_served(victim, alone)
    assert get(teacher.http_port, "/readyz")[0] == 200  # the main port serves again once it is over


def test_slow_bodies_from_one_address_hold_neither_the_port_nor_the_probes(teacher):
    """One address opens 200 connections that send a request's headers and trickle its body: it
    gets PER_PEER of them (503 at once beyond), another client is served on the same port, and
    the server closes the slow bodies after the body timeout."""
    alone = baseline(teacher)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
    socks = []
    try:
        for _ in range(200):
            s = socket.create_connection(("127.0.0.1", teacher.http_port), timeout=5, source_address=("127.0.0.2", 0))
            with contextlib.suppress(OSError):
                s.sendall(head)
            socks.append(s)
        opened = time.monotonic()
        time.sleep(0.5)
        refused = 0
        for s in socks:
            s.settimeout(0.01)
            with contextlib.suppress(OSError):
                refused += s.recv(64, socket.MSG_PEEK).startswith(b"HTTP/1.1 503")
        assert refused >= 200 - PER_PEER - 5, f"{refused} of {200 - PER_PEER} connections over the per-peer cap refused"
        with Victim(teacher) as victim:
            statuses = [get(teacher.http_port, "/readyz")[0] for _ in range(5)]  # another address, the same port
            held = socks
            while time.monotonic() - opened < FLOOD_S and held:
                held = [s for s in held if not closed_by_server(s)]
                for s in held:
                    with contextlib.suppress(OSError):
                        s.send(b" ")  # a byte now and then: the body never completes
                time.sleep(0.5)
        assert statuses == [200] * 5, statuses
        assert_victim_served(victim, alone)
        deadline = opened + BODY_TIMEOUT_S + 15
        while (open_ := [s for s in socks if not closed_by_server(s)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not open_, f"{len(open_)} slow bodies still open {time.monotonic() - opened:.0f}s after their headers"
    finally:
        for s in socks:
            s.close()




def test_held_bodies_cost_at_most_the_body_budget(teacher):
    """48 requests declaring 4 MiB bodies that send all but the last byte and hold them (the issue's
    256 x 8 MiB: +1,957 MiB): at most BODY_BUDGET of them are admitted, the rest get 503 before
    their body is read, the peak RSS grows by a bound set by the budget, and is handed back."""
    pid, n, size = teacher.popen.pid, 48, 4 * MiB
    alone = baseline(teacher)
    before = status_mib(pid, "VmRSS")
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n\r\n").encode()
    body = b"[" + b" " * (size - 2)  # all but the last byte

    def send(s: socket.socket) -> None:
        with contextlib.suppress(OSError):
            s.sendall(head + body)

    socks = [socket.create_connection(("127.0.0.1", teacher.http_port), timeout=10, source_address=(f"127.0.0.{3 + i % 4}", 0))
             for i in range(n)]
    try:
        with Victim(teacher) as victim:
            senders = [threading.Thread(target=send, args=(s,), daemon=True) for s in socks]
            for th in senders:
                th.start()
            for th in senders:
                th.join(20)
            time.sleep(1.0)
            peak = status_mib(pid, "VmHWM") - before
        refused = 0
        for s in socks:
            s.settimeout(0.05)
            with contextlib.suppress(OSError):
                refused += s.recv(4096).startswith(b"HTTP/1.1 503")
        admitted_max = BODY_BUDGET // size
        assert refused >= n - admitted_max, f"{refused} of {n} refused; the budget admits {admitted_max}"
        # Each admitted body is held up to ~4 times (kernel/uvicorn buffers, chunks, the joined bytes)
        # plus 96 MiB of slack (the victim's calls, the allocator); the issue measured +1,957 MiB.
        bound = BODY_BUDGET / MiB * 4 + 96
        print(f"held bodies: {refused} of {n} refused, peak RSS +{peak:.0f} MiB (bound {bound:.0f})")
        assert peak < bound, f"peak RSS +{peak:.0f} MiB, bound {bound:.0f} MiB"
        assert_victim_served(victim, alone)
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 20
    while (after := status_mib(pid, "VmRSS") - before) > 48 and time.monotonic() < deadline:
        time.sleep(0.5)
    print(f"held bodies: RSS +{after:.0f} MiB after")
    assert after <= 48, f"RSS +{after:.0f} MiB after the held bodies were closed"
    assert get(teacher.http_port, "/readyz")[0] == 200
