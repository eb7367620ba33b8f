"""Load test of the real teacher server: N concurrent clients (half unary, half streaming) for a
fixed duration; reports throughput, p50/p99 latency, errors by code and the server's resident
memory over time. A second phase drives it beyond capacity and checks that it sheds load with
RESOURCE_EXHAUSTED, keeps its memory bounded and recovers when the load drops.

    .venv/bin/python -m bench.load_test [--clients 64] [--seconds 60] [--model tiny-random]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from bench.report import machine_description, markdown_table, write_results, write_section


# Resident memory swings by 100-250 MiB within a second as score chunks are allocated and freed, so
# growth under load is read at rest, before and after the phase (tests/load/test_load.py); during
# it, four samples a second bound the peak.
RSS_INTERVAL_S = 0.25
# Before the measured phase, a warm-up of the same load: the allocator's arenas and gRPC's buffers
# grow in the first seconds, which is not a leak.
WARMUP_S = 5.0


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class PhaseResult:
    seconds: float
    requests: int = 0
    scored_tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    codes: Counter = field(default_factory=Counter)
    rss: list[float] = field(default_factory=list)
    messages: dict[str, str] = field(default_factory=dict)  # the first message seen for each error code
    by_mode: Counter = field(default_factory=Counter)  # answered requests per client mode (unary, stream)
    reopened: int = 0  # streams re-opened after an error
    connect_s: float = 0.0  # the slowest client's connection, before the clock started
    slowest: dict[str, float] = field(default_factory=dict)  # the longest answered request per mode, s

    def ok(self, mode: str, scored: int, latency: float) -> None:
        self.codes["OK"] += 1
        self.requests += 1
        self.by_mode[mode] += 1
        self.scored_tokens += scored
        self.latencies.append(latency)
        self.slowest[mode] = max(self.slowest.get(mode, 0.0), latency)

    def error(self, err: Exception) -> None:
        """A failed call (grpc.aio.AioRpcError) or a stream request answered with an in-band error
        (eopd_teacher.client.RequestFailed: `code`, `details` attributes)."""
        code = err.code() if callable(getattr(err, "code", None)) else err.code
        details = err.details() if callable(getattr(err, "details", None)) else err.details
        self.codes[code.name] += 1
        self.messages.setdefault(code.name, details or "")

    def summary(self) -> dict:
        lat = np.array(self.latencies) if self.latencies else np.array([float("nan")])
        return {
            "seconds": self.seconds,
            "requests": self.requests,
            "requests_per_s": self.requests / self.seconds,
            "scored_tokens_per_s": self.scored_tokens / self.seconds,
            "p50_ms": float(np.percentile(lat, 50) * 1000),
            "p99_ms": float(np.percentile(lat, 99) * 1000),
            "codes": dict(self.codes),
            "requests_by_mode": {m: self.by_mode[m] for m in ("unary", "stream")},
            "streams_reopened": self.reopened,
            "connect_s_max": self.connect_s,
            "slowest_ms_by_mode": {m: v * 1000 for m, v in self.slowest.items()},
            "messages": dict(self.messages),
            "rss_mib_start": self.rss[0] if self.rss else None,
            "rss_mib_max": max(self.rss) if self.rss else None,
            "rss_mib_end": self.rss[-1] if self.rss else None,
            "rss_mib_series": [round(x, 1) for x in self.rss],
        }


def rss_at_rest_mib(target: str, pid: int, seconds: float = 1.0) -> tuple[float, float]:
    """The server's resident memory with nothing in flight, and how long one normal request took.
    The request goes first: it queues behind whatever a phase left admitted, so once it is
    answered the server is idle. Then the median of samples over `seconds` (a chunk freed just
    before leaves its pages for a moment)."""
    from eopd_teacher.client import TeacherClient

    t = time.perf_counter()
    with TeacherClient(target, retry_timeout=0) as c:
        c.score([("after", list(range(1, 65)), 16)])
    request_s = time.perf_counter() - t
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        samples.append(rss_mib(pid))
        time.sleep(RSS_INTERVAL_S)
    return float(np.median(samples)), request_s


def _sequences(rng: np.random.Generator, n_seqs: int, length: int) -> list[tuple[str, list[int], int]]:
    return [(f"s{i}", rng.integers(0, 49152, length).tolist(), length // 4) for i in range(n_seqs)]


async def _drive(target: str, pid: int, clients: int, seconds: float, n_seqs: int, length: int, retry: bool) -> PhaseResult:
    from eopd_teacher.client import AsyncTeacherClient, RequestFailed, ScoreBatch

    res = PhaseResult(seconds)
    # Every client connects before the clock starts (64 channels connecting at once is a connection
    # storm, not sustained load): the phase's `stop` is set once all are connected.
    stop = float("inf")
    connected, go = asyncio.Queue(), asyncio.Event()
    scored_per_req = n_seqs * (length - length // 4)

    async def connect(c) -> None:
        t = time.perf_counter()
        await c.wait_connected(120)
        res.connect_s = max(res.connect_s, time.perf_counter() - t)
        connected.put_nowait(1)
        await go.wait()

    async def unary_client(i: int) -> None:
        rng = np.random.default_rng(i)
        backoff = 0.05
        async with AsyncTeacherClient(target, retry_timeout=30 if retry else 0, retry_overload=retry, client_id=f"load-{i}") as c:
            await connect(c)
            while time.monotonic() < stop:
                t = time.perf_counter()
                try:
                    await c.score(_sequences(rng, n_seqs, length), timeout=60)
                    res.ok("unary", scored_per_req, time.perf_counter() - t)
                    backoff = 0.05
                except grpc.aio.AioRpcError as err:
                    res.error(err)  # the same backoff as the streaming clients: neither mode crowds out the other
                    await asyncio.sleep(min(backoff, max(0.0, stop - time.monotonic())))
                    backoff = min(backoff * 2, 1.0)

    async def stream_client(i: int) -> None:
        """One stream at a time, 2 requests in flight; after an error (a shed stream, a refused
        request) the client re-opens its stream with exponential backoff (50 ms doubling to 1 s,
        reset by an answer), as the rollout worker does, until the phase ends."""
        rng = np.random.default_rng(10_000 + i)
        sent: dict[str, float] = {}
        k = 0

        async def batches():
            nonlocal k
            while time.monotonic() < stop:
                rid = f"c{i}-{k}"
                k += 1
                sent[rid] = time.perf_counter()
                yield ScoreBatch(rid, _sequences(rng, n_seqs, length))

        backoff = 0.05
        async with AsyncTeacherClient(target, retry_timeout=30 if retry else 0, retry_overload=retry, client_id=f"load-{i}") as c:
            await connect(c)
            first = True
            while time.monotonic() < stop:
                if not first:
                    res.reopened += 1
                first = False
                try:
                    async for rid, _ in c.score_stream(batches(), max_in_flight=2):
                        res.ok("stream", scored_per_req, time.perf_counter() - sent.pop(rid))
                        backoff = 0.05
                except (grpc.aio.AioRpcError, RequestFailed) as err:  # the stream ended, or a request failed in band
                    res.error(err)
                    sent.clear()  # what was in flight on the failed stream is not answered
                    await asyncio.sleep(min(backoff, max(0.0, stop - time.monotonic())))
                    backoff = min(backoff * 2, 1.0)

    async def sample_rss() -> None:
        nonlocal stop
        for _ in range(clients):
            await connected.get()
        stop = time.monotonic() + seconds
        go.set()
        while time.monotonic() < stop:
            res.rss.append(rss_mib(pid))
            await asyncio.sleep(RSS_INTERVAL_S)
        res.rss.append(rss_mib(pid))

    tasks = [unary_client(i) if i % 2 == 0 else stream_client(i) for i in range(clients)]
    await asyncio.gather(sample_rss(), *tasks)
    return res


def _phase(target: str, pid: int, clients: int, seconds: float, n_seqs: int, length: int) -> dict:
    """A warm-up of the same load, the server's memory at rest, the measured phase, and its memory
    at rest again (`rss_mib_at_rest`: before, after). The request that settles the server after
    the phase is the recovery request: after an overload it must be served promptly."""
    warm = asyncio.run(_drive(target, pid, clients, WARMUP_S, n_seqs, length, retry=False))
    before, _ = rss_at_rest_mib(target, pid)
    out = asyncio.run(_drive(target, pid, clients, seconds, n_seqs, length, retry=False)).summary()
    after, out["recovery_request_s"] = rss_at_rest_mib(target, pid)
    out["rss_mib_at_rest"] = [round(before, 1), round(after, 1)]
    out["warmup_codes"] = dict(warm.codes)
    # The bound on the peak counts from the cold server, over the warm-up and the phase.
    out["rss_mib_start"], out["rss_mib_max"] = warm.rss[0], max(warm.rss + [out["rss_mib_max"]])
    return out


def run_load(target: str, pid: int, *, clients: int, seconds: float, n_seqs: int = 2, length: int = 64) -> dict:
    return _phase(target, pid, clients, seconds, n_seqs, length)


def run_overload(target: str, pid: int, *, clients: int, seconds: float) -> dict:
    """Many clients with large requests and no client retries against a small queue."""
    return _phase(target, pid, clients, seconds, n_seqs=8, length=256)


@contextlib.contextmanager
def running_teacher(model: str, *extra: str, timeout: float = 180.0) -> Iterator:
    """`eopd-teacher serve` on port 0 (its ports read from its ports file), stopped on exit."""
    from eopd_trainer.job.supervisor import Supervisor
    from eopd_trainer.job.teacher_proc import start_teacher

    sup = Supervisor(Path(tempfile.mkdtemp(prefix="eopd-bench-load-")))
    try:
        teacher = start_teacher(sup, model, *extra, insecure_no_auth=True)
        teacher.wait_ready(timeout)
        yield teacher
    finally:
        sup.stop_all()


def rss_text(r: dict) -> str:
    """Cold -> at rest after the warm-up -> the peak -> at rest after the phase, MiB."""
    before, after = r["rss_mib_at_rest"]
    return f"{r['rss_mib_start']:.0f} -> {before:.0f} -> {r['rss_mib_max']:.0f} -> {after:.0f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--overload-seconds", type=float, default=15)
    p.add_argument("--model", default="tiny-random")
    args = p.parse_args(argv)
    with running_teacher(args.model) as proc:
        load = run_load(proc.target, proc.popen.pid, clients=args.clients, seconds=args.seconds)
    with running_teacher(args.model, "--max-queue-tokens", "16384", "--max-inflight-tokens-per-client", "4096") as proc:
        over = run_overload(proc.target, proc.popen.pid, clients=args.clients, seconds=args.overload_seconds)
    print(json.dumps({"load": load, "overload": over}, indent=2))
    rows = [
        ["sustained", args.clients, f"{load['seconds']:.0f}", f"{load['requests_per_s']:.1f}", f"{load['scored_tokens_per_s']:.0f}",
         f"{load['p50_ms']:.0f}", f"{load['p99_ms']:.0f}", json.dumps(load["codes"]), rss_text(load)],
        ["overload", args.clients, f"{over['seconds']:.0f}", f"{over['requests_per_s']:.1f}", f"{over['scored_tokens_per_s']:.0f}",
         f"{over['p50_ms']:.0f}", f"{over['p99_ms']:.0f}", json.dumps(over["codes"]), rss_text(over)],
    ]
    for row, r in zip(rows, (load, over), strict=True):
        row.insert(8, f"{r['requests_by_mode']['unary']} / {r['requests_by_mode']['stream']}")
    table = markdown_table(["phase", "clients", "s", "req/s", "scored tok/s", "p50 ms", "p99 ms", "answers", "unary / stream answered", "server RSS MiB (cold -> rest -> peak -> rest)"], rows)
    write_results("load", {"load": load, "overload": over, "model": args.model})
    write_section("load", f"""## Teacher under load (issue 8)

`.venv/bin/python -m bench.load_test --clients {args.clients} --seconds {args.seconds:.0f}` on {machine_description()}.
Model {args.model}; half the clients unary, half streaming (2 in flight each; a stream that fails is re-opened with backoff); sustained: 2 x 64-token sequences per
request, client retries off (every error counts); each phase after a {WARMUP_S:.0f} s warm-up of the same load; overload: 8 x 256-token sequences against a 16k-token queue and a 4k
per-client limit, no retries; recovery time of a normal request afterwards: {over['recovery_request_s'] * 1000:.0f} ms.

{table}
""")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
