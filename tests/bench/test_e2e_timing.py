"""Re-timings of the head-to-head (bench/e2e_timing.py, `bench_e2e --phase retime`): a run trained
again on a later machine for its seconds alone pairs the systems timed there, against values worked
out by hand."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest

from bench.e2e_report import retimings_text, summarise
from bench.e2e_timing import TIMING_DIR, load_timings, retimed, retimed_runs, timing_name

OLD = "1c7ce55b-0000-4000-8000-000000000000"  # the machine that timed the archived runs
NEW = "ce0d4cf8-998f-4305-a9ca-f3816b28e9a3"  # a later one


def _run(system, seed, seconds, accs=None, boot=OLD, cpu="AMD EPYC"):
    accs = accs or [None] * len(seconds)
    return {"system": system, "seed": seed, "memory": {"peak_total_mb": 1024.0},
            "machine": {"cpu": cpu, "cores": 2, "boot_id": boot},
            "checkpoints": [{"label": f"c{i}", "step": 16 * i, "train_s": t,
                             **({"heldout": {"avg_at_k": a, "pass_at_k": {"8": a}}} if a is not None else {})}
                            for i, (t, a) in enumerate(zip(seconds, accs), 1)]}


def test_a_retiming_keeps_the_runs_accuracies_and_takes_its_seconds_and_machine():
    run = _run("eopd", 0, [100, 200], [0.2, 0.4])
    again = retimed(run, _run("eopd", 0, [80, 150], boot=NEW, cpu="Intel(R) Xeon(R) Processor"))
    assert [c["train_s"] for c in again["checkpoints"]] == [80, 150]
    assert [c["heldout"]["avg_at_k"] for c in again["checkpoints"]] == [0.2, 0.4]
    assert again["machine"]["boot_id"] == NEW and again["retimed"] is True
    assert [c["train_s"] for c in run["checkpoints"]] == [100, 200]  # the run itself untouched


def test_a_retiming_of_another_run_or_schedule_is_refused():
    run = _run("eopd", 0, [100, 200], [0.2, 0.4])
    with pytest.raises(ValueError, match="paired with eopd seed 0"):
        retimed(run, _run("eopd", 1, [80, 150], boot=NEW))
    with pytest.raises(ValueError, match="paired with eopd seed 0"):
        retimed(run, _run("opd", 0, [80, 150], boot=NEW))
    other = _run("eopd", 0, [80, 150], boot=NEW)
    other["checkpoints"][1]["step"] = 40  # checkpoints at other steps: another schedule
    with pytest.raises(ValueError, match=r"checkpoints \['c2'\] are not the run's"):
        retimed(run, other)
    # A re-timing with every checkpoint of the run (the run's last one not evaluated: left out) pairs.
    assert retimed(_run("eopd", 0, [100], [0.2]), _run("eopd", 0, [80, 150], boot=NEW))["checkpoints"][0]["train_s"] == 80


def test_a_seed_timed_on_two_machines_pairs_through_the_retiming():
    """eopd's seed 0 was timed on the old machine, TRL's on the new one: no machine timed both, no
    ratio; eopd re-timed on the new machine gives TRL's ratio from the new machine's seconds."""
    eopd = _run("eopd", 0, [100, 200], [0.2, 0.4])
    trl = _run("trl-gkd", 0, [50, 120], [0.4, 0.45], boot=NEW, cpu="Intel(R) Xeon(R) Processor")
    alone = summarise([eopd, trl], initial=0.1)["systems"]["trl-gkd"]
    assert alone["reach_ratios"] == [] and alone["train_ratios"] == []
    again = retimed_runs([eopd, trl], [_run("eopd", 0, [80, 160], boot=NEW, cpu="Intel(R) Xeon(R) Processor"),
                                       _run("opd", 0, [1, 2], boot=NEW)])  # no archived opd run: left out
    assert len(again) == 1
    s = summarise([eopd, trl], initial=0.1, retimings=again)
    t, e = s["systems"]["trl-gkd"], s["systems"]["eopd"]
    assert t["reach_ratios"] == pytest.approx([50 / 160])  # target 0.4: eopd's last checkpoint, 160 s there
    assert t["train_ratios"] == pytest.approx([120 / 160])
    assert e["train_ratios"] == pytest.approx([1.0])  # eopd's own machine first: its 200 s against its 200 s
    # The runs' own numbers are unchanged by the re-timing: seconds, machines, the mean training time.
    assert e["train_s"] == [200] and e["machines"] == ["AMD EPYC (boot 1c7ce55b)"]
    assert list(e["timed"][0]) == ["AMD EPYC (boot 1c7ce55b)", "Intel(R) Xeon(R) Processor (boot ce0d4cf8)"]


def test_a_seed_pairs_on_the_machine_that_timed_both_most_recently():
    """TRL and eopd timed on three machines: the ratio uses the newest re-timing (`timed_at`: it measures
    the newest code), then older ones; the runs' own timings, recorded before `timed_at` was, come last."""
    eopd = _run("eopd", 0, [100, 200], [0.2, 0.4])
    trl = _run("trl-gkd", 0, [60, 150], [0.4, 0.45])
    xeon = "Intel(R) Xeon(R) Processor"

    def at(run, when):
        run["machine"]["timed_at"] = when
        return run

    old = [at(_run("trl-gkd", 0, [10, 20], boot=NEW, cpu=xeon), "2026-12-05T10:00:00+00:00"),
           at(_run("eopd", 0, [40, 80], boot=NEW, cpu=xeon), "2026-12-05T11:00:00+00:00")]
    t = summarise([eopd, trl], initial=0.1, retimings=retimed_runs([eopd, trl], old))["systems"]["trl-gkd"]
    assert t["train_ratios"] == pytest.approx([20 / 80])  # the re-timing before the runs' own machine
    newer = "2c0ffee0-0000-4000-8000-000000000000"
    new = [at(_run("eopd", 0, [50, 90], boot=newer), "2026-12-06T16:00:00+00:00"),
           at(_run("trl-gkd", 0, [30, 60], boot=newer), "2026-12-06T15:00:00+00:00")]
    s = summarise([eopd, trl], initial=0.1, retimings=retimed_runs([eopd, trl], old + new))["systems"]
    assert s["trl-gkd"]["train_ratios"] == pytest.approx([60 / 90])
    assert list(s["trl-gkd"]["timed"][0]) == ["AMD EPYC (boot 2c0ffee0)", f"{xeon} (boot ce0d4cf8)",
                                              "AMD EPYC (boot 1c7ce55b)"]
    # A machine that timed only one of the two is passed over for the newest that timed both.
    only_trl = [at(_run("trl-gkd", 0, [1, 2], boot="3badbeef-0000-4000-8000-000000000000"), "2026-12-07T00:00:00+00:00")]
    s = summarise([eopd, trl], initial=0.1, retimings=retimed_runs([eopd, trl], old + new + only_trl))["systems"]
    assert s["trl-gkd"]["train_ratios"] == pytest.approx([60 / 90])


