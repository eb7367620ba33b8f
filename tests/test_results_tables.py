"""docs/results.md's generated tables are what `python -m scripts.results_tables` lays out from the
archived runs now (pure file reading), and the layout's rules hold on hand-made facts."""

from __future__ import annotations

import copy

from scripts import results_far, results_layout, results_near, results_tables
from scripts.doc_blocks import read_block, sync


def test_every_generated_table_of_results_md_is_the_one_the_archived_runs_give():
    blocks = results_tables.blocks()
    text = results_tables.DOC.read_text()
    assert all(read_block(text, name) is not None for name in blocks), "docs/results.md lost a table's markers"
    stale = sync(results_tables.DOC, blocks, results_tables.COMMAND, check=True)
    assert stale == [], f"{stale} differ from the archived runs: run `python -m scripts.results_tables`"


def test_paired_differences_are_bold_only_when_ahead_in_every_seed():
    facts = results_tables.read_facts(sorted(results_tables.RUNS_FAR.iterdir()))
    row = next(r for r in results_far.far_paired(facts).splitlines() if r.startswith("| KD − EOPD"))
    assert row.split(" | ")[1] == "+1.2 (−0.8, +1.0, +3.3)"  # one seed behind: not bold
    moved = copy.deepcopy(facts)
    kd0 = next(f for f in moved if f["variant"] == "kd" and f["seed"] == 0)
    kd0["sets"]["held-out"]["final"]["avg"] += 0.02  # seed 0 now 1.2 points ahead
    row = next(r for r in results_far.far_paired(moved).splitlines() if r.startswith("| KD − EOPD"))
    assert row.split(" | ")[1] == "**+1.8** (+1.2, +1.0, +3.3)"


def test_a_mean_exact_in_counts_prints_as_its_exact_value():
    assert results_layout.mean_range([1 / 320, 6 / 320, 5 / 320]) == "0.013 (0.003-0.019)"


def test_gkd_layout_differences_are_paired_by_seed_and_bold_only_when_ahead_in_every_seed():
    both = results_tables.with_gkd_layout(results_tables.read_facts(sorted(results_tables.RUNS.iterdir())))
    rows = {r.split(" | ")[0]: r.split(" | ") for r in results_near.gkd_layouts(both, ("0.5", "1.0"), "@trl").splitlines()}
    assert rows["| 1.0"][2] == "**+6.1 (+8.8, +2.0, +7.4)**"  # ahead in every seed
    assert rows["| 0.5"][2] == "−2.1 (−10.9, −2.0, +6.6)"
    moved = copy.deepcopy(both)
    for f in moved:
        if f["variant"] == "gkd0.5@trl" and f["seed"] in (0, 1):
            f["sets"]["held-out"]["final"]["avg"] += 0.2  # now ahead in every seed
    row = next(r for r in results_near.gkd_layouts(moved, ("0.5",), "@trl").splitlines() if r.startswith("| 0.5"))
    assert row.split(" | ")[2].startswith("**+11.2 (")
