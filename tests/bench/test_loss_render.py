"""Pure logic of bench/bench_loss.py's report: paired per-round ratios, each fast path divided by its
own naive baseline, no ratio across runs or machines, merges refused across CPU models."""

from __future__ import annotations

import statistics

import pytest

from bench import bench_loss

SHAPE = {"batch": 2, "seq": 4, "vocab": 8, "hidden": 2, "k": 2, "chunk": 4}


def _timing(rounds: dict[str, list[float]]) -> dict:
    return {v: {"all_s": xs, "all_cpu_s": [2 * x for x in xs], "best_s": min(xs), "median_s": statistics.median(xs),
                "best_cpu_s": 2 * min(xs)} for v, xs in rounds.items()}


def _memory(variants, base=100.0) -> dict:
    return {v: {"extra_peak_mib": base + (10.0 if "fkl" in v else 2.0 if v.startswith("eopd") else 0.0)} for v in variants}


def _payload(runs: dict[str, dict]) -> dict:
    naive = {"opd": [4.0, 8.0, 4.0], "eopd": [5.0, 8.8, 4.8], "full_fkl": [6.0, 12.0, 6.0]}
    fast = {"opd": [1.0, 2.0, 1.0], "eopd": [1.1, 2.6, 1.02], "full_fkl": [1.2, 2.0, 1.3], "eopd+metrics": [1.1, 2.2, 1.1]}
    paths = ["naive", "chunked", "naive_hidden", "hidden"]
    timing = {"naive": _timing(naive), "chunked": _timing(fast),
              "naive_hidden": _timing({k: [3 * x for x in v] for k, v in naive.items()}),
              "hidden": _timing({k: [2 * x for x in v] for k, v in fast.items()})}
    memory = {p: _memory(bench_loss._memory_variants(p)) for p in paths}
    return {"shape": SHAPE, "gate_ratio": 0.2, "reps": 3, "paths": paths, "timing": timing, "memory": memory, "runs": runs}


def _run(run_id="r1", cpu="CPU A"):
    return {"run_id": run_id, "cpu": cpu, "commit": "c" * 40, "describe": "abc"}


def test_ratios_are_medians_of_per_round_ratios():
    _, _, _, rows = bench_loss.render(_payload({p: _run() for p in bench_loss.PATHS}))
    by = {(r["path"], r["variant"]): r for r in rows}
    # chunked eopd / opd per round: 1.1, 1.3, 1.02 -> median 1.1 (best-of would give 1.02 / 1.0).
    expected = statistics.median(a / b for a, b in zip([1.1, 2.6, 1.02], [1.0, 2.0, 1.0]))
    assert by[("chunked", "eopd")]["time_vs_opd"] == pytest.approx(expected)
    assert by[("chunked", "eopd")]["rounds"] == 3
    # full_fkl per round 1.2, 1.0, 1.3 -> 1.2: not best-of (1.2 / 1.0)
    assert by[("chunked", "full_fkl")]["time_vs_opd"] == pytest.approx(1.2)
    assert by[("chunked", "eopd")]["time_s"] == pytest.approx(1.1)


def test_hidden_is_divided_by_naive_hidden_not_naive():
    _, _, _, rows = bench_loss.render(_payload({p: _run() for p in bench_loss.PATHS}))
    by = {(r["path"], r["variant"]): r for r in rows}
    # hidden = 2 x fast; naive_hidden = 3 x naive: hidden opd / naive_hidden opd = 2 * 1 / (3 * 4) per round.
    assert by[("hidden", "opd")]["time_vs_naive"] == pytest.approx(2 / 12)
    assert by[("chunked", "opd")]["time_vs_naive"] == pytest.approx(1 / 4)
    assert by[("naive", "opd")]["time_vs_naive"] is None


def test_no_ratio_across_runs_or_machines():
    runs = {"naive": _run("r0", "CPU B"), "naive_hidden": _run("r0", "CPU B"), "chunked": _run(), "hidden": _run()}
    headers, table, _, rows = bench_loss.render(_payload(runs))
    assert all(r["time_vs_naive"] is None for r in rows)
    col = headers.index("time / own naive (paired)")
    assert {row[col] for row in table if row[0] in ("chunked", "hidden") and "metrics" not in row[1]} == {"- (1)"}
    # Same machine, different run ids: not comparable either.
    assert not bench_loss.comparable(_run("r0"), _run("r1")) and bench_loss.comparable(_run(), _run())


def test_memory_rows_cover_the_learner_default_and_temperature():
    _, _, verdicts, rows = bench_loss.render(_payload({p: _run() for p in bench_loss.PATHS}))
    variants = {r["variant"] for r in rows if r["path"] == "hidden"}
    assert {"eopd+metrics", "full_fkl+metrics", "eopd+metrics+T0.7"} <= variants
    fkl = {r["variant"]: r["fkl_extra_mib"] for r in rows if r["path"] == "hidden"}
    assert fkl["eopd+metrics"] == pytest.approx(2.0) and fkl["full_fkl+metrics"] == pytest.approx(10.0)  # vs opd+metrics
    assert any("learner default" in v for v in verdicts)
    assert bench_loss.parse_variant("eopd+metrics+T0.7") == ("eopd", True, 0.7)
    with pytest.raises(ValueError, match="modifier"):
        bench_loss.parse_variant("eopd+bogus")


def test_merge_refused_across_cpu_models():
    old = _payload({"naive": _run("r0", "Intel Xeon"), "chunked": _run("r0", "Intel Xeon"),
                    "naive_hidden": _run("r0", "Intel Xeon"), "hidden": _run("r0", "Intel Xeon")})
    with pytest.raises(SystemExit, match="another machine"):
        bench_loss.check_merge(old, SHAPE, 3, "AMD EPYC")
    with pytest.raises(SystemExit, match="shape"):
        bench_loss.check_merge(old, SHAPE, 5, "Intel Xeon")
    bench_loss.check_merge(old, SHAPE, 3, "Intel Xeon")  # same machine: allowed


def test_legacy_measured_at_strings_are_parsed():
    payload = {"measured_at": {"naive": "2026-11-22T01:46:54Z (Intel(R) Xeon(R) Processor, 2 cores, 24 GiB, eopd@87d9b8c)"},
               "machine": "AMD EPYC, 2 cores", "time": "t"}
    r = bench_loss.path_run(payload, "naive")
    assert r["cpu"] == "Intel(R) Xeon(R) Processor" and r["run_id"] == "2026-11-22T01:46:54Z" and r["describe"] == "87d9b8c"


def test_issue31_verdict_compares_hidden_with_naive_hidden_time_and_memory():
    """The fused path's verdict (issue 31): paired CPU-time ratio to naive_hidden within 1.2 and its
    peak memory as a share of naive_hidden's, per variant."""
    payload = _payload({p: _run() for p in bench_loss.PATHS})
    payload["memory"]["hidden"] = {v: {"extra_peak_mib": 4.0} for v in payload["memory"]["hidden"]}
    _, _, verdicts, rows = bench_loss.render(payload)
    row = next(r for r in rows if r["path"] == "hidden" and r["variant"] == "opd")
    assert row["cpu_vs_naive"] == pytest.approx(statistics.median([2 * 1.0 / 12.0, 2 * 2.0 / 24.0, 2 * 1.0 / 12.0]))
    assert row["mem_vs_naive"] == pytest.approx(0.04)
    line = next(v for v in verdicts if v.startswith("[hidden vs naive_hidden, opd]"))
    assert "target <= 1.2: met on CPU time" in line and "target <= 5%: met" in line