def test_retiming_names_load_and_the_reports_words(tmp_path):
    assert timing_name("trl-gkd-s0", {"boot_id": NEW}) == "trl-gkd-s0@ce0d4cf8"
    with pytest.raises(ValueError, match="no kernel boot id"):
        timing_name("trl-gkd-s0", {"cpu": "AMD EPYC"})
    assert load_timings(tmp_path) == [] and load_timings(None) == []
    kept = _run("trl-gkd", 0, [50, 120], boot=NEW, cpu="Intel(R) Xeon(R) Processor")
    (tmp_path / TIMING_DIR / "trl-gkd-s0@ce0d4cf8").mkdir(parents=True)
    (tmp_path / TIMING_DIR / "trl-gkd-s0@ce0d4cf8" / "trained.json").write_text(json.dumps(kept))
    assert load_timings(tmp_path) == [kept]
    assert retimings_text([]) == ""
    text = retimings_text([kept])
    assert "Intel(R) Xeon(R) Processor (boot ce0d4cf8): trl-gkd seed 0" in text and "never evaluated" in text


def test_the_retime_phase_keeps_one_retiming_per_machine(tmp_path, monkeypatch):
    """`--phase retime`: each run trained again into <archive>/timing/<name>@<boot>/trained.json with
    this machine, its run directory deleted; a second call on the same machine trains nothing. The
    training itself is `train` (the timed phase's, tested by test_bench_quick): replaced here."""
    import bench.bench_e2e as e2e

    trained = []

    class Trained:
        def __init__(self, system, seed):
            self.system, self.seed = system, seed

        def to_json(self):
            return {"system": self.system, "seed": self.seed, "checkpoints": [{"label": "c1", "step": 16, "train_s": 9.0}]}

    def fake_train(system, seed, run_dir, settings):
        run_dir.mkdir(parents=True)
        (run_dir / "checkpoints").mkdir()
        trained.append((system, seed, run_dir))
        return Trained(system, seed)

    monkeypatch.setattr(e2e, "train", fake_train)
    monkeypatch.setattr(e2e, "timing_machine", lambda: {"cpu": "Intel(R) Xeon(R) Processor", "boot_id": NEW})
    args = Namespace(archive=tmp_path / "archive", runs=tmp_path / "runs", seeds=[0, 1], systems=["trl-gkd"])
    settings = {"layout": "preset", "prompts": ["p"], "lr": 3e-5}
    e2e.retime_all(args, settings)
    assert [(s, seed) for s, seed, _ in trained] == [("trl-gkd", 0), ("trl-gkd", 1)]
    for seed in (0, 1):
        kept = json.loads((args.archive / TIMING_DIR / f"trl-gkd-s{seed}@ce0d4cf8" / "trained.json").read_text())
        assert kept["machine"]["boot_id"] == NEW and kept["settings"] == {"layout": "preset", "lr": 3e-5}
    assert not any(d.exists() for _, _, d in trained)  # the run directories (checkpoints: GBs) are gone
    e2e.retime_all(args, settings)
    assert len(trained) == 2  # timed on this machine already
    with pytest.raises(SystemExit, match="--phase retime keeps its runs in --archive"):
        e2e.retime_all(Namespace(**{**vars(args), "archive": None}), settings)


