"""64 concurrent clients, unary and streaming, for 60 s against the real server: zero errors,
bounded memory; beyond capacity it sheds with RESOURCE_EXHAUSTED and recovers."""

from __future__ import annotations

import pytest

from bench.load_test import run_load, run_overload

# The server's working set (model, one [chunk, vocab] float32 block of statistics, batch
# activations) is reached within seconds; after that resident memory must stop growing.
WORKING_SET_MIB = 700


def assert_bounded(series: list[float]) -> None:
    half = len(series) // 2
    assert max(series) < series[0] + WORKING_SET_MIB, series
    assert max(series[half:]) <= max(series[:half]) + 64, f"resident memory keeps growing: {series}"
from tests.procs import running_teacher

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_sustained_load_zero_errors_bounded_memory():
    with running_teacher("tiny-random") as proc:
        r = run_load(proc.target, proc.popen.pid, clients=64, seconds=60)
    print(r)
    assert set(r["codes"]) == {"OK"} and r["requests"] > 100
    assert_bounded(r["rss_mib_series"])


def test_overload_sheds_and_recovers():
    with running_teacher("tiny-random", "--max-queue-tokens", "16384", "--max-inflight-tokens-per-client", "4096") as proc:
        r = run_overload(proc.target, proc.popen.pid, clients=64, seconds=15)
        assert proc.alive()
    print(r)
    assert r["codes"].get("RESOURCE_EXHAUSTED", 0) > 0 and r["codes"].get("OK", 0) > 0
    assert set(r["codes"]) <= {"OK", "RESOURCE_EXHAUSTED"}, (r["codes"], r["messages"])
    assert_bounded(r["rss_mib_series"])
    assert r["recovery_request_s"] < 5.0
