"""The head-to-head's systems (bench/e2e_systems.py): every one has a name in the report, and every
eopd system's overrides make a valid configuration of the preset it trains (a typo in an override
would only surface minutes into a benchmark run)."""

from __future__ import annotations

import pytest

from bench.e2e_report import LABELS
from bench.e2e_systems import EOPD_SYSTEMS, LAYOUTS, SYSTEMS
from eopd_trainer.config import load_config
from tests.procs import ROOT


def test_every_system_has_a_label():
    assert set(SYSTEMS) <= set(LABELS)


@pytest.mark.parametrize("system", sorted(EOPD_SYSTEMS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_eopd_system_is_a_valid_configuration(system, layout):
    cfg = load_config(ROOT / "configs" / "smollm2-cpu.yaml", [*EOPD_SYSTEMS[system], *LAYOUTS[layout]])
    for item in EOPD_SYSTEMS[system]:
        key, value = item.split("=", 1)
        if key == "per_loss":  # not a setting of the run: which of the preset's per-loss entries apply
            continue
        *sections, field = key.split(".")
        owner = cfg
        for section in sections:
            owner = getattr(owner, section)
        assert str(getattr(owner, field)) == str(type(getattr(owner, field))(value))


def test_the_inherit_system_is_trl_gkd_with_openmps_default_wait_policy():
    base = load_config(ROOT / "configs" / "smollm2-cpu.yaml", list(EOPD_SYSTEMS["eopd-trl-gkd"]))
    inherit = load_config(ROOT / "configs" / "smollm2-cpu.yaml", list(EOPD_SYSTEMS["eopd-trl-gkd-inherit"]))
    assert base.threads.omp_wait_policy == "passive" and inherit.threads.omp_wait_policy == "inherit"
    assert base.model_copy(update={"threads": inherit.threads}) == inherit


def _settings(**given) -> dict:
    """bench_e2e's settings of the preset (8 prompts x 2 responses, 2 steps per iteration), as its
    `settings()` computes them from given iterations and checkpoint spacing."""
    iterations, save_every = given.get("iterations") or 32, given.get("save_every") or max(1, (given.get("iterations") or 32) // 4)
    return {"preset_path": str(ROOT / "configs" / "smollm2-cpu.yaml"), "eopd_overrides": list(given.get("overrides", ())),
            "iterations_given": given.get("iterations"), "save_every_given": given.get("save_every"),
            "steps": iterations * 2, "steps_per_iteration": 2, "save_every_steps": save_every * 2}


def test_given_iterations_train_every_system_for_the_same_optimizer_steps():
    from bench.e2e_systems import eopd_layout

    # gkd's own default layout is TRL's (one step per iteration): twice the iterations, the same 16 steps
    assert eopd_layout("eopd-trl-gkd", _settings(iterations=8, save_every=4)) == {
        "samples_per_prompt": 1, "prompts_per_iteration": 8, "steps_per_iteration": 1, "batch_size": 8,
        "iterations": 16, "save_every": 8, "mode": "sync"}
    eopd = eopd_layout("eopd", _settings(iterations=8, save_every=4))
    assert (eopd["steps_per_iteration"], eopd["iterations"], eopd["save_every"]) == (2, 8, 4)
    trl = eopd_layout("eopd", _settings(iterations=8, save_every=4, overrides=LAYOUTS["trl"]))
    assert (trl["steps_per_iteration"], trl["iterations"], trl["save_every"]) == (1, 16, 8)
    # the mode is the run's own record (the time split and the section's text read it there)
    lagged = eopd_layout("eopd", _settings(iterations=8, save_every=4, overrides=LAYOUTS["trl-async"]))
    assert lagged == trl | {"mode": "async"} and trl["mode"] == "sync"
    # nothing given: each system's own configuration (64 one-step iterations for gkd, 32 two-step for eopd)
    assert eopd_layout("eopd-trl-gkd", _settings())["iterations"] == 64
    assert eopd_layout("eopd", _settings())["iterations"] == 32


def test_the_async_system_is_trl_gkd_in_async_mode():
    base = load_config(ROOT / "configs" / "smollm2-cpu.yaml", list(EOPD_SYSTEMS["eopd-trl-gkd"]))
    overlapped = load_config(ROOT / "configs" / "smollm2-cpu.yaml", list(EOPD_SYSTEMS["eopd-trl-gkd-async"]))
    assert base.mode == "sync" and overlapped.mode == "async"
    assert base.model_copy(update={"mode": "async"}) == overlapped
