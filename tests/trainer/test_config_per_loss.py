"""`per_loss` (config/load.py, issue 47 ask 2): a preset's settings that one loss wants other than
its general ones (its data layout), applied when `loss.variant` names that loss, over the file and
under every override; the effective config a run writes is complete without it."""

from __future__ import annotations

import pytest
import yaml

from eopd_trainer.config import ConfigError, dump_config, load_config, loss_defaults_note

GKD_LAYOUT = {"rollout": {"n_samples": 1}, "train": {"batch_size": 8, "mini_batch_size": 8, "iterations": 64}}


@pytest.fixture
def preset(tmp_path):
    """The tiny preset with a gkd entry (8 prompts x 1 response per step, 64 iterations)."""
    from tests.procs import ROOT

    data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    data["run_dir"] = str(tmp_path / "run")
    data["train"].update(batch_size=8, mini_batch_size=4, iterations=12)
    data["rollout"]["n_samples"] = 2
    data["per_loss"] = {"gkd": GKD_LAYOUT}
    path = tmp_path / "preset.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def layout(cfg):
    return cfg.rollout.n_samples, cfg.train.batch_size, cfg.train.mini_batch_size, cfg.train.iterations


def test_the_named_loss_gets_its_settings_and_the_others_the_files(preset):
    assert layout(load_config(preset)) == (2, 8, 4, 12)  # the default loss, eopd: no entry
    assert layout(load_config(preset, ["loss.variant=opd"])) == (2, 8, 4, 12)
    assert layout(load_config(preset, ["loss.variant=gkd"])) == (1, 8, 8, 64)


def test_overrides_beat_the_losss_settings(preset, monkeypatch):
    cfg = load_config(preset, ["loss.variant=gkd", "train.iterations=48"])
    assert layout(cfg) == (1, 8, 8, 48)
    assert load_config(preset, ["loss.variant=gkd", "per_loss.gkd.train.iterations=40"]).train.iterations == 40
    assert layout(load_config(preset, ["loss.variant=gkd", "per_loss={}"])) == (2, 8, 4, 12)  # turned off
    monkeypatch.setenv("EOPD_RUN_LOSS__VARIANT", "gkd")  # the environment names the loss: the same
    assert layout(load_config(preset)) == (1, 8, 8, 64)


def test_the_written_config_is_complete_without_it(preset, tmp_path):
    """run.yaml (dump_config) has no per_loss, and reloading it changes nothing: the children of
    `eopd run` and a resumed run load exactly what the run trained with."""
    cfg = load_config(preset, ["loss.variant=gkd", "train.iterations=48"])
    text = dump_config(cfg)
    assert "per_loss" not in text
    written = tmp_path / "run.yaml"
    written.write_text(text)
    assert load_config(written) == cfg


def test_the_run_says_what_it_took(preset):
    assert loss_defaults_note(preset, [], load_config(preset)) is None
    given = ["loss.variant=gkd", "train.iterations=48"]
    note = loss_defaults_note(preset, given, load_config(preset, given))
    assert note == ("loss gkd's own settings (per_loss.gkd in the config): rollout.n_samples=1, train.batch_size=8, "
                    "train.iterations=64 (overridden: 48), train.mini_batch_size=8")  # the file's order (sorted here)


@pytest.mark.parametrize("entry, message", [
    ({"gkdd": GKD_LAYOUT}, "per_loss.gkdd: not a loss variant"),
    ({"gkd": {"train": {"batch_sise": 8}}}, "per_loss.gkd: invalid run config:\n  train.batch_sise: unknown key"),
    ({"gkd": {"train": {"batch_size": 6}}}, "per_loss.gkd: invalid run config"),  # not a multiple of the mini-batch
    ({"gkd": {"loss": {"variant": "opd"}}}, "per_loss.gkd: cannot set loss.variant"),
    ({"gkd": [1, 2]}, "per_loss.gkd: a partial config (a mapping)"),
])
def test_every_entry_is_checked_whichever_loss_runs(preset, entry, message):
    data = yaml.safe_load(preset.read_text())
    data["per_loss"] = entry
    preset.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as exc:
        load_config(preset)  # the default loss: the entry is checked all the same
    assert message in str(exc.value)


