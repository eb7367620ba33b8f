"""The head-to-head benchmark's pure numbers (bench/e2e_report.py): time to reach a target accuracy,
the per-system summary and its ratio to eopd, against values worked out by hand."""

from __future__ import annotations

import json

import pytest

from bench.e2e_report import curve, machines_line, summarise, summary_table, time_to_reach, time_to_stay


def test_time_to_reach_interpolates_between_checkpoints():
    pts = [(0.0, 0.1), (100.0, 0.2), (200.0, 0.4), (300.0, 0.35)]
    assert time_to_reach(pts, 0.3) == pytest.approx(150.0)  # halfway from 0.2 to 0.4
    assert time_to_reach(pts, 0.2) == pytest.approx(100.0)
    assert time_to_reach(pts, 0.4) == pytest.approx(200.0)
    assert time_to_reach(pts, 0.41) is None  # never reached
    assert time_to_reach(pts, 0.05) == 0.0  # the initial student already has it
    assert time_to_reach([(0.0, 0.1), (50.0, 0.5), (90.0, 0.6)], 0.5) == pytest.approx(50.0)


def _run(system, seed, points, peak=1024.0, cpu="Intel(R) Xeon(R) Processor", boot=None):
    machine = {"cpu": cpu, "cores": 2} | ({"boot_id": boot} if boot else {})
    return {"system": system, "seed": seed, "memory": {"peak_total_mb": peak}, "machine": machine,
            "checkpoints": [{"label": f"c{i}", "step": i, "train_s": t, "heldout": {"avg_at_k": a, "pass_at_k": {"1": a, "4": min(1.0, 2 * a)}}}
                            for i, (t, a) in enumerate(points, 1)]}


def test_summary_target_reach_and_ratio():
    runs = [_run("eopd", 0, [(100, 0.2), (200, 0.4)]), _run("eopd", 1, [(110, 0.3), (220, 0.2)]),
            _run("trl-gkd", 0, [(50, 0.2), (100, 0.3), (150, 0.35)]), _run("trl-gkd", 1, [(60, 0.3), (120, 0.31)])]
    s = summarise(runs, initial=0.1)
    assert s["target"] == pytest.approx(0.3)  # eopd's final Avg@k over its seeds: (0.4 + 0.2) / 2
    e, t = s["systems"]["eopd"], s["systems"]["trl-gkd"]
    # eopd seed 0 reaches 0.3 halfway from 100 s to 200 s; seed 1 at its first checkpoint
    assert e["reach_s"] == pytest.approx([150.0, 110.0]) and e["reach_ratio"] == pytest.approx(1.0)
    # the ratio is paired by seed: each seed's time over eopd's time in that seed, then their mean
    assert t["reach_s"] == pytest.approx([100.0, 60.0]) and t["reach_ratios"] == pytest.approx([100 / 150, 60 / 110])
    assert t["reach_ratio"] == pytest.approx((100 / 150 + 60 / 110) / 2)
    assert e["final_avg"] == [0.4, 0.2] and e["final_pass"] == [0.8, 0.4] and t["reached"] == "2/2"
    assert curve(runs[0], 0.1) == [(0.0, 0.1), (100, 0.2), (200, 0.4)]
    table = summary_table(s, 4)
    assert "0.61x (0.55-0.67, 2 seeds)" in table and "TRL GKDTrainer" in table


def test_seconds_of_different_cpus_are_not_compared():
    """Seed 1 of TRL ran on another CPU than eopd's seed 1: only seed 0 gives a ratio."""
    runs = [_run("eopd", 0, [(100, 0.2), (200, 0.4)]), _run("eopd", 1, [(110, 0.3), (220, 0.2)], cpu="AMD EPYC"),
            _run("trl-gkd", 0, [(50, 0.2), (100, 0.3)]), _run("trl-gkd", 1, [(60, 0.3)])]
    t = summarise(runs, initial=0.1)["systems"]["trl-gkd"]
    assert t["reach_ratios"] == pytest.approx([100 / 150]) and t["machines"] == ["Intel(R) Xeon(R) Processor"] * 2
    assert t["reached"] == "2/2"


