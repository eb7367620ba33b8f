"""The README stays true: its results table is what `python -m scripts.readme_table` lays out from the
archived runs now, and the first screen's facts about the main job match the preset it runs. Pure
file reading (a second or so)."""

from __future__ import annotations

import json
import re

import pytest
from eopd_trainer.config.load import load_config

from scripts import readme_table
from scripts.doc_blocks import read_block, replace_block, sync
from tests.procs import ROOT

README = (ROOT / "README.md").read_text()


def test_the_readme_results_table_is_the_one_the_archived_runs_give():
    assert read_block(README, readme_table.BLOCK) is not None, "README.md lost its results-table markers"
    stale = sync(ROOT / "README.md", {readme_table.BLOCK: readme_table.build()}, readme_table.COMMAND, check=True)
    assert stale == [], "README.md's results table differs from the archived runs: run `python -m scripts.readme_table`"


def test_the_table_quotes_each_archived_number(tmp_path):
    """A changed archive changes the table: the default loss's seed-0 final accuracy moved by one answer
    (Avg@8 on 64 problems: 1/512), and the teacher's evaluation must be the report's Avg@k."""
    e2e = json.loads(readme_table.E2E.read_text())
    initial = json.loads(readme_table.E2E_INITIAL.read_text())
    facts = readme_table.read_facts(sorted(p for p in readme_table.EXPERIMENT.iterdir()
                                           if p.name.startswith(("kd-s", "eopd-s0"))))
    before = readme_table.table(e2e, initial, facts)
    label = dict(readme_table.E2E_ROWS)["eopd-rkl-full@trl-async"]
    assert f"| {label} | 0.492 (0.463–0.510) |" in before
    e2e["summary"]["systems"]["eopd-rkl-full@trl-async"]["final_avg"][2] += 1 / 512
    after = readme_table.table(e2e, initial, facts)
    assert f"| {label} | 0.493 (0.465–0.510) |" in after
    with pytest.raises(ValueError, match="answers per problem"):
        readme_table.table({**e2e, "eval_n": 4}, initial, facts)
    doc = tmp_path / "README.md"
    doc.write_text(replace_block(README, readme_table.BLOCK, before, readme_table.COMMAND))
    assert sync(doc, {readme_table.BLOCK: after}, readme_table.COMMAND, check=True) == [readme_table.BLOCK]


def test_a_missing_block_is_named():
    with pytest.raises(KeyError, match="results-table"):
        replace_block("# no markers here\n", readme_table.BLOCK, "x", readme_table.COMMAND)


def test_the_first_screen_gives_both_commands_and_the_main_jobs_preset_facts():
    first_screen = "\n".join(README.splitlines()[:30])
    assert "`bash scripts/main.sh`" in first_screen and "`bash scripts/test.sh`" in first_screen
    main_row = next(line for line in first_screen.splitlines() if line.startswith("| `bash scripts/main.sh`"))
    cfg = load_config(ROOT / "configs" / "smollm2-cpu.yaml")
    assert f"for {cfg.train.iterations} iterations" in main_row
    assert f"(Avg@{cfg.eval.n_samples}, Pass@{cfg.eval.n_samples})" in main_row
    # the commands' times are stated once, in that table
    assert len(re.findall(r"first install", README)) == 1


FIRST_RUNS = ("main_job_cold_xeon-amx", "main_job_cold", "main_job_cold_epyc", "main_job_cold_avx2")  # the newest first:
# at the default loss's layout since 2026-12-07; the three others one per machine class at the one before


def test_the_main_jobs_time_is_the_measured_one():
    """The main job's times in the first screen are bench/bench_main_job.py's archived runs
    (FIRST_RUNS in bench/results/: an empty eval cache, one per machine class; main_job.json: the
    cache as a second run has it), in minutes to one decimal, with their training and evaluation
    seconds, the commit and fp32 matmul rate of the newest, and the peak memory of the first runs
    (summed RSS; the summed PSS where the run recorded it)."""
    main_row = next(line for line in README.splitlines() if line.startswith("| `bash scripts/main.sh`"))
    runs = {name: json.loads((ROOT / "bench" / "results" / f"{name}.json").read_text())
            for name in (*FIRST_RUNS, "main_job")}
    where = {}
    for name, label in [*((name, "a first run") for name in FIRST_RUNS), ("main_job", "a second run")]:
        r = runs[name]["result"]
        quoted = f"{r['total_s'] / 60:.1f} min {label} ({r['train_s']:.0f} s training + {r['eval_s']:.0f} s evaluation)"
        assert quoted in main_row, (quoted, main_row)
        where[name] = main_row.index(quoted)
    newest = max(FIRST_RUNS, key=lambda name: runs[name]["time"])
    assert where[newest] == min(where.values()), "the README leads with the newest first run"
    assert f"(fp32 matmul {runs[newest]['result']['matmul_gflops']:.0f} GFLOP/s at its start) at {runs[newest]['describe']}," in main_row
    for name in FIRST_RUNS:
        memory = runs[name]["result"]["memory"]
        assert f"peaking at {memory['peak_total_mib'] / 1024:.2f} GiB together" in main_row
        if memory.get("peak_pss_total_mib"):
            assert f"({memory['peak_pss_total_mib'] / 1024:.2f} GiB of physical memory" in main_row
