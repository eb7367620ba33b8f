"""64 concurrent clients, unary and streaming, for 60 s against the real server: zero errors,
bounded memory; beyond capacity it sheds with RESOURCE_EXHAUSTED and recovers."""

from __future__ import annotations

import pytest

from bench.load_test import run_load, run_overload
from tests.procs import running_teacher


def working_set_mib() -> float:
    """What the server may add to its resident memory under load, from its settings: the scoring
    of one chunk holds two [chunk_size, vocab] float32 blocks (the logits and their log-softmax;
    tiny-random's vocabulary is SmolLM2's 49152): 2 x 1024 x 49152 x 4 B = 384 MiB, plus 16 MiB
    for the tiny model's activations, gRPC buffers and the admitted queue (max_queue_tokens of
    int32 ids: 4 MiB at the default). Measured (bench/results/load.json): +220 MiB sustained, +270
    MiB overloaded. Reached within seconds; after that memory must stop growing."""
    from eopd_teacher.settings import TeacherSettings

    chunk = TeacherSettings.model_fields["chunk_size"].default
    return 2 * chunk * 49152 * 4 / 2**20 + 16


# What the server may keep at rest after a phase beyond what it kept at rest after the warm-up.
# Measured (2026-12-04, 2-core Xeon): +3.1 MiB after the sustained phase (522.6 -> 525.7 MiB, 1740
# answers), +4.8 MiB after the overload (518.7 -> 523.5 MiB, 1158 answers and refusals). What it
# catches: anything chunk-sized kept even once (one [chunk_size, vocab] float32 block is 192 MiB),
# or more than ~19 KB kept per answer of the sustained phase (about one answer's own scores: 96
# scored tokens x ~136 B); a smaller leak needs a longer phase than CI runs.
REST_GROWTH_MIB = 32


def assert_bounded(r: dict) -> None:
    """Below the cold server's memory plus the working set throughout the warm-up and the phase, and not
    growing: at rest (nothing in flight, tests bench/load_test.py:rss_at_rest_mib) after the phase
    within REST_GROWTH_MIB of at rest after the warm-up. Under load, resident memory swings by
    100-250 MiB from one quarter second to the next as chunks are allocated and freed, which
    made a growth check on the samples taken *during* the phase flaky (a rehearsal failed on
    floor 540 -> 603 MiB, ceiling 734 -> 767 MiB with no leak); at rest the score chunks are freed."""
    before, after = r["rss_mib_at_rest"]
    assert r["rss_mib_max"] < r["rss_mib_start"] + working_set_mib(), (working_set_mib(), r["rss_mib_start"], r["rss_mib_series"])
    assert after <= before + REST_GROWTH_MIB, f"resident memory at rest grew {before:.0f} -> {after:.0f} MiB: {r['rss_mib_series']}"


pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.serial]  # 64 clients against deadlines: the whole machine


def test_sustained_load_zero_errors_bounded_memory():
    """The clients connect before the clock starts (bench/load_test.py): in two CI runs, 28 unary
    requests missed their 60 s deadline and the slowest stream answer took 63 s (Linux's SYN
    retransmissions add up to 63 s) while the median answer took 0.2 s. That is the signature of
    connections that were slow to open, not of requests starved by the server. `connect_s_max`
    and `slowest_ms_by_mode` in the printed result tell which."""
    with running_teacher("tiny-random") as proc:
        r = run_load(proc.target, proc.popen.pid, clients=64, seconds=60)
    print(r)
    assert set(r["codes"]) == {"OK"} and set(r["warmup_codes"]) == {"OK"} and r["requests"] > 100
    # both client modes made progress (a dead stream would otherwise hide behind the unary count)
    assert r["requests_by_mode"]["unary"] > 50 and r["requests_by_mode"]["stream"] > 50, r["requests_by_mode"]
    assert_bounded(r)


def test_overload_sheds_and_recovers():
    with running_teacher("tiny-random", "--max-queue-tokens", "16384", "--max-inflight-tokens-per-client", "4096") as proc:
        r = run_overload(proc.target, proc.popen.pid, clients=64, seconds=15)
        assert proc.alive()
    print(r)
    assert r["codes"].get("RESOURCE_EXHAUSTED", 0) > 0 and r["codes"].get("OK", 0) > 0
    assert set(r["codes"]) | set(r["warmup_codes"]) <= {"OK", "RESOURCE_EXHAUSTED"}, (r["codes"], r["messages"])
    assert_bounded(r)
    assert r["recovery_request_s"] < 5.0
    # Streams refused while shed are re-opened (with backoff) rather than given up. Their answers
    # are reported, not asserted: at this overload (~5% admission) a stream whose request is refused
    # ends with RESOURCE_EXHAUSTED and loses its other in-flight request, so few streams get an
    # answer in 15 s (measured: unary 30, stream 1); sustained load asserts both modes.
    assert r["requests_by_mode"]["unary"] > 0 and r["streams_reopened"] > 0, r