def test_seconds_of_two_machines_with_one_cpu_name_are_not_compared():
    """Two machines both called "AMD EPYC" ran 1.4-1.9x apart: the boot id, where recorded, keeps them apart."""
    runs = [_run("eopd", 2, [(100, 0.2), (200, 0.4)], cpu="AMD EPYC"),
            _run("trl-gkd", 2, [(50, 0.4)], cpu="AMD EPYC"),
            _run("trl-server-vllm", 2, [(50, 0.4)], cpu="AMD EPYC", boot="94c6cf01-c04c-410c-9fa5-4cab669b8e2e")]
    summary = summarise(runs, initial=0.1)
    s = summary["systems"]
    assert s["trl-gkd"]["own_ratios"] == pytest.approx([50 / 200])
    assert s["trl-server-vllm"]["machines"] == ["AMD EPYC (boot 94c6cf01)"] and s["trl-server-vllm"]["own_ratios"] == []
    assert s["trl-server-vllm"]["own_s"] == pytest.approx([50.0])  # its time is kept, only the ratio is not formed
    assert s["trl-server-vllm"]["own_reached"] == "1/1"
    table = summary_table(summary, 4)
    assert "| 1/1 reach it; 0.25x (1 seed) |" in table and "| 1/1 reach it; no seed paired |" in table
    assert machines_line(runs) == "AMD EPYC: seed 2 (eopd, trl-gkd); AMD EPYC (boot 94c6cf01): seed 2 (trl-server-vllm)"


def test_a_system_that_never_reaches_the_target():
    s = summarise([_run("eopd", 0, [(100, 0.5)]), _run("trl-server-eopd", 0, [(80, 0.2), (160, 0.3)])], initial=0.1)
    never = s["systems"]["trl-server-eopd"]
    assert never["reach_s"] == [None] and never["reach_ratio"] is None and never["reached"] == "0/1"
    assert "never" in summary_table(s, 4)


def test_time_to_stay_ignores_a_crossing_that_falls_back():
    pts = [(0.0, 0.1), (100.0, 0.4), (200.0, 0.2), (300.0, 0.5)]
    assert time_to_reach(pts, 0.3) == pytest.approx(100 * 2 / 3)  # the first crossing, on the way up to 0.4
    assert time_to_stay(pts, 0.3) == pytest.approx(200 + 100 / 3)  # after falling to 0.2: a third of the way to 0.5
    assert time_to_stay(pts, 0.51) is None  # the last checkpoint is below it
    assert time_to_stay(pts + [(400.0, 0.25)], 0.3) is None
    assert time_to_stay(pts, 0.05) == 0.0  # the initial student already has it
    assert time_to_stay(pts, 0.5) == pytest.approx(300.0)


def test_summary_stay_ratio_is_paired_by_seed():
    runs = [_run("eopd", 0, [(100, 0.4), (200, 0.2), (300, 0.5)]), _run("eopd", 1, [(100, 0.5), (200, 0.3)]),
            _run("trl-gkd", 0, [(50, 0.5), (100, 0.45)]), _run("trl-gkd", 1, [(100, 0.2), (150, 0.2)])]
    s = summarise(runs, initial=0.1)
    assert s["target"] == pytest.approx(0.4)
    e, t = s["systems"]["eopd"], s["systems"]["trl-gkd"]
    assert e["reach_s"] == pytest.approx([100.0, 75.0])  # seed 1: from 0.1 at 0 s to 0.5 at 100 s
    # seed 0 falls to 0.2 at 200 s, then two thirds of the way to 0.5; seed 1 ends below 0.4
    assert e["stay_s"] == pytest.approx([200 + 200 / 3, None]) and e["stayed"] == "1/2"
    assert t["stay_s"] == pytest.approx([37.5, None]) and t["stay_ratios"] == pytest.approx([37.5 / (200 + 200 / 3)])
    assert "37 s (1/2), 0.14x (1 seed)" in summary_table(s, 4)


def test_each_seeds_own_target_gives_every_seed_a_ratio():
    """eopd seed 1 ends at 0.2, below the mean target 0.3, so it never reaches that; its own final accuracy
    0.2 it first reaches halfway from 0.1 at 0 s to 0.3 at 110 s (55 s), so seed 1 gives a ratio too."""
    runs = [_run("eopd", 0, [(100, 0.2), (200, 0.4)]), _run("eopd", 1, [(110, 0.3), (220, 0.2)]),
            _run("trl-gkd", 0, [(50, 0.2), (100, 0.4)]), _run("trl-gkd", 1, [(60, 0.15), (120, 0.2)])]
    s = summarise(runs, initial=0.1)
    assert s["seed_targets"] == {0: 0.4, 1: 0.2}
    e, t = s["systems"]["eopd"], s["systems"]["trl-gkd"]
    assert e["own_s"] == pytest.approx([200.0, 55.0]) and t["own_s"] == pytest.approx([100.0, 120.0])
    assert t["own_ratios"] == pytest.approx([100 / 200, 120 / 55])
    assert f"{(0.5 + 120 / 55) / 2:.2f}x (0.50-2.18, 2 seeds)" in summary_table(s, 4)