def test_a_report_referenced_to_trl_names_it_and_pairs_training_time():
    """Issues 47 and 48 measure against TRL: `summarise(reference="trl-gkd")` takes TRL's final accuracy
    as the target, its seconds as the divisor, and the table says so."""
    from bench.e2e_report import summary_table

    xeon = "Intel(R) Xeon(R) Processor"
    runs = [_run("trl-gkd", 0, [100, 200], [0.3, 0.5], boot=NEW, cpu=xeon),
            _run("eopd-trl-gkd", 0, [120, 240], [0.4, 0.5], boot=NEW, cpu=xeon),
            _run("eopd", 0, [90, 180], [0.2, 0.3])]  # another machine: accuracy, no ratio
    s = summarise(runs, initial=0.1, reference="trl-gkd")
    assert s["target"] == 0.5 and s["reference"] == "trl-gkd"
    e = s["systems"]["eopd-trl-gkd"]
    assert e["train_ratios"] == pytest.approx([1.2]) and e["reach_ratios"] == pytest.approx([1.2])
    assert s["systems"]["eopd"]["train_ratios"] == [] and s["systems"]["eopd"]["reached"] == "0/1"
    table = summary_table(s, 8)
    assert "time to TRL's final accuracy" in table and "training s; ratio to TRL" in table
    assert "| 240; 1.20x (1 seed) |" in table
