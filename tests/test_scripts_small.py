"""Pure parts of the measurement scripts: scripts/test_durations.py's per-file sums and
scripts/layout_ablation.py's grid order and results table (read from archived cells)."""

from __future__ import annotations

import json

from scripts import layout_ablation
from scripts.test_durations import per_file


def test_durations_summed_per_file_slowest_first():
    lines = ["1.5\tsetup\ttests/a.py::t1", "2.0\tcall\ttests/a.py::t1", "0.5\tcall\ttests/a.py::t2",
             "3.0\tcall\ttests/b.py::t[x-y]"]
    assert per_file(lines) == [("tests/a.py", 4.0, "t1", 3.5), ("tests/b.py", 3.0, "t[x-y]", 3.0)]


def test_layout_grid_runs_the_first_two_layouts_of_every_loss_first():
    got = layout_ablation.cells(["eopd", "gkd"], ["preset", "trl", "p4x2"], [0, 1])
    assert got[:4] == [("eopd", "preset", 0), ("gkd", "preset", 0), ("eopd", "trl", 0), ("gkd", "trl", 0)]
    assert got[4:6] == [("eopd", "p4x2", 0), ("gkd", "p4x2", 0)] and got[6] == ("eopd", "preset", 1)
    assert len(got) == 12 and len(set(got)) == 12


def _cell(archive, loss, layout, seed, avg, train_s, started=None, **machine):
    d = archive / layout_ablation.cell_name(loss, layout, seed)
    d.mkdir(parents=True)
    (d / "cell.json").write_text(json.dumps({"loss": loss, "layout": layout, "seed": seed, **machine}))
    (d / f"eval-{layout_ablation.PROBE_SET}.json").write_text(json.dumps({"models": {"final": {"avg_at_k": avg}}}))
    (d / "run_summary.json").write_text(json.dumps({"train_s": train_s}))
    first = {"kind": "iteration"} if started is None else {"kind": "iteration", "time": started}
    (d / "train_metrics.jsonl").write_text(json.dumps(first) + '\n{"kind": "step"}\n')


def test_layout_table_means_over_seeds_and_gains_over_the_initial_student(tmp_path):
    """Seconds stay per seed with the machine each cell ran on (cells of one grid run on several
    machines: one boot of one machine is one machine, whatever its probe says from cell to cell; a
    cell without a boot id is told apart by its probe), and a cell with other work beside it is starred."""
    xeon, epyc = {"cpu": "Xeon", "boot_id": "b1"}, {"cpu": "EPYC", "matmul_gflops": 122.0}
    _cell(tmp_path, "eopd", "trl", 0, 0.5, 100.0, **xeon, matmul_gflops=168.0)
    _cell(tmp_path, "eopd", "trl", 1, 0.3, 200.0, **epyc, beside="tests")
    _cell(tmp_path, "gkd", "preset", 0, 0.25, 50.0, **xeon, matmul_gflops=171.0)
    for seed, avg in ((0, 0.1), (1, 0.2)):
        (tmp_path / f"initial-s{seed}").mkdir()
        (tmp_path / f"initial-s{seed}" / f"eval-{layout_ablation.PROBE_SET}.json").write_text(
            json.dumps({"models": {"initial": {"avg_at_k": avg}}}))
    text = layout_ablation.table(tmp_path)
    assert "| eopd | trl | 2 | 0.400 | s0 0.500, s1 0.300 | +0.250 | s0 100 (A), s1 200* (B) |" in text
    assert "| gkd | preset | 1 | 0.250 | s0 0.250 | +0.150 | s0 50 (A) |" in text
    assert "A = Xeon, fp32 1024^3 matmul 168-171 GFLOP/s; B = EPYC, fp32 1024^3 matmul 122 GFLOP/s." in text
    assert "Other work ran beside this cell's training" in text
    assert text.index("| eopd | trl") < text.index("| gkd | preset")  # losses in LOSSES' order
    assert layout_ablation.read_cell(tmp_path / "nothing") is None


def test_distance_table_means_each_layouts_kl_to_the_teacher_beside_the_initial_students(tmp_path):
    """The far student's Avg@4 barely moves, so its block also reads the evaluations' distances to the
    teacher (reverse KL / FKL at H >= tau of the final student), per seed and averaged."""
    for seed, (rkl, fkl) in ((0, (1.0, 0.9)), (1, (1.2, 0.7))):
        _cell(tmp_path, "eopd", "preset", seed, 0.1, 10.0, cpu="EPYC", boot_id="b")
        path = tmp_path / layout_ablation.cell_name("eopd", "preset", seed) / f"eval-{layout_ablation.PROBE_SET}.json"
        path.write_text(json.dumps({"models": {"final": {"avg_at_k": 0.1, "reverse_kl": rkl, "fkl_high_entropy": fkl}}}))
    (tmp_path / "initial-s0").mkdir()
    (tmp_path / "initial-s0" / f"eval-{layout_ablation.PROBE_SET}.json").write_text(
        json.dumps({"models": {"initial": {"avg_at_k": 0.0, "reverse_kl": 2.0, "fkl_high_entropy": 1.5}}}))
    text = layout_ablation.distance_table(tmp_path)
    assert "| initial student | - | 1 | 2.000 / 1.500 | s0 2.000 / 1.500 |" in text
    assert "| eopd | preset | 2 | 1.100 / 0.800 | s0 1.000 / 0.900, s1 1.200 / 0.700 |" in text
    assert layout_ablation.distance_table(tmp_path / "empty") == ""


