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


def assert_bounded(series: list[float]) -> None:
    """Below the start plus the working set throughout, and not growing: a leak holds what it took
    between score chunks as well as during them, so it lifts the second half's floor (its lowest
    sample) *and* its ceiling (its highest) above the first half's, both after the first tenth (the
    allocator's arenas and gRPC's buffers grow in the first seconds). Resident memory swings by
    100-250 MiB from one quarter second to the next as chunks are allocated and freed, so one end
    alone moves by chance: a CI run failed on medians 611 -> 666 MiB while its troughs were 591 and
    595 MiB, and a rehearsal on troughs 536 -> 599 MiB while its peaks stayed at 765 and 767 MiB
    (the allocator keeping freed pages, not a leak: a leak lifts every sample). Growth is a floor
    more than 48 MiB higher with a ceiling more than 24 MiB higher (the peaks are the corroboration,
    so their margin is smaller: 4 MiB held per sample lifts a 16-sample series' peaks by ~43 MiB).
    Sampled four times a second (bench/load_test.py), each half of a 15 s run sees several chunks."""
    assert max(series) < series[0] + working_set_mib(), (working_set_mib(), series)
    warm = series[1 + len(series) // 10 :]
    half = len(warm) // 2
    first, second = min(warm[:half]), min(warm[half:])
    top_first, top_second = max(warm[:half]), max(warm[half:])
    assert second <= first + 48 or top_second <= top_first + 24, (
        f"resident memory keeps growing (floor {first:.0f} -> {second:.0f} MiB, ceiling {top_first:.0f} -> "
        f"{top_second:.0f} MiB): {series}")


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
    assert set(r["codes"]) == {"OK"} and r["requests"] > 100
    # both client modes made progress (a dead stream would otherwise hide behind the unary count)
    assert r["requests_by_mode"]["unary"] > 50 and r["requests_by_mode"]["stream"] > 50, r["requests_by_mode"]
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
    # Streams refused while shed are re-opened (with backoff) rather than given up. Their answers
    # are reported, not asserted: at this overload (~5% admission) a stream whose request is refused
    # ends with RESOURCE_EXHAUSTED and loses its other in-flight request, so few streams get an
    # answer in 15 s (measured: unary 30, stream 1); sustained load asserts both modes.
    assert r["requests_by_mode"]["unary"] > 0 and r["streams_reopened"] > 0, r


def test_memory_bound_tells_a_leak_from_the_chunk_swing():
    """The check itself, on the series of the CI run whose medians moved 611 -> 666 MiB (no leak: its
    troughs stayed at 591-595 MiB), and on the same series with 4 MiB more held after every sample."""
    ci = [570.0, 687.4, 591.2, 590.9, 594.2, 611.4, 612.1, 680.6, 643.7, 689.4, 688.3, 625.0, 688.2, 623.9, 594.8, 691.7]
    assert_bounded(ci)
    leaking = [x + 4 * i for i, x in enumerate(ci)]
    with pytest.raises(AssertionError, match="keeps growing"):
        assert_bounded(leaking)
    # The rehearsal's overload run: troughs 536 -> 599 MiB, peaks 765 -> 767 MiB (no leak); leaking 2 MiB a sample, it fails.
    rehearsal = [509.4, 640.2, 662.3, 641.4, 562.5, 647.1, 643.7, 713.9, 549.7, 740.0, 686.5, 606.5, 765.0, 601.6, 735.0,
                 645.4, 642.9, 712.5, 546.1, 536.4, 586.6, 762.6, 635.3, 699.5, 680.9, 637.0, 637.6, 556.1, 634.6, 761.9,
                 580.2, 700.9, 637.1, 638.4, 637.9, 632.2, 740.9, 691.4, 657.5, 669.1, 636.0, 699.7, 599.1, 637.6, 703.2,
                 605.9, 700.8, 698.6, 643.9, 752.7, 723.1, 724.6, 690.4, 635.9, 636.4, 760.5, 637.4, 638.3, 701.1, 767.2,
                 638.6]
    assert_bounded(rehearsal)
    with pytest.raises(AssertionError, match="keeps growing"):
        assert_bounded([x + 2 * i for i, x in enumerate(rehearsal)])