def test_an_entry_is_checked_with_what_the_overrides_give(preset):
    """A file valid only with its overrides (here a batch that the mini-batch does not divide until
    overridden) does not make a valid entry an error."""
    data = yaml.safe_load(preset.read_text())
    data["train"]["batch_size"] = 6
    data["per_loss"] = {"opd": {"train": {"iterations": 3}}}
    preset.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="must be a multiple"):
        load_config(preset)
    assert load_config(preset, ["train.batch_size=8", "loss.variant=opd"]).train.iterations == 3


def test_overrides_for_the_runs_loss_need_not_suit_another_entry(tmp_path):
    """bench_e2e's `eopd-trl-gkd` (gkd at TRL's layout, 64 iterations, a checkpoint every 16) was
    refused by the default preset's *other* entry: eopd_rkl's batch of 16 x 16 iterations per
    checkpoint was over the stream's backlog bound (the preset's eopd_rkl entry as it was before it
    took TRL's layout too). Only the run's own loss must hold with them."""
    from tests.procs import ROOT

    data = yaml.safe_load((ROOT / "configs" / "smollm2-cpu.yaml").read_text())
    data["per_loss"]["eopd_rkl"] = {"loss": {"support": "full"}}  # the preset's layout: 16 responses an iteration
    path = tmp_path / "preset.yaml"
    path.write_text(yaml.safe_dump(data))
    given = ["loss.variant=gkd", "checkpoint.every=16", "checkpoint.keep=64"]
    cfg = load_config(path, given)
    assert (cfg.loss.variant, cfg.train.batch_size, cfg.checkpoint.every) == ("gkd", 8, 16)
    with pytest.raises(ConfigError, match="queue.max_backlog .* must be at least train.batch_size x checkpoint.every"):
        load_config(path, ["checkpoint.every=16"])  # the default loss's own layout with them: refused


def test_the_default_preset_trains_its_measured_loss_and_keeps_the_others_as_they_were():
    """configs/smollm2-cpu.yaml's default loss is EOPD with the exact full-vocabulary reverse KL
    (issue 48 ask 5: chosen on the training split, docs/results.md); its support comes from
    per_loss.eopd_rkl, so the paper's loss, the baselines and eopd's GKD keep theirs, and an override
    still chooses another support."""
    from tests.procs import ROOT

    path = ROOT / "configs" / "smollm2-cpu.yaml"
    cfg = load_config(path)
    assert (cfg.loss.variant, cfg.loss.support, cfg.teacher.hidden_states) == ("eopd_rkl", "full", "bfloat16")
    # ... at its measured layout (issue 47): TRL's, in async mode; the others keep the file's
    layout = lambda c: (c.mode, c.rollout.n_samples, c.train.batch_size, c.train.mini_batch_size, c.train.iterations)  # noqa: E731
    assert layout(cfg) == ("async", 1, 8, 8, 64)
    assert layout(load_config(path, ["loss.variant=gkd"])) == ("sync", 1, 8, 8, 64)
    for variant in ("eopd", "opd", "kd"):
        assert layout(load_config(path, [f"loss.variant={variant}"])) == ("sync", 2, 16, 8, 32), variant
    assert layout(load_config(path, ["mode=sync"])) == ("sync", 1, 8, 8, 64)  # an override still wins
    for variant in ("eopd", "opd", "gkd"):
        other = load_config(path, [f"loss.variant={variant}"])
        assert (other.loss.support, other.teacher.hidden_states) == ("teacher_topk", "none"), variant
    chosen = load_config(path, ["loss.support=teacher_topk"])
    assert (chosen.loss.variant, chosen.loss.support, chosen.teacher.hidden_states) == ("eopd_rkl", "teacher_topk", "none")
