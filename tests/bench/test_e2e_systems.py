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
        section, field = key.split(".")
        assert str(getattr(getattr(cfg, section), field)) == str(type(getattr(getattr(cfg, section), field))(value))


def test_the_inherit_system_is_trl_gkd_with_openmps_default_wait_policy():
    base = load_config(ROOT / "configs" / "smollm2-cpu.yaml", list(EOPD_SYSTEMS["eopd-trl-gkd"]))
    inherit = load_config(ROOT / "configs" / "smollm2-cpu.yaml", list(EOPD_SYSTEMS["eopd-trl-gkd-inherit"]))
    assert base.threads.omp_wait_policy == "passive" and inherit.threads.omp_wait_policy == "inherit"
    assert base.model_copy(update={"threads": inherit.threads}) == inherit