def test_a_cell_splits_the_probe_into_problems_its_run_trained_on_and_the_others(tmp_path):
    """The probe is the first 128 training problems: the trl layout samples all 512 problems once,
    the preset's a seeded half of them twice, so each cell's per-prompt results split into the
    problems it trained on and those it never sampled."""
    import yaml

    from eopd_trainer.data import prompt_index

    trl = {"seed": 1, "data": {"generate": {"train": 512}}, "rollout": {"n_samples": 1},
           "train": {"iterations": 64, "batch_size": 8}}
    preset = {"seed": 1, "data": {"generate": {"train": 512}}, "rollout": {"n_samples": 2},
              "train": {"iterations": 32, "batch_size": 16}}
    assert layout_ablation.trained_prompts(trl) == set(range(512))
    half = layout_ablation.trained_prompts(preset)
    assert half == {prompt_index(s, 512, seed=1) for s in range(256)} and len(half) == 256
    assert layout_ablation.trained_prompts({"train": {"iterations": 4}}) is None  # the file's size unknown
    _cell(tmp_path, "eopd", "preset", 1, 0.5, 100.0)
    d = tmp_path / "eopd-preset-s1"
    (d / "run.yaml").write_text(yaml.safe_dump(preset))
    per_prompt = [4 if i in half else 0 for i in range(128)]
    (d / f"eval-{layout_ablation.PROBE_SET}.json").write_text(json.dumps(
        {"models": {"final": {"avg_at_k": 0.5, "n_samples": 4, "correct_per_prompt": per_prompt}}}))
    split = layout_ablation.seen_split(d)
    seen = len(half & set(range(128)))
    assert split == {"seen_n": seen, "seen_avg": 1.0, "unseen_n": 128 - seen, "unseen_avg": 0.0}
    assert f"| eopd | preset | 1 | 0.500 | 1.000 ({seen}) | 0.000 ({128 - seen}) |" in layout_ablation.seen_table(tmp_path)


def test_machine_letters_never_repeat_past_z():
    """The 27th machine is AA, not A again (the legend named two machines alike after 26)."""
    names = [layout_ablation.machine_letter(i) for i in range(26 * 27 + 1)]
    assert names[:3] == ["A", "B", "C"] and names[25:28] == ["Z", "AA", "AB"] and names[26 * 27] == "AAA"
    assert len(set(names)) == len(names)


def test_machine_letters_follow_when_each_machine_first_ran_a_cell(tmp_path):
    """A machine that joins the grid later gets the next letter even when its cells' names sort first:
    the letters the docs' prose names do not move."""
    _cell(tmp_path, "kd", "preset", 0, 0.5, 100.0, started=1000.0, cpu="Xeon", boot_id="b1")
    _cell(tmp_path, "gkd", "preset", 0, 0.5, 100.0, started=2000.0, cpu="EPYC", boot_id="b2")
    _cell(tmp_path, "eopd", "preset", 0, 0.5, 100.0, started=3000.0, cpu="EPYC", boot_id="b3")
    _cell(tmp_path, "eopd", "trl", 0, 0.5, 100.0, cpu="Xeon", boot_id="b4")  # no time: after the others
    legend = layout_ablation.machine_legend([layout_ablation.read_cell(p) for p in sorted(tmp_path.glob("*-s*"))])
    assert legend == {("Xeon", "b1"): "A", ("EPYC", "b2"): "B", ("EPYC", "b3"): "C", ("Xeon", "b4"): "D"}


def test_the_suite_runs_its_longest_files_first():
    """tests/conftest.py's order: unmeasured files with a slow test, then measured files longest
    first, then the other unmeasured files; the kept seconds read back, a missing file read as none."""
    from scripts.test_durations import order_file
    from tests.ordering import file_rank

    seconds = {"tests/long.py": 200.0, "tests/short.py": 3.0, "tests/mid.py": 50.0}
    files = ["tests/new_unit.py", "tests/short.py", "tests/new_slow.py", "tests/long.py", "tests/mid.py"]
    ordered = sorted(files, key=lambda f: file_rank(f, {"tests/new_slow.py", "tests/short.py"}, seconds))
    assert ordered == ["tests/new_slow.py", "tests/long.py", "tests/mid.py", "tests/short.py", "tests/new_unit.py"]
    kept = order_file([("tests/a.py", 4.04, "t1", 3.5), ("tests/b.py", 3.0, "t", 3.0)], "here")
    assert kept == {"measured": "here", "seconds": {"tests/a.py": 4.0, "tests/b.py": 3.0}}


def test_the_kept_durations_are_read_and_a_bad_file_orders_nothing(tmp_path):
    from pathlib import Path

    from tests.ordering import measured_seconds

    assert measured_seconds(tmp_path / "absent.json") == {}
    (tmp_path / "bad.json").write_text("{not json")
    assert measured_seconds(tmp_path / "bad.json") == {}
    kept = measured_seconds(Path(__file__).with_name("durations.json"))  # the committed one
    assert kept and all(f.startswith("tests/") and f.endswith(".py") and s >= 0 for f, s in kept.items())
