"""bench_busy_job's pure parts: the section from a measurement's summary (every setting a row, its
overrides named, ratios over the default `passive`)."""

from __future__ import annotations

from bench.bench_busy_job import SETTINGS, section_text


def _data() -> dict:
    settings = {name: {"alone_s": 10.0 + i, "beside_s": 20.0 + 2 * i, "ratio": (20.0 + 2 * i) / (10.0 + i),
                       "sampling_s": 3.0 - i, "steps_s": 5.0} for i, name in enumerate(SETTINGS)}
    return {"preset": "smollm2-cpu", "iterations": 6, "overrides": ["loss.variant=gkd"], "cores": 2, "rounds": [{}],
            "settings": settings, "load_avg": "0.1 -> 2.0"}


def test_section_names_every_setting_and_its_overrides():
    text = section_text(_data())
    for name, overrides in SETTINGS.items():
        assert f"| {name} | {' '.join(overrides)} |" in text
    assert "train.iterations=6 eval.enabled=false loss.variant=gkd SETTING" in text
    assert "threads.rollout=1" in text


def test_ratios_are_over_passive():
    text = section_text(_data())
    # passive is SETTINGS' second entry: alone 11, beside 22; inherit 10 / 20; the third 12 / 24
    assert "inherit 0.91x / 0.91x" in text
    assert "passive, sampler 1 thread 1.09x / 1.09x" in text