def test_an_eopd_system_at_another_layout_is_kept_and_labelled_apart():
    """`bench_e2e --layout trl` (issue 47/48): eopd's systems at TRL's layout are runs of their own
    (`eopd-gkd@trl`) beside the preset's; TRL's systems have one layout and keep their names."""
    from bench.e2e_report import label
    from bench.e2e_systems import HEAD_TO_HEAD_LAYOUTS, LAYOUTS, base_system, system_key

    assert system_key("eopd-gkd", "trl") == "eopd-gkd@trl" and base_system("eopd-gkd@trl") == ("eopd-gkd", "trl")
    assert system_key("eopd-gkd", "preset") == "eopd-gkd" and base_system("eopd-gkd") == ("eopd-gkd", "preset")
    assert system_key("trl-gkd", "trl") == "trl-gkd"
    assert label("eopd-gkd@trl") == "eopd (GKD, lambda 1) at TRL's layout (8 prompts x 1 response per step)"
    assert label("eopd-gkd") == "eopd (GKD, lambda 1)"
    # the same 512 responses in 64 optimizer steps of 8 as the preset's 32 iterations x 16
    assert LAYOUTS["trl"] == ("rollout.n_samples=1", "train.batch_size=8", "train.mini_batch_size=8", "train.iterations=64")
    assert LAYOUTS["trl-async"] == (*LAYOUTS["trl"], "mode=async")
    from scripts.layout_ablation import LAYOUTS as ABLATION_LAYOUTS  # the training-split grid's cells: one source

    assert ABLATION_LAYOUTS is LAYOUTS
    # the head-to-head trains on TRL's 512 problems at every layout: none that changes the data
    assert "trl-async" in HEAD_TO_HEAD_LAYOUTS and "trl-256" not in HEAD_TO_HEAD_LAYOUTS
    assert label("eopd-rkl-full@trl-async").endswith("at TRL's layout in async mode (8 prompts x 1 response per step, "
                                                    "one step of lag)")
    runs = [_run("eopd-gkd", 0, [(100, 0.3), (200, 0.4)]), _run("eopd-gkd@trl", 0, [(120, 0.4), (240, 0.5)])]
    summary = summarise(runs, initial=0.2, reference="eopd-gkd")
    assert set(summary["systems"]) == {"eopd-gkd", "eopd-gkd@trl"}
    assert summary["systems"]["eopd-gkd@trl"]["reach_s"] == pytest.approx([120.0])
    assert "at TRL's layout" in summary_table(summary, 4)


