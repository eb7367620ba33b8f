"""The learner's start-up errors: eopd's own refusals are one line; one raised inside a library keeps
its traceback in the log (the learner's first GPU run died on "invalid literal for int() with base 10:
'0a'" from inside a library, with nothing saying where)."""

from __future__ import annotations

import json

import pytest

from eopd_trainer.config.load import load_config
from eopd_trainer.learner.cli import raised_outside_eopd
from eopd_trainer.learner.distributed import build_ds_config
from tests.procs import ROOT


def test_error_raised_in_eopd_code_is_ours():
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    cfg.train.deepspeed["scheduler"] = {"type": "WarmupLR"}
    with pytest.raises(ValueError, match="scheduler") as info:
        build_ds_config(cfg, 1, 8)
    assert not raised_outside_eopd(info.value)


def test_error_raised_in_a_library_is_not():
    with pytest.raises(ValueError) as info:
        json.loads("{")
    assert raised_outside_eopd(info.value)
    assert not raised_outside_eopd(ValueError("never raised"))