def test_the_head_to_head_settings_at_trls_layout(tmp_path):
    """`bench_e2e --layout trl` on the tiny preset: eopd runs 8 prompts x 1 response, one optimizer step
    an iteration, for the same 64 steps of 8 responses TRL runs, checkpointed at the same share."""
    from bench.bench_e2e import prepare_settings
    from bench.report import ROOT

    preset = ROOT / "configs" / "tiny.yaml"
    trl = prepare_settings(preset, tmp_path, iterations=None, save_every=None, quick=True, layout="trl")
    assert (trl["layout"], trl["iterations"], trl["steps_per_iteration"], trl["batch_size"]) == ("trl", 64, 1, 8)
    assert (trl["steps"], trl["save_every"], trl["save_every_steps"], trl["samples_per_prompt"]) == (64, 16, 16, 1)
    assert trl["eopd_overrides"] == ["rollout.n_samples=1", "train.batch_size=8", "train.mini_batch_size=8",
                                     "train.iterations=64"]
    preset_settings = prepare_settings(preset, tmp_path, iterations=None, save_every=None, quick=True)
    assert preset_settings["eopd_overrides"] == [] and preset_settings["layout"] == "preset"
    assert preset_settings["save_every"] == max(1, preset_settings["iterations"] // 4)


def test_the_section_says_each_eopd_layout_and_refuses_another_avg_at_k(tmp_path):
    """The head-to-head's text names eopd's data layout per layout its runs were trained at (their own
    recorded settings), and runs graded at another Avg@k never enter one table (`--eval-samples`)."""
    import json

    from bench.bench_e2e import check_graded_at, layout_text

    preset = {"samples_per_prompt": 2, "prompts_per_iteration": 8, "steps_per_iteration": 2, "batch_size": 8}
    trl = {"samples_per_prompt": 1, "prompts_per_iteration": 8, "steps_per_iteration": 1, "batch_size": 8}
    runs = [{"system": "eopd", "settings": preset}, {"system": "eopd-gkd@trl", "settings": trl},
            {"system": "trl-gkd", "settings": trl}]
    runs.append({"system": "eopd-gkd", "settings": preset, "layout": trl})  # a preset's per_loss gave it TRL's layout
    text = layout_text(runs, preset)
    assert text.startswith("Data layout, not matched for eopd (EOPD): 2 responses for each of 8 prompts per iteration")
    assert "the second of its 2 mini-batches" in text
    assert ("Data layout, matched for eopd (GKD, lambda 1); eopd (GKD, lambda 1) at TRL's layout (8 prompts x 1 response "
            "per step): 1 response for each of 8 prompts per optimizer step") in text
    assert layout_text(runs[2:3], preset) == ""  # TRL's runs alone: nothing to say of eopd's
    lagged = layout_text([{"system": "eopd-gkd@trl-async", "layout": {**trl, "mode": "async"}}], preset)
    assert lagged.startswith("Data layout, matched for eopd (GKD, lambda 1) at TRL's layout in async mode")
    assert "a fresh sample for every step." in lagged and "as TRL" not in lagged
    assert "the policy one version behind" in lagged and "async" not in text  # sync runs say nothing of it
    # a run archived before runs recorded their mode: its system's overrides say it
    older = layout_text([{"system": "eopd-trl-gkd-async", "layout": trl}, {"system": "eopd-gkd", "layout": trl}], preset)
    assert older.count("Data layout, matched") == 2 and "the policy one version behind" in older
    graded = tmp_path / "eval.json"
    graded.write_text(json.dumps({"models": {"it8": {"n_samples": 4}, "it16": {"n_samples": 4}}}))
    check_graded_at(graded, 4)
    with pytest.raises(SystemExit, match=r"graded at \[4\] samples per problem, this run grades at 8"):
        check_graded_at(graded, 8)


def test_each_eopd_system_trains_at_its_losss_own_layout(tmp_path):
    """A preset's `per_loss` entry gives one eopd system its own layout and run length in the
    head-to-head (iterations and checkpoints follow it unless bench_e2e is given them)."""
    import yaml

    from bench.e2e_systems import eopd_layout
    from bench.report import ROOT

    data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    data["per_loss"] = {"gkd": {"rollout": {"n_samples": 1}, "train": {"batch_size": 8, "mini_batch_size": 8, "iterations": 64}}}
    preset = tmp_path / "preset.yaml"
    preset.write_text(yaml.safe_dump(data))
    settings = {"preset_path": str(preset), "eopd_overrides": []}
    own = eopd_layout("eopd-gkd", settings)
    assert own == {"samples_per_prompt": 1, "prompts_per_iteration": 8, "steps_per_iteration": 1, "batch_size": 8,
                   "iterations": 64, "save_every": 16, "mode": "sync"}
    general = eopd_layout("eopd", settings)
    assert (general["samples_per_prompt"], general["iterations"]) == (data["rollout"]["n_samples"], data["train"]["iterations"])
    # given iterations count the preset's (2 steps each here: 4 steps, a checkpoint every 2): at its own
    # layout, one step per iteration, the system trains those 4 steps in 4 iterations
    quick = eopd_layout("eopd-gkd", {**settings, "iterations_given": 2, "save_every_given": 1, "steps": 4,
                                     "save_every_steps": 2})
    assert (quick["iterations"], quick["save_every"]) == (4, 2)
    assert eopd_layout("eopd", {**settings, "iterations_given": 2, "save_every_given": 1, "steps": 4,
                                "save_every_steps": 2}) == general | {"iterations": 2, "save_every": 1}


def test_the_published_reading_is_the_reports_own_archives(tmp_path):
    """`--phase report --archive A` publishes A's reading.md, never bench/results/e2e's (the Avg@8
    archive's report once carried the Avg@4 runs' reading)."""
    from bench.bench_e2e import ARCHIVE, archive_reading

    avg8 = tmp_path / "e2e-avg8"
    avg8.mkdir()
    assert archive_reading(avg8) is None and archive_reading(None) is None
    (avg8 / "reading.md").write_text("\n**Reading.** Avg@8 runs, three seeds.\n\n")
    assert archive_reading(avg8) == "**Reading.** Avg@8 runs, three seeds."
    if (ARCHIVE / "reading.md").is_file():
        assert archive_reading(avg8) != archive_reading(ARCHIVE)


def test_a_report_of_fewer_systems_never_replaces_the_published_one(tmp_path, monkeypatch, capsys):
    """`--phase all --systems ONE` (one new system trained and graded) once rewrote docs/benchmarks.md's
    head-to-head, its JSON and figure with that one system: `--phase all` writes the published section
    only when it holds every system the section holds; `--phase report` writes what it is given."""
    from bench import bench_e2e

    published = {"runs": [{"system": "trl-gkd"}, {"system": "eopd-gkd"}, {"system": "eopd-gkd"}]}
    assert bench_e2e.dropped_systems(published, [{"system": "eopd-trl-gkd-async"}]) == ["eopd-gkd", "trl-gkd"]
    assert bench_e2e.dropped_systems(published, [{"system": "trl-gkd"}, {"system": "eopd-gkd"}, {"system": "x"}]) == []
    assert bench_e2e.dropped_systems(None, [{"system": "x"}]) == []

    monkeypatch.setenv("EOPD_BENCH_RESULTS", str(tmp_path))
    (tmp_path / f"{bench_e2e.SECTION}.json").write_text(json.dumps(published))
    figure = tmp_path / "fig.png"
    monkeypatch.setattr(bench_e2e, "FIGURE", figure)
    monkeypatch.setattr(bench_e2e, "write_section", lambda *a: pytest.fail("the section was written"))
    initial = tmp_path / "initial.json"
    initial.write_text(json.dumps({"models": {"initial": {"avg_at_k": 0.15}}}))
    run = _run("eopd-trl-gkd-async", 0, [(100.0, 0.3), (200.0, 0.4)])
    bench_e2e.report([run], {"eval_n": 8}, initial, write=True, json_out=None, archive=None,
                     reference="eopd-trl-gkd-async", keep_fuller=True)  # --phase all
    assert "not writing the published section" in capsys.readouterr().out
    assert json.loads((tmp_path / f"{bench_e2e.SECTION}.json").read_text()) == published and not figure.exists()
    written = []  # --phase report writes what it is given
    monkeypatch.setattr(bench_e2e, "write_section", lambda *a: written.append(a))
    monkeypatch.setattr(bench_e2e, "section_text", lambda data: "the section")
    bench_e2e.report([run], {"eval_n": 8}, initial, write=True, json_out=None, archive=None,
                     reference="eopd-trl-gkd-async")
    assert written and figure.exists()
    assert {r["system"] for r in json.loads((tmp_path / f"{bench_e2e.SECTION}.json").read_text())["runs"]} == {
        "eopd-trl-gkd-async"}


def test_a_report_names_runs_of_several_layouts_and_nothing_else_takes_them():
    """`--systems eopd-gkd@trl-async` reports the runs `--layout trl-async` trained beside the preset's
    systems (one section for several layouts); training or evaluating such an entry is refused (its
    layout is `--layout`'s), and a system or layout that does not exist is a clear error."""
    import argparse

    from bench.bench_e2e import main, system_entry
    from bench.e2e_systems import system_key

    assert system_key("eopd-gkd@trl-async", "preset") == "eopd-gkd@trl-async"
    assert system_key("eopd-gkd", "trl-async") == "eopd-gkd@trl-async" and system_key("trl-gkd", "trl-async") == "trl-gkd"
    assert system_entry("eopd-rkl-full@trl-async") == "eopd-rkl-full@trl-async" and system_entry("opd") == "opd"
    for bad, says in (("eopd-gkd@nowhere", "layout"), ("trl-gkd@trl", "eopd's systems"), ("eopd-gkd@trl-256", "layout"),
                      ("eopd-gkd@preset", "other than the preset's"), ("gkd", "unknown system 'gkd'")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            system_entry(bad)
    with pytest.raises(SystemExit) as exc:
        main(["--systems", "eopd-gkd@trl-async", "--phase", "train", "--seeds", "0"])
    assert exc.value.code == 2
